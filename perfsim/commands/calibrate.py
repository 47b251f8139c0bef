"""`perfsim calibrate`: measure this machine with validate/ and fit a system profile (docs/calibration.md).

    perfsim calibrate --device cpu --nproc 2 [--ledger FILE] [--out PROFILE.toml] [--quick]
    perfsim calibrate --emit-slurm FILE --nodes N [--time HH:MM:SS] [--partition P] [--account A]
    perfsim calibrate --fit LEDGER --system BASE --out FILE

The first runs the campaign locally (one process per rank, like torchrun) and fits; the second
writes a Slurm batch script for SMNG-P2 whose records come back with the third. `--worker` is what
launchers run on each rank. torch is imported only by the commands that measure.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

from perfsim.calibrate import SUITES
from perfsim.commands.flags import positive, slurm_name, walltime, whole_number
from perfsim.errors import PerfsimError
from perfsim.harness import harness

DEVICES = ("cpu", "cuda", "xpu")
DEFAULT_MODEL = {"cpu": "gpt3-350m", "cuda": "gpt3-1.3b", "xpu": "smng-p2-20b"}
DEFAULT_SYSTEM = {"cpu": "cpu-example", "xpu": "smng-p2"}
DEFAULT_DTYPES = {"cpu": ("fp32", "bf16"), "cuda": ("bf16",), "xpu": ("bf16",)}
DTYPES = ("fp32", "bf16", "fp16")
# the plan fields that decide which kernel shapes, tensor sizes and groups a campaign measures
PLAN_KEYS = ("tp", "tp_mode", "tp_depth", "sp", "cp", "pp", "mbs", "order", "tp_axes")
# expert parallelism's: its all-to-all groups are measured (validate.microbench); from --plans kept
# only where they differ from a dense plan's, so a dense campaign's plan reads as before
EXPERT_PLAN_KEYS = {"ep": 1, "etp": 0}
# what --suites may name: the microbenchmark suites of the ledger, and "overheads", real training
# steps of a calibration model that give the framework overheads (perfsim.calibrate.overheads)
OVERHEADS = "overheads"
CALIBRATE_SUITES = SUITES + (OVERHEADS,)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (math.isfinite(value) and 0 <= value <= 10):
        raise argparse.ArgumentTypeError(f"expected seconds from 0 to 10, got {text}")
    return value


_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
          "g": 1024**3, "gib": 1024**3, "gb": 1000**3}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 256MiB, 64M or 1048576, got {text!r}")
    value = int(float(match.group(1)) * _UNITS[unit])
    if not 1024 <= value <= 64 * 1024**3:
        raise argparse.ArgumentTypeError(f"expected a size from 1 KiB to 64 GiB, got {text!r}")
    return value


def _choices(allowed):
    def parse(text: str) -> tuple:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed)}, got {text!r}")
        return items
    return parse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure GEMMs, memory ops and collectives here and fit a system profile",
        description="Measure this machine (validate/ microbenchmarks, needs torch) and fit a calibrated profile; "
                    "or write a Slurm script for SMNG-P2; or fit a ledger measured elsewhere.")
    p.add_argument("--device", choices=DEVICES, help="what one rank owns: cpu (one core per rank), cuda, xpu (one tile)")
    p.add_argument("--nproc", type=whole_number(1, 4096), help="ranks on this machine, 1 to 4096 (default: cores on cpu, "
                                                         "visible GPUs/tiles)")
    p.add_argument("--ledger", help="JSON Lines file of measurements; appended to, resumed from "
                                    "(default calibration-DEVICE.jsonl)")
    p.add_argument("--out", help="calibrated profile to write (default SYSTEM-calibrated.toml)")
    p.add_argument("--system", help="base profile the fit starts from (default: cpu-example on cpu, smng-p2 on xpu)")
    p.add_argument("--name", help="name of the calibrated profile (default: --out's file name)")
    p.add_argument("--description", help="description of the calibrated profile (default: base profile, host, "
                                         "device and ledger)")
    p.add_argument("--quick", action="store_true", help="a few small points only (a smoke test, seconds)")
    p.add_argument("--no-fit", dest="no_fit", action="store_true", help="measure only")
    p.add_argument("--statistic", choices=("expected", "min", "median", "p25", "mean"), default="expected",
                   help="which statistic of each point's repetitions the fit uses (default expected: what a training "
                        "step pays on average, the mean of compute points and, for collectives, the fastest "
                        "repetition plus a per-operation step overhead; min: the machine without interference)")
    p.add_argument("--clock", choices=("auto", "wall"), default="auto",
                   help="auto (default): fit the CPU time of compute points measured on one-thread CPU ranks (immune "
                        "to other processes on a shared machine), wall clock elsewhere; wall: wall clock everywhere")
    w = p.add_argument_group("what to measure")
    w.add_argument("--model", help="model whose GEMMs and groups to measure (default per device: "
                                   + ", ".join(f"{k} {v}" for k, v in DEFAULT_MODEL.items()) + ")")
    w.add_argument("--tp", type=positive, help="tensor-parallel size (default: ranks per node)")
    w.add_argument("--tp-mode", dest="tp_mode", choices=("1d", "2d", "2.5d", "3d"))
    w.add_argument("--tp-depth", dest="tp_depth", type=positive)
    w.add_argument("--sp", action="store_true", default=None)
    w.add_argument("--cp", type=positive, help="context-parallel size (default 1)")
    w.add_argument("--pp", type=positive)
    w.add_argument("--mbs", type=positive)
    w.add_argument("--order", help="rank order, innermost first (default tp-dp-pp)")
    w.add_argument("--tp-axes", dest="tp_axes")
    w.add_argument("--ep", type=positive, help="expert-parallel size of a model with experts: its all-to-all groups "
                                                "are measured too (default 1)")
    w.add_argument("--etp", type=positive, help="tensor parallelism inside the experts (default: --tp)")
    w.add_argument("--plans", help="';'-separated plans as FIELD=VALUE lists (as perfsim validate --plans), e.g. "
                                   "'tp=2,mbs=2;pp=2,mbs=2;cp=2': measure the kernel shapes, sizes and groups of each, "
                                   "one campaign per plan into the same ledger (what they share is measured once); "
                                   "instead of the plan flags")
    w.add_argument("--dtypes", type=_choices(DTYPES), help="compute dtypes (default: fp32,bf16 on cpu, bf16 on GPUs)")
    w.add_argument("--suites", type=_choices(CALIBRATE_SUITES),
                   help=f"what to measure (default all: {','.join(CALIBRATE_SUITES)}; {OVERHEADS}: real training steps of "
                        f"a calibration model, for the framework overheads)")
    w.add_argument("--max-bytes", dest="max_bytes", type=parse_bytes,
                   help="largest collective message (default 256MiB; 1MiB with --quick)")
    w.add_argument("--warmup", type=whole_number(0, 1000), default=None, help="untimed calls before timing, 0 to 1000 (default 2)")
    w.add_argument("--repeats", type=whole_number(1, 1000), default=None, help="timed repetitions per point, 1 to 1000 (default 5)")
    w.add_argument("--min-time", dest="min_time", type=_seconds, default=None,
                   help="shortest repetition in seconds; short ops are looped (default 0.002)")
    w.add_argument("--threads", type=whole_number(1, 4096), help="CPU threads per rank, 1 to 4096 (default: cores / ranks)")
    s = p.add_argument_group("Slurm (SMNG-P2)")
    s.add_argument("--emit-slurm", dest="emit_slurm", metavar="FILE", help="write a batch script and stop")
    s.add_argument("--nodes", type=positive, help="nodes of the Slurm job (8 tiles each)")
    s.add_argument("--time", type=walltime, default="01:00:00", help="Slurm time limit (default 01:00:00)")
    s.add_argument("--partition", type=slurm_name)
    s.add_argument("--account", type=slurm_name)
    s.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="shell line to run before the campaign (module load ..., source venv/bin/activate); repeatable")
    p.add_argument("--fit", metavar="LEDGER", help="fit a ledger measured before (here or elsewhere) and stop")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=run)


def _options(args, world: int, ranks_per_node: int, given: dict | None = None):
    """The campaign's Options; `given`: the plan fields of one of --plans instead of the plan flags."""
    Options = harness("campaign").Options

    device = args.device
    model = args.model or DEFAULT_MODEL[device]
    plan = dict(given) if given is not None else {k: getattr(args, k) for k in PLAN_KEYS + tuple(EXPERT_PLAN_KEYS)
                                                  if getattr(args, k, None) is not None}
    if "tp" not in plan:
        plan["tp"] = _default_tp(model, ranks_per_node, plan.get("tp_mode", "1d"))
    tp, cp, pp = plan["tp"], plan.get("cp", 1), plan.get("pp", 1)
    if world % (tp * cp * pp):
        raise PerfsimError(f"{world} ranks is not a multiple of tp x cp x pp = {tp * cp * pp}; change the plan or "
                           "--nproc/--nodes")
    plan["dp"] = world // (tp * cp * pp)
    plan["gbs"] = plan.get("mbs", 1) * plan["dp"]
    return Options(device=device, ledger=_ledger_path(args), model=model, plan=plan,
                   dtypes=args.dtypes or DEFAULT_DTYPES[device],
                   suites=tuple(x for x in args.suites or SUITES if x in SUITES), quick=args.quick,
                   max_bytes=args.max_bytes,
                   warmup=args.warmup if args.warmup is not None else (1 if args.quick else 2),
                   repeats=args.repeats or (3 if args.quick else 5),
                   min_time_s=args.min_time if args.min_time is not None else (5e-4 if args.quick else 2e-3),
                   threads=args.threads)


