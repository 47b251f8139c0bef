"""`perfsim validate`: predictions against real training steps.

`--megatron-log FILE` with the run's model, system and plan flags compares a Megatron-DeepSpeed
run's logged step time and `TFLOPs:` (perfsim/megatron_log.py) with the prediction's step_time_s
and megatron_ds_tflops_per_device. Real-step runs on this machine (`--device`, `--nproc`) are the
validate/ harness's part (validate/gpt.py, validate/tp_check.py); their timing run is not wired
into this command yet.
"""

from __future__ import annotations

import json

from perfsim.errors import PerfsimError


def register(sub) -> None:
    from perfsim.cli import _add_case_flags, _add_plan_flags, _positive

    p = sub.add_parser("validate", help="compare predictions with real training steps (a Megatron-DeepSpeed log)")
    p.add_argument("--megatron-log", dest="megatron_log", metavar="FILE",
                   help="stdout of a Megatron-DeepSpeed run: its 'elapsed time per iteration (ms)' and 'TFLOPs:' lines")
    p.add_argument("--device", choices=("cpu", "cuda", "xpu"), help="run real steps here (not available yet)")
    p.add_argument("--nproc", type=_positive, help="ranks for --device runs")
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


def run(args) -> None:
    if args.megatron_log is None:
        if args.device is not None:
            raise PerfsimError("perfsim validate --device is not available yet; compare a run's log with "
                               "--megatron-log FILE, or run the harness checks in validate/ (python -m validate.tp_check)")
        raise PerfsimError("perfsim validate needs --megatron-log FILE (the stdout of a Megatron-DeepSpeed run) "
                           "and the run's --model/--system/plan flags")
    result = compare_log(args)
    print(json.dumps(result, indent=2) if args.json else format_comparison(result))
