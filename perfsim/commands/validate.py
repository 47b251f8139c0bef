"""`perfsim validate`: predictions against real training steps.

`--megatron-log FILE` with the run's model, system and plan flags compares a Megatron-DeepSpeed
run's logged step time and `TFLOPs:` (perfsim/megatron_log.py) with the prediction's step_time_s
and megatron_ds_tflops_per_device.

`--device D --nproc N` runs real training steps here (validate/timing.py launches
validate/steps.py as N ranks once for all the plans to measure): every plan (`--plans`, plan flags for one, or the default
set of at least 12) is timed and counted, predicted with the device's calibrated profile, and kept
in the ledger (`--ledger`, resumed on a re-run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from perfsim.errors import PerfsimError
from perfsim.harness import harness


def register(sub) -> None:
    from perfsim.commands.flags import add_case_flags, add_plan_flags, whole_number

    p = sub.add_parser("validate", help="compare predictions with real training steps (run here, or a Megatron-DeepSpeed log)")
    p.add_argument("--megatron-log", dest="megatron_log", metavar="FILE",
                   help="stdout of a Megatron-DeepSpeed run: its 'elapsed time per iteration (ms)' and 'TFLOPs:' lines")
    p.add_argument("--device", choices=("cpu", "cuda", "xpu"), help="run real training steps here on this device kind")
    p.add_argument("--nproc", type=whole_number(1, 4096), help="ranks for --device runs, 1 to 4096 (default 2 on cpu, else 1)")
    p.add_argument("--plans", help="';'-separated plans as FIELD=VALUE lists, e.g. 'tp=2,sp=true,recompute=full;"
                   "pp=2,schedule=gpipe,gbs=8' (default: plan flags for one plan, else a set of at least 12)")
    p.add_argument("--steps", type=whole_number(1, 1000), default=3,
                   help="timed steps per plan, 1 to 1000 (default 3; the median is used)")
    p.add_argument("--rounds", type=whole_number(1, 100), default=1,
                   help="run the plan list this many times, 1 to 100; a plan's step time is the median over all its "
                        "rounds' steps (default 1; more weigh a machine whose speed drifts alike on every plan)")
    # 0.15: validate.speed_probe.DEFAULT_TOLERANCE, written out because this parser is built
    # where the validate/ harness may not be installed
    p.add_argument("--speed-tolerance", dest="speed_tolerance", type=_tolerance, default=0.15,
                   help="a timed step counts when the GEMM probe before it took within this fraction of what the "
                        "profile predicts (the machine ran at its calibrated speed); more steps are taken, up to "
                        "3 x --steps, until --steps of them do (default 0.15; 'inf' counts every step)")
    p.add_argument("--budget", type=_minutes, metavar="MINUTES",
                   help="minutes the plans still to be measured may take in all: past its share a plan takes no "
                        "more steps to replace those off the profile's speed, only its --steps (default: no limit)")
    p.add_argument("--warmup", type=whole_number(1, 100), default=1,
                   help="untimed steps after the first step (which makes one-time allocations), the first of them "
                        "measuring peak memory, 1 to 100 (default 1)")
    p.add_argument("--ledger", help="JSON Lines file the runs are appended to and resumed from "
                   "(default validation-DEVICE.jsonl)")
    p.add_argument("--timeout", type=whole_number(1, 86400), default=300,
                   help="seconds a collective may wait before the run ends with an error, up to a day (default 300)")
    p.add_argument("--threads", type=whole_number(1, 4096), help="CPU threads per rank, 1 to 4096 (default: cores / ranks)")
    # the harness's defaults (validate.timing.DEFAULT_MODEL, DEFAULT_SYSTEM, default_plans) written
    # out like the tolerance's; a test ties them
    add_case_flags(p, model_default=f"with --device or --emit-slurm, the harness's small GPT {HARNESS_MODEL}; with "
                                     "--megatron-log, gpt3-175b",
                    system_default="cpu-calibrated with --device cpu; with --device cuda or xpu give the profile "
                                   "calibrated for it; smng-p2 with --megatron-log or --emit-slurm")
    add_plan_flags(p, left_out="with --device, a set of at least 12 plans over --nproc ranks: 1d tensor parallelism "
                                "with and without SP under each recompute mode, the three pipeline schedules, ZeRO 0-3 "
                                "(a model with experts: expert parallelism with each dispatcher, beside expert-DP at 4 "
                                "ranks, folded into 1d + SP tensor parallelism, and ep 1); with --megatron-log, as "
                                "perfsim predict")
    p.add_argument("--json", action="store_true", help="print one JSON list, an object per plan (a Megatron-DeepSpeed "
                                                       "log: one object)")
    _add_slurm_flags(p)
    p.set_defaults(run=run, parser=p)  # the parser: a mismatch warning repeats the command line


HARNESS_MODEL = "layers=4,hidden=512,heads=8,seq=256,vocab=8192,tied_embeddings=false,dropout=false"


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected minutes such as 10, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of minutes, got {text}")
    return value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.15 (or inf), got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive fraction such as 0.15 (or inf), got {text}")
    return value


def _add_slurm_flags(p) -> None:
    from perfsim.commands.flags import slurm_name, walltime

    s = p.add_argument_group("Slurm (SMNG-P2): --emit-slurm FILE --nodes N writes the validation job and stops")
    s.add_argument("--emit-slurm", dest="emit_slurm", metavar="FILE",
                   help="write a batch script that runs the plans under mpiexec on --nodes N x 8 tiles (xccl/ccl)")
    s.add_argument("--time", type=walltime, default="01:00:00", help="Slurm time limit (default 01:00:00)")
    s.add_argument("--partition", type=slurm_name)
    s.add_argument("--account", type=slurm_name)
    s.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="shell line run before the steps (module load ..., source venv/bin/activate); repeatable")


def _chosen_plans(args, devices: int, **case) -> tuple:
    """(plans, whether they are the default set) on `devices` ranks: `--plans`, else the plan flags
    as one plan (perfsim.commands.flags.build_case, with `devices` and `case` -- model, system, nodes -- set
    on args), else validate.timing's default set."""
    from perfsim.commands.flags import PLAN_FLAGS

    timing = harness("timing")

    given = {k: getattr(args, k) for k in PLAN_FLAGS if getattr(args, k) is not None}
    if args.plans and given:
        raise PerfsimError("give either --plans or plan flags (--tp, --pp, ...), not both")
    if args.plans:
        return timing.parse_plans(args.plans), False
    if given:
        from perfsim.commands.flags import build_case

        for name, value in dict(case, devices=devices).items():
            setattr(args, name, value)
        return [build_case(args)[2]], False
    from perfsim.spec.model import load_model

    return timing.default_plans(devices, load_model(case["model"])), True