def given_plans(args) -> list:
    """[plan fields] of each of --plans (the fields that decide what a campaign measures), or
    [None]: the plan flags."""
    if not getattr(args, "plans", None):
        return [None]
    given = [k for k in PLAN_KEYS + tuple(EXPERT_PLAN_KEYS) if getattr(args, k, None) is not None]
    if given:
        raise PerfsimError(f"give either --plans or plan flags (--{given[0].replace('_', '-')}, ...), not both")
    parse_plans = harness("timing").parse_plans

    out = []
    for plan in parse_plans(args.plans):
        fields = plan.as_dict()
        kept = {k: fields[k] for k in PLAN_KEYS if k in fields}
        kept.update({k: fields[k] for k, dense in EXPERT_PLAN_KEYS.items() if fields.get(k, dense) != dense})
        if kept not in out:  # plans that differ only in what changes no kernel (recompute, ZeRO, ...) measure alike
            out.append(kept)
    return out


def _ledger_path(args) -> str:
    return args.ledger or f"calibration-{args.device}.jsonl"


def _default_tp(model_text: str, ranks_per_node: int, mode: str) -> int:
    """Tensor parallelism over a node's ranks (1d): the largest power of two that divides the
    heads and the ranks per node."""
    from perfsim.spec.model import load_model

    if mode != "1d":
        return 1
    model = load_model(model_text)
    tp = 1
    while ranks_per_node % (tp * 2) == 0 and model.heads % (tp * 2) == 0:
        tp *= 2
    return tp


