"""The machine-speed probe of `perfsim validate --device`: two kernels timed before every timed
training step, so that a step is compared with perfsim only when the machine ran at the speed its
profile describes (docs/real-steps-timing.md, "Machine speed").

On a shared machine the same kernel can take 1.6 times as long for minutes (the project's VM,
other tenants' load; on a cluster, a node running hot or a noisy neighbour on its cores). A step
measured then tests the machine's state, not the model. Before each timed step every rank times:
- the model's FC1 GEMM at the plan's micro-batch and tp = 1 (`[mbs x seq, hidden] x [hidden, ffn]`
  in the step's dtype, operands rotated through memory as the calibration times GEMMs,
  validate.microbench), priced by perfsim.cost.layer.gemm_time;
- the model's LayerNorm over the same `[mbs x seq, hidden]` activation, looped so that one sample
  lasts about NORM_SAMPLE_S, priced by perfsim.cost.layer.memory_time with the profile's
  layernorm efficiency. The element-wise kernels can slow down while the GEMMs do not: on the
  project's VM they once ran 1.3-1.8 times slower for an hour while the GEMM probe saw 7%.
A profile calibrated with reference kernels (device.speed_reference_gemm_s and _norm_s, the typical
times of validate.microbench.References over its campaign) is judged by those kernels instead: the
same GEMM and LayerNorm timed on the same machine, so the verdict does not depend on how well the
profile prices the model's shapes (`probe_expectations`; the Slurm jobs pick the same way,
validate.slurm.probes). The slowest rank's median of each counts. A step is *at speed* when each probe took at most
`1 + tolerance` and at least `1 / (1 + tolerance)` of what the profile predicts for it; the
plan's step time is the median of the steps at speed, and the ranks keep stepping, up to
MAX_STEPS_FACTOR x the steps asked for, until that many are and agree (`steps_settled`).

This side (the command's) imports no torch; `make_probe` and `make_norm_probe` run on the ranks.
"""

from __future__ import annotations

import statistics

PROBE_CALLS = 5  # calls per probe, their median counts (a few ms each on one CPU core)
MAX_STEPS_FACTOR = 3  # timed steps at most, as a multiple of the steps asked for
DEFAULT_TOLERANCE = 0.15  # the probe's spread on a quiet VM is about 5%, the profile's GEMM fit about 9%
NORM_SAMPLE_S = 1e-3  # the LayerNorm probe loops its kernel this long per sample (timer and launch noise)


def probe_gemm(model, plan):
    """The probe's GEMM (a perfsim.cost.layer.Gemm): the model's FC1 at the plan's micro-batch, tp = 1."""
    from perfsim.cost.layer import Gemm

    return Gemm("speed_probe", 1, plan.mbs * model.seq, model.ffn_size, model.hidden)


def expected_probe_s(system, dtype: str, gemm) -> float:
    """What the profile says the probe takes."""
    from perfsim.cost.layer import gemm_time
    from perfsim.predict import peak_flops
    from perfsim.spec.system import for_dtype

    return float(gemm_time(for_dtype(system, dtype).device, peak_flops(system, dtype), gemm))


def probe_norm(model, plan) -> tuple:
    """(rows, cols) of the LayerNorm probe: the model's activation at the plan's micro-batch, tp = 1."""
    return plan.mbs * model.seq, model.hidden


def expected_norm_probe_s(system, dtype: str, norm: tuple) -> float:
    """What the profile says one call of the LayerNorm probe takes (the bytes as the calibration
    records a layernorm point, validate.microbench.compute_counts)."""
    from perfsim.cost.layer import measured_memory_op, memory_time
    from perfsim.spec.system import for_dtype
    from validate.microbench import Point, compute_counts, point_shape

    rows, cols = norm
    point = Point("memory", "layernorm", dtype, point_shape(rows=rows, cols=cols))
    op, backward = measured_memory_op("layernorm", compute_counts(point)["nbytes"])
    return float(memory_time(for_dtype(system, dtype).device, op, backward))


def probe_expectations(system, dtype: str, model, plan, reference: bool | None = None) -> tuple:
    """(GEMM probe seconds, LayerNorm probe seconds, whether the probes are the reference kernels).
    `reference` None picks; given, the expectations of those probes (a record read back is judged
    against the probes it timed; reference kernels on a profile without their times: None, every
    step counts). A profile calibrated with reference kernels (device.speed_reference_*_s) is judged by them:
    their typical times were measured on that machine, so the verdict does not rest on how well
    the profile prices one shape (on the mkl-compat transfer machine the profile priced the
    model's FC1 GEMM at 39 GFLOP/s, a point measured in a slow spell and over-corrected for it,
    where it runs at about 26: that probe read 1.5x in every step). Otherwise the model's FC1 GEMM
    and LayerNorm, priced by the profile."""
    device = system.device
    referenced = bool(device.speed_reference_gemm_s and device.speed_reference_norm_s)
    if referenced if reference is None else reference:
        return device.speed_reference_gemm_s, device.speed_reference_norm_s, True  # None, None without them
    return (expected_probe_s(system, dtype, probe_gemm(model, plan)),
            expected_norm_probe_s(system, dtype, probe_norm(model, plan)), False)


