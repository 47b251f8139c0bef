"""`perfsim validate`: predictions against real training steps.

`--megatron-log FILE` with the run's model, system and plan flags compares a Megatron-DeepSpeed
run's logged step time and `TFLOPs:` (perfsim/megatron_log.py) with the prediction's step_time_s
and megatron_ds_tflops_per_device.

`--device D --nproc N` runs real training steps here (validate/timing.py launches
validate/steps.py as N ranks per plan): every plan (`--plans`, plan flags for one, or the default
set of at least 12) is timed and counted, predicted with the device's calibrated profile, and kept
in the ledger (`--ledger`, resumed on a re-run).
"""

from __future__ import annotations

import json

from perfsim.errors import PerfsimError


def register(sub) -> None:
    from perfsim.cli import _add_case_flags, _add_plan_flags, _positive

    p = sub.add_parser("validate", help="compare predictions with real training steps (run here, or a Megatron-DeepSpeed log)")
    p.add_argument("--megatron-log", dest="megatron_log", metavar="FILE",
                   help="stdout of a Megatron-DeepSpeed run: its 'elapsed time per iteration (ms)' and 'TFLOPs:' lines")
    p.add_argument("--device", choices=("cpu", "cuda", "xpu"), help="run real training steps here on this device kind")
    p.add_argument("--nproc", type=_positive, help="ranks for --device runs (default 2 on cpu, else 1)")
    p.add_argument("--plans", help="';'-separated plans as FIELD=VALUE lists, e.g. 'tp=2,sp=true,recompute=full;"
                   "pp=2,schedule=gpipe,gbs=8' (default: plan flags for one plan, else a set of at least 12)")
    p.add_argument("--steps", type=_positive, default=3, help="timed steps per plan (default 3; the median is used)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first, the first of them measuring peak memory (default 1)")
    p.add_argument("--ledger", help="JSON Lines file the runs are appended to and resumed from "
                   "(default validation-DEVICE.jsonl)")
    p.add_argument("--timeout", type=_positive, default=300,
                   help="seconds a collective may wait before the run ends with an error (default 300)")
    p.add_argument("--threads", type=_positive, help="CPU threads per rank (default: cores / ranks)")
    _add_case_flags(p)
    _add_plan_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _relative(predicted, measured):
    return None if measured in (None, 0) else (predicted - measured) / measured


def compare_log(args) -> dict:
    from perfsim.cli import build_case
    from perfsim.megatron_log import read_log
    from perfsim.predict import predict

    summary = read_log(args.megatron_log)
    model, system, plan = build_case(args)
    prediction = predict(model, system, plan, dtype=args.dtype)
    measured_tflops = summary.tflops_per_device
    return {
        "log": args.megatron_log, "intervals": len(summary.step_times_s), "skipped_first_interval": summary.skipped_first,
        "step_time_s": {"predicted": prediction.step_time_s, "measured": summary.step_time_s,
                        "relative_error": _relative(prediction.step_time_s, summary.step_time_s)},
        "megatron_ds_tflops_per_device": {"predicted": prediction.megatron_ds_tflops_per_device,
                                          "measured": measured_tflops,
                                          "relative_error": _relative(prediction.megatron_ds_tflops_per_device,
                                                                      measured_tflops)},
        "plan": plan.as_dict(), "model": model.name, "system": system.name, "devices": plan.devices,
    }


def format_comparison(r: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{100 * x:+.1f}%"

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    st, tf = r["step_time_s"], r["megatron_ds_tflops_per_device"]
    first = "first interval left out (warm-up), " if r["skipped_first_interval"] else ""
    lines = [f"Megatron-DeepSpeed log {r['log']}: {r['intervals']} logged interval(s), {first}median",
             f"model {r['model']} on {r['system']}, {r['devices']} devices",
             "",
             f"{'':<28}{'predicted':>12}{'measured':>12}{'error':>9}",
             f"{'step time (s)':<28}{st['predicted']:>12.4g}{st['measured']:>12.4g}{pct(st['relative_error']):>9}",
             f"{'TFLOPs per device (DS)':<28}{tf['predicted']:>12.4g}{num(tf['measured'], '>12.4g'):>12}"
             f"{pct(tf['relative_error']):>9}"]
    return "\n".join(lines)


def run_steps(args) -> list:
    """The --device timing run."""
    from perfsim.cli import PLAN_FLAGS
    from validate import timing

    if args.megatron_log is not None:
        raise PerfsimError("give either --megatron-log or --device, not both")
    if args.dtype not in timing.DTYPE_BYTES:
        raise PerfsimError(f"--dtype {args.dtype} cannot be run by the harness; use bf16 or fp32")
    if args.warmup < 1:
        raise PerfsimError(f"--warmup must be at least 1 (the first step measures memory), got {args.warmup}")
    nproc = args.nproc or (2 if args.device == "cpu" else 1)
    system = args.system or timing.DEFAULT_SYSTEM.get(args.device)
    if system is None:
        raise PerfsimError(f"--device {args.device} needs --system: the profile calibrated for it "
                           f"(perfsim calibrate --device {args.device} ... --out PROFILE.toml)")
    model = args.model or timing.DEFAULT_MODEL
    given = {k: getattr(args, k) for k in PLAN_FLAGS if getattr(args, k) is not None}
    if args.plans and given:
        raise PerfsimError("give either --plans or plan flags (--tp, --pp, ...), not both")
    if args.plans:
        plans = timing.parse_plans(args.plans)
    elif given:
        from perfsim.cli import build_case

        args.model, args.system, args.devices = model, system, nproc
        plans = [build_case(args)[2]]
    else:
        plans = timing.default_plans(nproc)
    results = timing.run_plans(plans, model, system, args.device, nproc, args.dtype, args.steps, args.warmup,
                               args.ledger, float(args.timeout), args.threads)
    print(json.dumps(results, indent=2) if args.json else timing.format_table(results))
    return results


def run(args) -> None:
    if args.device is not None:
        run_steps(args)
        return
    if args.megatron_log is None:
        raise PerfsimError("perfsim validate needs --megatron-log FILE (the stdout of a Megatron-DeepSpeed run) "
                           "and the run's --model/--system/plan flags")
    result = compare_log(args)
    print(json.dumps(result, indent=2) if args.json else format_comparison(result))