def _check_plan(options, world):
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan, plan_problems

    model = load_model(options.model)
    try:
        plan = Plan(**options.plan)
    except TypeError as exc:
        raise PerfsimError(f"bad plan: {exc}") from None
    problems = plan_problems(plan, model, world)
    if problems:
        raise PerfsimError(f"plan for {world} ranks of {options.model}: " + "; ".join(problems))


def run(args) -> None:
    if args.fit:
        return _run_fit(args)
    if args.emit_slurm:
        return _run_emit_slurm(args)
    if args.device is None:
        raise PerfsimError("give --device cpu|cuda|xpu (or --fit LEDGER, or --emit-slurm FILE --nodes N)")
    harness("campaign")  # a one-line error if the harness is not installed
    if args.worker:
        run_worker = harness("campaign").run_worker
        rank_environment = harness("ranks").rank_environment
        die_with_launcher = harness("launcher").die_with_launcher

        die_with_launcher()  # a rank of launch_local: it dies with the launcher
        ranks = rank_environment()
        run_worker(_options(args, ranks.world, ranks.local_world))
        # Leave without the interpreter's teardown, as a validation step's rank does
        # (validate/steps.py): a C++ thread of torch's runtime still joinable at exit aborts the
        # process now and then ("terminate called without an active exception"), which failed a
        # whole calibration after every point was measured and written (transfer run, generic).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return _run_local(args)


