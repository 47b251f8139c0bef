"""Real training steps timed and counted, for `perfsim validate --device D --nproc N`.

Run as ranks (`python -m validate.steps OUT --plan JSON --model SPEC ...` for one plan, or `--jobs
FILE` for several, one after the other in the same processes: validate.launcher.launch_ranks
starts them once for all the plans a run measures; the Slurm jobs use mpiexec and `--plan`). For
each plan every rank builds the training step (build_step: 1d / 1d+SP in validate.training, 2d /
2.5d / 3d in validate.multidim, pipelines in validate.pipeline, data parallelism in
validate.sharded_dp, context parallelism in validate.context_parallel, a model with experts in
validate.expert_parallel), runs it once under the
counters (matrix FLOPs: LocalFlopCounter; bytes sent per collective kind: CollectiveCounter; the
peak of live bytes saved for backward: SavedBytes), then once more while the allocator's peak is
recorded (Device.allocation_peak: what the build and the first step keep, not their transients),
then `warmup - 1` more untimed steps, then times `steps` steps (each the slowest rank's time
between two barriers; every rank's own time is gathered after the timed step, outside it, for the
spread across ranks). Rank 0 writes each plan's result to OUT as a line of JSON as soon as the
plan is done; the command side (validate.timing) predicts the same plan and appends both to the
ledger.

A job marked `alone` runs its one-device plan on every rank at once, each rank its own copy with
no collective inside the step (the barriers between steps stay): the ranks' step times then spread
as the ranks' speeds do, which a synchronised step hides (each rank waits at its collectives for
the slowest); perfsim calibrate fits framework.rank_jitter from them (perfsim.calibrate.overheads).

A collective that never completes (a rank that hangs or dies) raises after `timeout` seconds
(the process group's timeout), so the launch ends with an error instead of waiting forever.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

from validate.speed_probe import DEFAULT_TOLERANCE
from validate.training import TensorParallelStep

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
FAULT_ENV = "PERFSIM_VALIDATE_FAULT"  # test hook: "hang", "die" or "kill" (SIGKILL) ends the last rank in its first step


def build_step(plan, model, device, dtype, alone: bool = False):
    """The training step of `plan` on this rank (torch.distributed already initialised); `alone`: a
    one-device plan run by this rank on its own, beside the other ranks' copies."""
    if alone:
        return TensorParallelStep(plan, model, device, dtype, alone=True)
    if getattr(plan, "ep", 1) > 1 or (getattr(model, "moe", False) and plan.devices > 1):
        from validate.expert_parallel import build_step as build
    elif getattr(plan, "cp", 1) > 1:
        from validate.context_parallel import build_step as build
    elif plan.pp > 1:
        from validate.pipeline import build_step as build
    elif plan.dp > 1:
        from validate.sharded_dp import build_step as build
    elif plan.tp_mode != "1d":
        from validate.multidim import build_step as build
    else:
        build = TensorParallelStep
    return build(plan, model, device, dtype)


def _inject_fault(rank: int, world: int) -> None:
    fault = os.environ.get(FAULT_ENV, "")
    if fault and rank == world - 1:
        if fault == "die":
            os._exit(3)
        if fault == "kill":  # as another process, or the out-of-memory killer, would
            os.kill(os.getpid(), 9)
        if fault == "hang":
            time.sleep(10**6)


def measure(jobs: list, model, device_kind: str, dtype_name: str, steps: int, warmup: int, timeout_s: float,
            threads: int | None = None, speed_tolerance: float = DEFAULT_TOLERANCE,
            retake_until_s: float | None = None, budget_s: float | None = None, done=None) -> None:
    """Run each job's plan on this rank, one after the other in one process group, and call
    `done(result)` with each plan's job-wide result (max or sum over ranks) as it finishes. A job
    is {"plan": Plan, "probe_expected_s", "norm_probe_expected_s": what the profile says the
    speed probes take, the GEMM and the LayerNorm (None: that probe lets every step count),
    "reference_probes": the probes are the calibration's reference kernels, else the model's FC1
    GEMM and LayerNorm; optionally "model", its own perfsim Model, else `model`}. `retake_until_s`:
    no plan retakes a step once its timed steps have taken this long; `budget_s`: seconds all the
    plans may take, each retaking steps only within its share (speed_probe.retake_seconds); None:
    no limit."""
    import datetime
    import gc
    import statistics

    import torch
    import torch.distributed as dist

    from validate.ranks import rank_environment
    from validate.device import Device, distributed_backend
    from validate.speed_probe import retake_seconds

    ranks = rank_environment()
    dev = Device(device_kind, ranks.local_rank, threads)
    dist.init_process_group(distributed_backend(device_kind), rank=ranks.rank, world_size=ranks.world,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            **({"device_id": dev.torch_device} if device_kind != "cpu" else {}))
    for job in jobs:
        devices = 1 if job.get("alone") else ranks.world
        if job["plan"].devices != devices:
            raise ValueError(f"the plan uses {job['plan'].devices} devices but {devices} "
                             f"{'are run alone on each rank' if job.get('alone') else 'ranks were started'}")

    def job_wide(values, op=None):
        """The values reduced over the ranks by `op`; without one, every rank's values (a list per rank)."""
        t = torch.tensor(values, dtype=torch.float64, device=dev.torch_device if device_kind != "cpu" else "cpu")
        if op is not None:
            dist.all_reduce(t, op=op)
            return t.tolist()
        gathered = [torch.empty_like(t) for _ in range(ranks.world)]
        dist.all_gather(gathered, t)
        return [g.tolist() for g in gathered]

    started, overheads = time.perf_counter(), []  # each plan's seconds besides its timed steps
    for i, job in enumerate(jobs):
        retake = retake_until_s
        if budget_s is not None:  # every rank must stop retaking after the same step: the slowest rank's share
            share = retake_seconds(budget_s, time.perf_counter() - started, len(jobs) - i,
                                   statistics.median(overheads) if overheads else 0.0)
            retake = min(share, retake) if retake is not None else share
            retake = job_wide([retake], dist.ReduceOp.MIN)[0]
        begun = time.perf_counter()
        result = _measure_plan(torch, dist, dev, ranks, job, job.get("model", model), device_kind, dtype_name,
                               steps, warmup, speed_tolerance, retake, job_wide)
        overheads.append(time.perf_counter() - begun - sum(result["step_times_s"]))
        if done is not None:
            done(result)
        gc.collect()  # the plan's modules, optimizer states and process subgroups' tensors
    dist.barrier()  # nobody tears down while a peer still talks to it
    dist.destroy_process_group()