def emit_slurm(args) -> None:
    """`--emit-slurm FILE --nodes N`: the SMNG-P2 validation job (validate/slurm.py writes its text)."""
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import plan_problems

    slurm, timing = harness("slurm"), harness("timing")
    if args.nodes is None:
        raise PerfsimError("--emit-slurm needs --nodes N (8 tiles, so 8 ranks, per node)")
    if args.device not in (None, "xpu") or args.megatron_log is not None:
        raise PerfsimError("--emit-slurm writes an SMNG-P2 (XPU) job; leave out --megatron-log and --device (or give xpu)")
    if args.dtype not in timing.DTYPE_BYTES:
        raise PerfsimError(f"--dtype {args.dtype} cannot be run by the harness; use bf16 or fp32")
    world = args.nodes * slurm.TILES_PER_NODE
    model_spec, system = args.model or timing.DEFAULT_MODEL, args.system or "smng-p2"
    model = load_model(model_spec)
    plans, defaulted = _chosen_plans(args, world, model=model_spec, system=None, nodes=None)
    for plan in plans:
        problems = plan_problems(plan, model, world) + timing.harness_problems(plan, model)
        if problems:
            raise PerfsimError(f"plan {timing.plan_label(plan)} on {world} tiles: {'; '.join(problems)}"
                               + (" (give --plans for this node count)" if defaulted else ""))
    if len(plans) > slurm.MAX_PLANS:
        raise PerfsimError(f"a validation job runs at most {slurm.MAX_PLANS} plans, got {len(plans)}")
    ledger = args.ledger or "validation-xpu.jsonl"
    stem = os.path.splitext(ledger)[0]
    probes = tuple(slurm.probes(p.as_dict(), model_spec, system, args.dtype) for p in plans)
    job = slurm.ValidationJob(nodes=world // slurm.TILES_PER_NODE, plans=tuple(p.as_dict() for p in plans), probes=probes,
                              model=model_spec, system=system, dtype=args.dtype, steps=args.steps,
                              warmup=args.warmup, timeout=args.timeout, ledger=ledger, results=stem + "-results",
                              out=stem + ".json", time=args.time, partition=args.partition, account=args.account,
                              setup=tuple(args.setup))
    from perfsim.files import write_output

    path = args.emit_slurm  # a new script is executable; an existing file keeps its permissions
    write_output(path, "--emit-slurm", slurm.validation_script(job), executable=True, example="validate.sbatch")
    print(f"wrote {path}: {len(plans)} plan(s) on {job.nodes} nodes x {slurm.TILES_PER_NODE} tiles; "
          f"submit with `sbatch {path}`")