def _run_local(args) -> None:
    LedgerLock, check_path = harness("ledger").LedgerLock, harness("ledger").check_path

    system = _base_system_name(args)
    check_path(_ledger_path(args))
    # held for the campaign and its fit, taken first: a second campaign on this ledger is refused
    # at once, before it imports torch or starts a rank
    with LedgerLock(_ledger_path(args)):
        _measure_and_fit(args, system)


def _measure_and_fit(args, system: str) -> None:
    check_available, distributed_backend = harness("device").check_available, harness("device").distributed_backend

    out = None if args.no_fit else _out(args, system)
    if out:
        _check_out(out)
        from perfsim.spec.system import load_system
        load_system(system)
    check_available(args.device)
    nproc = args.nproc or _visible_devices(args.device)
    if nproc > 1:
        distributed_backend(args.device)
    campaigns = [_options(args, nproc, nproc, given) for given in given_plans(args)]
    for options in campaigns:
        _check_plan(options, nproc)
    launch_local = harness("campaign").launch_local

    for i, options in enumerate(campaigns, 1):
        which = f" ({i} of {len(campaigns)} plans)" if len(campaigns) > 1 else ""
        print(f"perfsim calibrate: {nproc} {args.device} rank(s), model {options.model}, plan "
              f"{', '.join(f'{k}={v}' for k, v in options.plan.items())}{which}; ledger {options.ledger}",
              file=sys.stderr, flush=True)
        if options.suites:
            launch_local(options, nproc)
    options = campaigns[0]  # the overhead runs train their own calibration model, whatever the plans
    if OVERHEADS in (args.suites or CALIBRATE_SUITES):
        if out:
            _run_overheads(args, options, nproc, system)
        else:
            print(f"perfsim calibrate: no {OVERHEADS} runs with --no-fit (their speed probes need the fitted profile)",
                  file=sys.stderr)
    if out:
        from perfsim.calibrate import fit_ledger
        fit_ledger(options.ledger, system, out, args.name, device_kind=args.device,
                   warn=lambda m: print(m, file=sys.stderr), statistic=args.statistic,
                   clock=args.clock, description=args.description)


