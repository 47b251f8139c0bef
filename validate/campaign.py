"""A calibration campaign: what each rank does, and its local launch (validate.launcher).

Every rank runs the same list of points (validate.microbench.build_points) in the same order;
rank 0 keeps the ledger, tells the others which points are still to do, and shows progress.
Compute points run on every rank at once (as in training, where every device is busy); the
record holds rank 0's statistics and each rank's median. Collective points time the slowest
rank of each repetition.

Ranks come from the launcher's environment (validate.ranks.rank_environment). MASTER_ADDR /
MASTER_PORT come from the job (the Slurm script) or the local launcher.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import time
from dataclasses import dataclass

from perfsim.errors import PerfsimError
from validate.ranks import rank_environment

DERIVED_PLAN_KEYS = ("dp", "gbs")  # each rank derives them from the world size


@dataclass(frozen=True)
class Options:
    """What a campaign measures (one parser for the launcher and its workers: perfsim calibrate)."""

    device: str
    ledger: str
    model: str
    plan: dict
    dtypes: tuple
    suites: tuple
    quick: bool = False
    max_bytes: int | None = None
    warmup: int = 2
    repeats: int = 5
    min_time_s: float = 2e-3
    threads: int | None = None


def worker_argv(options: Options) -> list:
    """The `perfsim calibrate --worker ...` arguments that make a rank run `options`."""
    argv = ["calibrate", "--worker", "--device", options.device, "--ledger", options.ledger, "--model", options.model,
            "--dtypes", ",".join(options.dtypes), "--suites", ",".join(options.suites),
            "--warmup", str(options.warmup), "--repeats", str(options.repeats), "--min-time", repr(options.min_time_s)]
    for key, value in sorted(options.plan.items()):
        if key in DERIVED_PLAN_KEYS:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
            elif key in ("dp_overlap", "tp_overlap"):  # on/off flags whose default comes from the profile
                argv.append("--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    if options.quick:
        argv.append("--quick")
    if options.max_bytes:
        argv += ["--max-bytes", str(options.max_bytes)]
    if options.threads:
        argv += ["--threads", str(options.threads)]
    return argv


def launch_local(options: Options, nproc: int) -> None:
    """Run `nproc` ranks on this machine (validate.launcher) and wait for them. The caller holds
    the ledger's lock (validate.ledger.LedgerLock) for the campaign's length; rank 0 is told so
    (LEDGER_HELD_ENV) and writes without taking it."""
    from validate.launcher import launch_ranks
    from validate.ledger import LEDGER_HELD_ENV

    launch_ranks(["-m", "perfsim.cli"] + worker_argv(options), nproc, options.device, options.threads,
                 env={LEDGER_HELD_ENV: os.path.realpath(options.ledger)})


def run_worker(options: Options, environ=None, out=None) -> int:
    """One rank of a campaign. Returns the number of points measured."""
    import torch

    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan, plan_problems
    from validate import microbench as mb
    from validate.device import Device, distributed_backend, software_versions
    from validate.ledger import Ledger, held_for_me, relevant_env

    out = out or sys.stderr
    ranks = rank_environment(environ)
    threads = options.threads
    if options.device == "cpu" and not threads:
        threads = max(1, (os.cpu_count() or 1) // ranks.local_world)
    device = Device(options.device, ranks.local_rank, threads)
    dist = torch.distributed
    backend = None
    if ranks.world > 1:
        backend = distributed_backend(options.device)
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in (environ or os.environ):
                raise PerfsimError(f"{ranks.world} ranks but {var} is not set; the job script or launcher must set it")
        kwargs = {}
        if options.device != "cpu":
            kwargs["device_id"] = device.torch_device
        dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world, **kwargs)
    ledger = None
    try:
        model = load_model(options.model)
        plan = Plan(**options.plan)
        problems = plan_problems(plan, model, ranks.world)
        if problems:
            raise PerfsimError(f"plan for {ranks.world} ranks: " + "; ".join(problems))
        sweep = mb.default_sweep(options.device, options.quick, options.max_bytes)
        points = mb.build_points(options.device, options.dtypes, model, plan, ranks.world, ranks.local_world, sweep,
                                 options.suites)
        keys = [p.key(options.device, ranks.world) for p in points]
        if ranks.rank == 0:
            context = {"device": device.describe(), "host": socket.gethostname(),
                       "software": software_versions(options.device), "env": relevant_env(environ),
                       "world": ranks.world, "ranks_per_node": ranks.local_world, "backend": backend,
                       "model": options.model, "plan": options.plan}
            # the launcher holds the ledger's lock for us (launch_local), else rank 0 takes it
            ledger = Ledger(options.ledger, context, lock=not held_for_me(options.ledger, environ))
            todo = [i for i, k in enumerate(keys) if not ledger.done(k)]
            done = len(points) - len(todo)
            if done:
                print(f"perfsim calibrate: {done} of {len(points)} points already in {options.ledger}; "
                      f"measuring the other {len(todo)}", file=out, flush=True)
        else:
            todo = None
        if ranks.world > 1:
            box = [todo]
            dist.broadcast_object_list(box, src=0)
            todo = box[0]
        shapes = sorted({p.group for p in points if p.group})
        comm = mb.Communicator(torch, device, ranks.rank, ranks.world, shapes) if ranks.world > 1 else None
        references = (mb.References(torch, device)
                      if any(points[i].suite in mb.REFERENCE_SUITES for i in todo) else None)
        started, measured = time.monotonic(), 0

        def append(i: int, record: dict) -> None:  # rank 0: the ledger line and the progress line
            nonlocal measured
            measured += 1
            if ledger is None:
                return
            point = points[i]
            ledger.append({"key": keys[i], "suite": point.suite, "op": point.op, "dtype": point.dtype,
                           "shape": point.dims, "group": list(point.group) if point.group else None,
                           "origin": point.origin, **({"timing": point.timing} if point.timing else {}),
                           **record})
            elapsed = time.monotonic() - started
            eta = elapsed / measured * (len(todo) - measured)
            stats = record.get("stats")
            what = f"{stats['median_s'] * 1e3:.4g} ms" if stats else f"failed: {record.get('error')}"
            print(f"[{measured}/{len(todo)}, {elapsed:.0f} s, about {eta:.0f} s left] {point.describe()}: {what}",
                  file=out, flush=True)

        done_here = set()
        for i in todo:
            if i in done_here:
                continue
            point = points[i]
            turn = [j for j in todo if j not in done_here and in_turn_with(points[j], point)] \
                if comm is not None and timed_in_turn(point) else []
            # the sizes of an interleaved collective in turn, appended at once (a call too long for
            # the turn is measured alone right after); every other point alone
            if not turn:
                append(i, measure(torch, device, comm, point, options, references))
                continue
            for j, record in zip(turn, measure_in_turn(torch, device, comm, [points[j] for j in turn], options)):
                append(j, record or measure(torch, device, comm, points[j], options, references))
                done_here.add(j)
        return len(todo)
    finally:
        if ledger is not None:
            ledger.close()
        if ranks.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def precise_mean(comm, started: float):
    """microbench.repetitions' `more` for a collective: another batch while the slowest rank's
    repetitions are fewer than COLLECTIVE_MIN_BATCHES batches or leave their mean less precise than
    COLLECTIVE_PRECISION (from the batches' means: the first call's repetitions are one batch), and
    the point is within COLLECTIVE_POINT_BUDGET_S of `started` on some rank (every rank gets the
    same answer)."""
    from validate import microbench as mb

    batch = []

    def more(times: list) -> bool:
        if not batch:  # the first call sees one batch
            batch.append(len(times))
        # too few times is decided without the ranks' max (a collective), as every rank has as many
        loose = len(times) < mb.COLLECTIVE_MIN_BATCHES * batch[0] or not mb.mean_known(comm.max_each(times), batch[0])
        within = time.monotonic() - started < mb.COLLECTIVE_POINT_BUDGET_S
        return bool(comm.agree_max(1.0 if loose and within else 0.0))
    return more


def timed_in_turn(point) -> bool:
    """Is the point an interleaved collective, timed in turn with the other sizes of its operation?"""
    from validate import microbench as mb

    return point.suite == "collective" and point.timing == mb.COLLECTIVE_TIMING


def in_turn_with(point, other) -> bool:
    """Are the two points sizes of one operation, dtype and group layout, timed in turn?"""
    return timed_in_turn(point) and (point.op, point.dtype, point.group) == (other.op, other.dtype, other.group)


def precise_in_turn(comm, started: float, budget_s: float, batch: int):
    """Communicator.time_in_turn's `more`: the points whose slowest-rank times are fewer than
    COLLECTIVE_MIN_BATCHES batches of `batch` or leave their mean less precise than
    COLLECTIVE_PRECISION (from the batches' means), while the turn is within `budget_s` of
    `started` on some rank (every rank gets the same answer)."""
    from validate import microbench as mb

    def more(times: list) -> list:
        if not comm.agree_max(1.0 if time.monotonic() - started < budget_s else 0.0):
            return []
        flat = comm.max_each([t for each in times for t in each])  # one call for every point's times
        ends = list(itertools.accumulate(len(each) for each in times))
        return [i for i, end in enumerate(ends) if not mb.mean_known(flat[end - len(times[i]):end], batch)]
    return more


def measure_in_turn(torch, device, comm, points: list, options: Options) -> list:
    """Records of interleaved collective points timed in turn (Communicator.time_in_turn), each
    with the slowest rank's time of each call, for as long as their one-at-a-time measurement
    would have taken at most (COLLECTIVE_POINT_BUDGET_S a point). A point whose call takes longer
    than LONG_CALL_S is left out (None): so long a call sees no mode of a few milliseconds, and
    measure() times it alone with few repetitions."""
    from validate import microbench as mb

    comm.barrier()
    try:
        first = []
        for point in points:  # one call each, which also warms it up
            device.sync()
            first.append(comm.agree_max(mb.call_seconds(device.timer(), comm.make(point))))
        turn = [point for point, seconds in zip(points, first) if seconds <= mb.LONG_CALL_S]
        more = (lambda times: []) if options.quick else \
            precise_in_turn(comm, time.monotonic(), len(turn) * mb.COLLECTIVE_POINT_BUDGET_S, options.repeats)
        times = comm.time_in_turn(turn, options.repeats, options.warmup, more) if turn else []
        error = None
    except (RuntimeError, ValueError, NotImplementedError, MemoryError) as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    if comm.agree_max(1.0 if error else 0.0):
        return [{"error": error or "failed on another rank", "nbytes": comm.nbytes(point)} for point in points]
    measured = dict(zip(turn, times))
    return [{"stats": mb.Stats(comm.max_each(measured[point])).as_dict(1), "nbytes": comm.nbytes(point),
             "timed_in_turn_with": len(turn)} if point in measured else None for point in points]


def measure(torch, device, comm, point, options: Options, references=None) -> dict:
    """Time one point on every rank; the record's fields (stats, counts, per-rank medians and, for
    a compute point, the `references` kernels' times right before it: perfsim.calibrate.drift)."""
    from validate import microbench as mb

    if comm is not None:
        comm.barrier()
    reference = references.time() if references is not None and point.suite in mb.REFERENCE_SUITES else None
    try:
        if point.suite == "tp_overhead":  # two whole layers timed alternately: a record of its own
            from validate.tp_overhead import measure_point

            return measure_point(torch, device, comm, point)
        if point.timing == mb.CONCURRENT_TIMING:  # beside a compute burst: the call together with it
            rounds = comm.time_concurrent(point, options.repeats, options.warmup,
                                          None if options.quick else precise_mean(comm, time.monotonic()))
            times, number = rounds["both"], 1
            counts = {"nbytes": comm.nbytes(point), "alone_stats": mb.Stats(rounds["alone"]).as_dict(1),
                      "burst_stats": mb.Stats(rounds["burst"]).as_dict(1)}
        elif point.suite == "collective":
            fn = comm.make(point)
            # how a call is timed (microbench.Point.timing): alone after a compute burst, back to
            # back, or back to back after a barrier
            before, numbers = {"interleaved": (comm.compute_burst, {"max_number": 1}),
                               "stream": (None, {"min_number": mb.STREAM_MIN_CALLS})}.get(point.timing,
                                                                                          (comm.barrier, {}))
            more = None if options.quick else precise_mean(comm, time.monotonic())
            times, number, _ = mb.repetitions(device, fn, options.warmup, options.repeats, options.min_time_s,
                                              agree=comm.agree_max, before=before, more=more, **numbers)
            times = comm.max_each(times)
            counts = {"nbytes": comm.nbytes(point)}
        else:
            fn = mb.make_compute(torch, device, point)
            # On a one-thread CPU rank the op runs in this thread: its CPU time is the time the rank
            # really computed, whatever else the machine ran meanwhile.
            cpu_clock = time.thread_time if device.kind == "cpu" and torch.get_num_threads() == 1 else None
            times, number, cpu_times = mb.repetitions(device, fn, options.warmup, options.repeats,
                                                      options.min_time_s, cpu_clock=cpu_clock)
            counts = mb.compute_counts(point)
            if cpu_times:
                counts["cpu_stats"] = mb.Stats(cpu_times).as_dict(number)
        error = None
    except (RuntimeError, ValueError, NotImplementedError, MemoryError) as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        times, number, counts = None, 0, {}
    fn = None
    failed = comm.agree_max(1.0 if error else 0.0) if comm is not None else (1.0 if error else 0.0)
    if failed or times is None:
        return {"error": error or "failed on another rank", **counts}
    record = {"stats": mb.Stats(times).as_dict(number), **counts}
    if reference:
        record["reference_s"] = reference
    if comm is not None and point.suite != "collective":
        record["rank_medians_s"] = comm.gather_values(record["stats"]["median_s"])
    return record