def _relative(predicted, measured):
    return None if measured in (None, 0) else (predicted - measured) / measured


def compare_log(args) -> dict:
    from perfsim.commands.flags import build_case
    from perfsim.megatron_log import read_log
    from perfsim.predict import predict

    summary = read_log(args.megatron_log)
    model, system, plan = build_case(args)
    logged = summary.global_batch_size
    if logged is not None and logged != plan.gbs:  # else the comparison prices another batch
        given = f"--gbs {plan.gbs}" if args.gbs is not None else f"{plan.gbs} (mbs x dp, --gbs left out)"
        raise PerfsimError(f"the log's global batch size is {logged} but the plan's is {given}; give the run's "
                           f"--gbs {logged} with its --mbs and parallel sizes")
    prediction = predict(model, system, plan, dtype=args.dtype)
    measured_tflops = summary.tflops_per_device
    return {
        "log": args.megatron_log, "intervals": len(summary.step_times_s), "skipped_first_interval": summary.skipped_first,
        "global_batch_size": logged, "skipped_ramp_up_intervals": summary.skipped_ramp,
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
    if r.get("skipped_ramp_up_intervals"):
        first += f"{r['skipped_ramp_up_intervals']} at a smaller global batch left out (ramp-up), "
    lines = [f"Megatron-DeepSpeed log {r['log']}: {r['intervals']} logged interval(s), {first}median",
             f"model {r['model']} on {r['system']}, {r['devices']} devices",
             "",
             f"{'':<28}{'predicted':>12}{'measured':>12}{'error':>9}",
             f"{'step time (s)':<28}{st['predicted']:>12.4g}{st['measured']:>12.4g}{pct(st['relative_error']):>9}",
             f"{'TFLOPs per device (DS)':<28}{tf['predicted']:>12.4g}{num(tf['measured'], '>12.4g'):>12}"
             f"{pct(tf['relative_error']):>9}"]
    return "\n".join(lines)


def run_steps(args) -> list:
    """The --device timing run; a warning above and below its results when the machine does not
    run at the profile's speed (docs/real-steps-timing.md, "A machine the profile does not describe")."""
    timing = harness("timing")
    command = command_line(args)  # before the plan flags fill in args (_chosen_plans)
    if args.megatron_log is not None:
        raise PerfsimError("give either --megatron-log or --device, not both")
    if args.dtype not in timing.DTYPE_BYTES:
        raise PerfsimError(f"--dtype {args.dtype} cannot be run by the harness; use bf16 or fp32")
    if args.warmup < 1:
        raise PerfsimError(f"--warmup must be at least 1 (the first untimed step after the first one measures memory), got {args.warmup}")
    nproc = args.nproc or (2 if args.device == "cpu" else 1)
    system = args.system or timing.DEFAULT_SYSTEM.get(args.device)
    if system is None:
        raise PerfsimError(f"--device {args.device} needs --system: the profile calibrated for it "
                           f"(perfsim calibrate --device {args.device} ... --out PROFILE.toml)")
    model = args.model or timing.DEFAULT_MODEL
    plans = _chosen_plans(args, nproc, model=model, system=system)[0]
    results = timing.run_plans(plans, model, system, args.device, nproc, args.dtype, args.steps, args.warmup,
                               args.ledger, float(args.timeout), args.threads, rounds=args.rounds,
                               speed_tolerance=args.speed_tolerance,
                               budget_s=None if args.budget is None else 60 * args.budget)
    verdict = timing.machine_verdict(results)
    warning = None if verdict["matches"] else timing.mismatch_warning(
        verdict, system, args.speed_tolerance, *_recalibration(args, command, nproc, system))
    if args.json:
        print(json.dumps(results, indent=2))
        if warning:
            print(warning, file=sys.stderr)
        return results
    if warning:  # no table that reads as a result without the warning and a heading that says so
        print(warning + "\n\n" + f"Measured against profile {system}, which does not describe this machine: the "
              "step-time columns compare the machine with the profile; memory, FLOPs and bytes sent do not depend "
              "on its speed and still test perfsim.\n")
    print(timing.format_table(results))
    if warning:
        print("\n" + warning)
    return results


def command_line(args) -> list:
    """The command as typed again: `perfsim validate` and every option whose value is not its
    default (from the parser), as a list of words."""
    words = ["perfsim", "validate"]
    for action in args.parser._actions:
        if not action.option_strings or action.dest in ("help", "parser"):
            continue
        value = getattr(args, action.dest, None)
        if value is None or value is False or value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        words += [flag] if value is True else [flag, str(value)]
    return words


def _recalibration(args, command: list, nproc: int, system: str) -> tuple:
    """The two commands a mismatch warning gives: calibrate this machine (from the profile just
    validated, into DEVICE-HOST.toml), then this validation again against that profile."""
    import re
    import shlex
    import socket

    host = re.sub(r"[^A-Za-z0-9_-]+", "-", socket.gethostname().split(".")[0]).strip("-") or "this-machine"
    profile = f"{args.device}-{host}.toml"
    if os.path.basename(profile) == os.path.basename(system):  # validated against it: calibrate afresh into it
        profile = f"{args.device}-{host}-recalibrated.toml"
    calibrate = ["perfsim", "calibrate", "--device", args.device, "--nproc", str(nproc), "--system", system,
                 "--out", profile] + (["--threads", str(args.threads)] if args.threads else [])
    again, skip = [], False
    for word in command:  # the same command with --system replaced
        if skip:
            skip = False
        elif word == "--system":
            skip = True
        else:
            again.append(word)
    return shlex.join(calibrate), shlex.join(again + ["--system", profile])


def run(args) -> None:
    if args.emit_slurm is not None:
        emit_slurm(args)
        return
    if args.device is not None:
        run_steps(args)
        return
    if args.megatron_log is None:
        raise PerfsimError("perfsim validate needs --megatron-log FILE (the stdout of a Megatron-DeepSpeed run) "
                           "and the run's --model/--system/plan flags")
    result = compare_log(args)
    print(json.dumps(result, indent=2) if args.json else format_comparison(result))