def _run_overheads(args, options, nproc: int, system: str) -> None:
    """Real training steps of the calibration model (perfsim.calibrate.overheads) into the ledger's
    NAME-overheads.jsonl, timed against a provisional fit of the kernels (their speed probes).
    Resumable like every ledger: runs already there are read back."""
    import tempfile

    from perfsim.calibrate import fit_ledger
    from perfsim.calibrate.overheads import (ALONE_STEPS, HOST_STEPS, QUICK_ALONE_STEPS, QUICK_HOST_STEPS, alone_case,
                                             host_cases, overhead_cases, overheads_dtype, overheads_ledger)
    timing = harness("timing")

    dtype = overheads_dtype(options.dtypes)
    steps_ledger = overheads_ledger(options.ledger)
    print(f"perfsim calibrate: framework overheads from real steps of the calibration model ({dtype}); ledger "
          f"{steps_ledger}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="perfsim-calibrate-") as tmp:
        provisional = os.path.join(tmp, "provisional.toml")
        fit_ledger(options.ledger, system, provisional, report=lambda m: None, warn=lambda m: None,
                   statistic=args.statistic, clock=args.clock)
        for model, plans in overhead_cases(nproc, options.quick):
            timing.run_plans(plans, model, provisional, args.device, nproc, dtype, steps=2 if options.quick else 3,
                             warmup=1, ledger_path=steps_ledger, threads=args.threads)
        alone = alone_case(nproc)  # the ranks' spread, each rank its own copy (framework.rank_jitter)
        if alone is not None:
            timing.run_plans(alone[1], alone[0], provisional, args.device, nproc, dtype, warmup=1,
                             steps=QUICK_ALONE_STEPS if options.quick else ALONE_STEPS, ledger_path=steps_ledger,
                             threads=args.threads, alone=True)
        for model, plans in host_cases():  # the layer's host time (framework.layer_overhead_s)
            timing.run_plans(plans, model, provisional, args.device, nproc, dtype, warmup=1,
                             steps=QUICK_HOST_STEPS if options.quick else HOST_STEPS, ledger_path=steps_ledger,
                             threads=args.threads, alone=True)


def _visible_devices(device: str) -> int:
    if device == "cpu":
        return max(1, os.cpu_count() or 1)
    import torch
    return max(1, getattr(torch, device).device_count())


def _base_system_name(args) -> str:
    if args.system:
        return args.system
    if args.device in DEFAULT_SYSTEM:
        return DEFAULT_SYSTEM[args.device]
    raise PerfsimError(f"give --system: the profile to calibrate (no default base profile for --device {args.device}; "
                       f"e.g. dgx-a100 or dgx-h100), or --no-fit to measure only")


def _out(args, system: str) -> str:
    """--out, or SYSTEM-calibrated.toml when it is left out (an empty --out is refused by _check_out)."""
    return args.out if args.out is not None else f"{os.path.splitext(os.path.basename(system))[0]}-calibrated.toml"


def _check_out(out: str) -> None:
    from perfsim.files import check_output

    check_output(out, "--out", "calibrated.toml")


def _run_fit(args) -> None:
    from perfsim.calibrate import fit_ledger

    if args.system is None and args.device not in DEFAULT_SYSTEM:
        raise PerfsimError("--fit needs --system BASE: the profile the fit starts from (e.g. smng-p2, cpu-example)")
    system = _base_system_name(args)
    out = _out(args, system)
    _check_out(out)
    fit_ledger(args.fit, system, out, args.name, device_kind=args.device, warn=lambda m: print(m, file=sys.stderr),
               statistic=args.statistic, clock=args.clock, description=args.description)


def _suite_launches(options, system: str) -> tuple:
    """(SuiteLaunch per microbenchmark suite, in the order that settles most of the doubt about
    the plan and the step time first; the comment lines saying so; the overheads suite's comment)."""
    import dataclasses

    from perfsim.calibrate.priority import builtin_case_priorities
    worker_argv, SuiteLaunch = harness("campaign").worker_argv, harness("slurm").SuiteLaunch

    ranked, unmeasured = builtin_case_priorities(system, CALIBRATE_SUITES)
    note = ["Suites in the order of what their numbers settle (perfsim/calibrate/priority.py,",
            "docs/calibration.md): the built-in case (gpt3-175b on 16 nodes, global batch 300) over prior",
            f"draws of {system}'s ranges; `perfsim sensitivity --plan-choice` shows the numbers one by one."]
    note += [f"Not measured by this job: {key} ({decides:.0%} of the doubt about the plan, {moves:.0%} of the "
             "step time's variance)" for key, decides, moves in unmeasured]
    launches = tuple(SuiteLaunch(p.comment(), tuple(worker_argv(dataclasses.replace(options, suites=(p.suite,)))))
                     for p in ranked if p.suite in options.suites)
    overheads = next(p.comment() for p in ranked if p.suite == OVERHEADS)
    return launches, tuple(note), overheads


def _overhead_runs(options, system: str, world: int, comment: str):
    """The overheads suite of the Slurm job (OverheadRuns), after the suites its provisional fit needs."""
    from perfsim.calibrate.overheads import alone_case, host_cases, overhead_cases, overheads_dtype, overheads_ledger
    OverheadRuns = harness("slurm").OverheadRuns

    provisional = os.path.splitext(options.ledger)[0] + "-provisional.toml"
    dtype = overheads_dtype(options.dtypes)
    runs = tuple((model, plan.as_dict()) for model, plans in overhead_cases(world, options.quick) for plan in plans)
    alone = alone_case(world)  # the ranks' spread: the run alone on every rank (framework.rank_jitter)
    runs += tuple((alone[0], plan.as_dict(), "alone") for plan in alone[1]) if alone else ()
    runs += tuple((model, plan.as_dict(), "alone") for model, plans in host_cases() for plan in plans)  # layer_overhead_s
    fit = ("calibrate", "--fit", options.ledger, "--system", system, "--device", "xpu", "--out", provisional)
    return OverheadRuns(comment=comment + "; after the suites above, whose fit times its steps", runs=runs,
                        provisional_fit_argv=fit, provisional=provisional, ledger=overheads_ledger(options.ledger),
                        dtype=dtype, steps=2 if options.quick else 3)


def _run_emit_slurm(args) -> None:
    slurm = harness("slurm")
    TILES_PER_NODE, Job, script = slurm.TILES_PER_NODE, slurm.Job, slurm.script

    if args.nodes is None:
        raise PerfsimError("--emit-slurm needs --nodes N (8 tiles, so 8 ranks, per node)")
    if args.plans:
        raise PerfsimError("--emit-slurm measures one plan (the plan flags); --plans is for campaigns on this machine")
    args.device = args.device or "xpu"
    if args.device != "xpu":
        raise PerfsimError("--emit-slurm writes an SMNG-P2 (XPU) job; use --device xpu or leave --device out")
    world = args.nodes * TILES_PER_NODE
    options = _options(args, world, TILES_PER_NODE)
    _check_plan(options, world)
    system = args.system or DEFAULT_SYSTEM["xpu"]
    from perfsim.spec.system import load_system
    load_system(system)
    out = _out(args, system)
    fit = ("calibrate", "--fit", options.ledger, "--system", system, "--device", "xpu", "--out", out)
    suites, note, overheads_comment = _suite_launches(options, system)
    overheads = None
    if OVERHEADS in (args.suites or CALIBRATE_SUITES) and not args.no_fit:  # as locally: its probes need a fit
        overheads = _overhead_runs(options, system, world, overheads_comment)
    if not suites and overheads is None:
        raise PerfsimError(f"--suites {OVERHEADS} with --no-fit measures nothing (its speed probes need a fit); "
                           "leave out --no-fit or name another suite")
    job = Job(nodes=args.nodes, suites=suites, order_note=note, overheads=overheads,
              fit_argv=() if args.no_fit else fit, time=args.time, partition=args.partition, account=args.account,
              setup=tuple(args.setup))
    from perfsim.files import write_output

    path = args.emit_slurm  # a new script is executable; an existing file keeps its permissions
    write_output(path, "--emit-slurm", script(job), executable=True, example="calibrate.sbatch")
    print(f"wrote {path}: {args.nodes} nodes x {TILES_PER_NODE} tiles; submit with `sbatch {path}`")