def make_reference_probes(torch, device) -> tuple:
    """On a rank: (GEMM probe, LayerNorm probe) timing the calibration's reference kernels
    (validate.microbench.References), each returning one call's median seconds."""
    from validate.microbench import References

    references = References(torch, device)
    return (lambda: references.time_one("gemm")), (lambda: references.time_one("memory"))


def at_speed(probe_s: float, expected_s: float | None, tolerance: float) -> bool:
    """Whether a step whose probe took `probe_s` ran at the profile's speed (always, without an
    expected time)."""
    if expected_s is None:
        return True
    ratio = probe_s / expected_s
    return 1 / (1 + tolerance) <= ratio <= 1 + tolerance


def all_at_speed(probes: list, expected: list, tolerance: float) -> bool:
    """Whether a step ran at the profile's speed by every probe (`probes` and `expected` paired)."""
    return all(at_speed(p, e, tolerance) for p, e in zip(probes, expected))


def steps_settled(times: list, speed_flags: list, steps: int, tolerance: float) -> bool:
    """Whether a plan may stop stepping: `steps` of its steps at speed lie within tolerance / 2 of
    the median of its steps at speed. The probes run between steps, so a step the machine slowed
    down in its middle passes them: mkl-compat r7's 1d + SP plan with full recomputation took 4.10,
    3.94 and 3.30 s, all three at speed by the probes, where the other runs' steps at speed agree
    within 8% (docs/real-steps-timing.md, "Machine speed")."""
    chosen = [t for t, ok in zip(times, speed_flags) if ok]
    if len(chosen) < steps:
        return False
    middle = statistics.median(chosen)
    return sum(abs(t / middle - 1) <= tolerance / 2 for t in chosen) >= steps


def step_time(times: list, speed_flags: list) -> float:
    """The plan's step time: the median of its steps at speed, or of all of them if none was."""
    chosen = [t for t, ok in zip(times, speed_flags) if ok]
    return statistics.median(chosen or times)


def retake_seconds(budget_s: float | None, elapsed_s: float, plans_left: int, overhead_s: float) -> float | None:
    """Seconds of timed steps the next plan may take before it stops retaking steps that ran off
    the profile's speed: an equal share of what is left of the run's budget, less what a plan costs
    besides its timed steps (`overhead_s`: build, first and memory steps). None without a budget.
    Its --steps timed steps are taken whatever the budget."""
    if budget_s is None:
        return None
    return max(0.0, (budget_s - elapsed_s) / max(plans_left, 1) - overhead_s)


def make_probe(torch, device, gemm, dtype: str):
    """On a rank: a no-argument function that times the probe and returns its median seconds."""
    from validate.microbench import GEMM_TIMING, Point, make_compute, point_shape

    point = Point("gemm", "matmul", dtype, point_shape(count=1, m=gemm.m, n=gemm.n, k=gemm.k), timing=GEMM_TIMING)
    call = make_compute(torch, device, point)
    timer = device.timer()
    call()  # first touch of the rotated operands outside the timing

    def probe() -> float:
        times = []
        for _ in range(PROBE_CALLS):
            timer.start()
            call()
            times.append(timer.stop())
        return statistics.median(times)
    return probe


def make_norm_probe(torch, device, norm: tuple, dtype: str, expected_s: float | None):
    """On a rank: a no-argument function that times the LayerNorm probe and returns the median
    seconds of one call (each sample loops the kernel for about NORM_SAMPLE_S, as the profile
    expects it to take; 10 calls without an expected time)."""
    import math

    from validate.microbench import Point, make_compute, point_shape

    rows, cols = norm
    call = make_compute(torch, device, Point("memory", "layernorm", dtype, point_shape(rows=rows, cols=cols)))
    loops = 10 if expected_s is None else max(1, min(1000, math.ceil(NORM_SAMPLE_S / expected_s)))
    timer = device.timer()
    call()

    def probe() -> float:
        times = []
        for _ in range(PROBE_CALLS):
            timer.start()
            for _ in range(loops):
                call()
            times.append(timer.stop() / loops)
        return statistics.median(times)
    return probe