def _measure_plan(torch, dist, dev, ranks, job: dict, model, device_kind: str, dtype_name: str, steps: int,
                  warmup: int, speed_tolerance: float, retake_until_s: float | None, job_wide) -> dict:
    """One job of `measure` on this rank: the plan built, counted, measured and timed."""
    from validate.context_parallel import skipped_blocks
    from validate.instrument import CollectiveCounter, LocalFlopCounter, SavedBytes
    from validate.speed_probe import (MAX_STEPS_FACTOR, all_at_speed, make_norm_probe, make_probe,
                                      make_reference_probes, probe_gemm, probe_norm, step_time, steps_settled)

    plan, probe_expected_s, norm_probe_expected_s = job["plan"], job["probe_expected_s"], job["norm_probe_expected_s"]
    dtype = getattr(torch, DTYPES[dtype_name])
    # Peak memory: what the allocator holds while the step runs its second time, with what the
    # build and the first step left allocated. The first step makes one-time allocations a
    # steady step does not (DDP rebuilds its gradient buckets at its second forward, with the
    # first set still allocated), and the build's transients must not count either.
    # The first step, untimed and outside the memory window, also runs under the counters: it runs
    # what every step runs, and a step of its own for them cost a plan one step more (a minute of
    # a validation on a slow machine).
    with dev.allocation_peak() as allocated:
        step = build_step(plan, model, dev.torch_device, dtype, alone=job.get("alone", False))
        _inject_fault(ranks.rank, ranks.world)
        flops, comms, saved = LocalFlopCounter(), CollectiveCounter(), SavedBytes(step.module.parameters())
        with flops, comms, saved.hooks(), skipped_blocks() as skipped:
            losses = [step.run()]
        allocated.window()
        losses.append(step.run())

    def timed_step() -> float:
        dist.barrier()
        dev.sync()
        start = time.perf_counter()
        losses.append(step.run())
        dev.sync()
        return time.perf_counter() - start

    for _ in range(warmup - 1):
        timed_step()
    # Each timed step follows the machine-speed probe (validate.speed_probe); stepping goes on until
    # `steps` of them ran at the profile's speed and agree (steps_settled), or MAX_STEPS_FACTOR x
    # steps ran, or (past `steps`) the timed steps have taken retake_until_s (the plan's share of the
    # run's time budget). Every rank takes the job-wide (slowest rank's) step and probe times, so all
    # decide alike; each rank's own step time is kept too (gathered after the step, outside its timing).
    if job["reference_probes"]:
        probe, norm_probe = make_reference_probes(torch, dev)
    else:
        probe = make_probe(torch, dev, probe_gemm(model, plan), dtype_name)
        norm_probe = make_norm_probe(torch, dev, probe_norm(model, plan), dtype_name, norm_probe_expected_s)
    times, probes, norm_probes, speed_flags, rank_times = [], [], [], [], []
    while not steps_settled(times, speed_flags, steps, speed_tolerance) and len(times) < MAX_STEPS_FACTOR * steps \
            and (len(times) < steps or retake_until_s is None or sum(times) < retake_until_s):
        dist.barrier()
        probe_s, norm_s = probe(), norm_probe()
        every = job_wide([timed_step(), probe_s, norm_s])
        elapsed, probe_s, norm_s = (max(rank[k] for rank in every) for k in range(3))
        times.append(elapsed)
        rank_times.append([rank[0] for rank in every])
        probes.append(probe_s)
        norm_probes.append(norm_s)
        speed_flags.append(all_at_speed([probe_s, norm_s], [probe_expected_s, norm_probe_expected_s],
                                        speed_tolerance))
    peak = allocated.bytes
    sent = comms.by_kind()
    kinds = sorted({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "send"} | set(sent))
    # ring attention's blocks above the causal diagonal are not run but are in perfsim's count
    summed = job_wide([float(flops.total() + sum(skipped.values()))] + [sent.get(k, 0.0) for k in kinds],
                      dist.ReduceOp.SUM)
    maxed = job_wide([float(peak), float(saved.peak)], dist.ReduceOp.MAX)
    return {
        "world": ranks.world, "backend": dist.get_backend(), "device": dev.describe(),
        "step_times_s": times, "step_time_s": step_time(times, speed_flags), "rank_step_times_s": rank_times,
        "probe_s": probes, "probe_expected_s": probe_expected_s, "at_speed": speed_flags,
        "norm_probe_s": norm_probes, "norm_probe_expected_s": norm_probe_expected_s,
        "reference_probes": job["reference_probes"], **({"alone": True} if job.get("alone") else {}),
        "losses": [None if math.isnan(x) else x for x in losses], "rank": ranks.rank,  # NaN: no loss on this rank
        "peak_memory_bytes": maxed[0], "activation_bytes": maxed[1],
        "flops": summed[0], "comm_bytes_by_kind": dict(zip(kinds, summed[1:])),
        "comm_bytes": sum(summed[1:]),
    }


def main(argv=None) -> int:
    from validate.launcher import die_with_launcher

    die_with_launcher()
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan
    from validate.ranks import leave, rank_environment

    p = argparse.ArgumentParser(prog="python -m validate.steps", description=__doc__.splitlines()[0])
    p.add_argument("out", help="file rank 0 writes: a line of JSON per plan, each as soon as it is measured")
    plans = p.add_mutually_exclusive_group(required=True)
    plans.add_argument("--plan", help="the plan as a JSON object of perfsim Plan fields")
    plans.add_argument("--jobs", help="JSON file: a list of jobs, each {plan, probe_expected_s, "
                                      "norm_probe_expected_s, reference_probes} and optionally its own model "
                                      "(a model spec), measured in one launch")
    p.add_argument("--model", help="perfsim model spec (of every job without a model of its own)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "xpu"))
    p.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first one, the first of them measuring memory (at least 1)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a collective may wait")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--probe-expected", dest="probe_expected", type=float, default=None,
                   help="seconds the profile predicts for the GEMM speed probe (validate.speed_probe); without it every step counts")
    p.add_argument("--norm-probe-expected", dest="norm_probe_expected", type=float, default=None,
                   help="seconds the profile predicts for one call of the LayerNorm speed probe; without it that probe lets every step count")
    p.add_argument("--speed-tolerance", dest="speed_tolerance", type=float, default=DEFAULT_TOLERANCE)
    p.add_argument("--retake-until", dest="retake_until", type=float, default=None,
                   help="seconds of timed steps after which no step off the profile's speed is retaken")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds all the plans may take; past its share of them a plan retakes no step")
    p.add_argument("--reference-probes", dest="reference_probes", action="store_true",
                   help="probe with the calibration's reference kernels (validate.microbench.References)")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1")
    if not args.speed_tolerance > 0 or any(v is not None and not v > 0 for v in (args.probe_expected,
                                                                               args.norm_probe_expected)):
        p.error("--speed-tolerance, --probe-expected and --norm-probe-expected must be positive")
    if any(v is not None and not v >= 0 for v in (args.retake_until, args.budget)):
        p.error("--retake-until and --budget must be 0 or more seconds")
    if args.jobs:
        with open(args.jobs) as fh:
            jobs = [dict(job, plan=Plan(**job["plan"])) for job in json.load(fh)]
    else:
        jobs = [{"plan": Plan(**json.loads(args.plan)), "probe_expected_s": args.probe_expected,
                 "norm_probe_expected_s": args.norm_probe_expected, "reference_probes": args.reference_probes}]
    if args.model is None and any("model" not in job for job in jobs):
        p.error("--model is needed for the jobs without a model of their own")
    jobs = [dict(job, model=load_model(job["model"])) if "model" in job else job for job in jobs]
    with open(args.out, "w") if rank_environment().rank == 0 else contextlib.nullcontext() as out:
        def write(result):  # rank 0: one whole line per plan as it finishes (the launcher reads them as they come)
            if result.pop("rank") == 0:
                out.write(json.dumps(result) + "\n")
                out.flush()
        measure(jobs, load_model(args.model) if args.model else None, args.device, args.dtype, args.steps, args.warmup,
                args.timeout, args.threads, args.speed_tolerance, args.retake_until, args.budget, write)
    leave(0)  # without the interpreter's teardown (validate.ranks.leave)


if __name__ == "__main__":
    sys.exit(main())
