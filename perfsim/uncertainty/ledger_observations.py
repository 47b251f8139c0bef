"""A calibration ledger's measurements as observations, so that a measured ledger narrows the
profile's ranges through the same conditioning as its published observations (`perfsim predict
--uncertainty --observe LEDGER`, docs/validation.md).

A ledger holds hundreds of kernels, and conditioning looks for the largest set of observations
it can explain together, so each kind of measurement becomes one observation, not one per point:

- GEMMs of a dtype, split at their median FLOP count into small and large ones (the efficiency
  model's two numbers, gemm_efficiency and gemm_half_dim, act on the two ends differently);
- element-wise kernels (LayerNorm, softmax, GeLU, add, forward and backward) in the training
  dtype, small and large by the same split (kernel_overhead_s, then memory bandwidth x efficiency);
- collectives in the training dtype, by the link class their group runs over (card, node,
  network: perfsim.calibrate.collectives.link_class) and message size (below LATENCY_BYTES the
  latencies and per-call costs, above it the bandwidths).

Each observation's quantity is the geometric mean, over its points, of the time perfsim prices
(the draw's numbers through the cost code the fit uses: perfsim.cost.layer.gemm_curve_time and
memory_time, perfsim.calibrate.collectives.collective_times) over the time measured, with the statistic the
fit uses (perfsim.calibrate.common.statistic_key). It is 1 where the draw describes the machine;
the tolerance, TOLERANCE, is the error a calibrated profile is held to on held-out points (a draw
whose kernels are within 10% of the measurements on average agrees). Points that failed, and
kinds the profile cannot price (a dtype without a peak), give no observation; at most MAX_POINTS
points of a kind are priced, spread evenly over its sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfsim.errors import PerfsimError

TOLERANCE = 0.10
LATENCY_BYTES = 1 << 20
MAX_POINTS = 48


@dataclass(frozen=True)
class KernelObservation:
    """Measured kernels of one kind: perfsim's time over the measured one, geometric mean over the
    points, observed to be `value` (1) within `tolerance`."""
    name: str
    source: str
    suite: str  # gemm | memory | collective
    dtype: str
    records: tuple  # the ledger's records of the points, each with "_t": the measured seconds
    value: float = 1.0
    tolerance: float = TOLERANCE

    @property
    def quantity(self) -> str:
        return "perfsim's time over the measured one (geometric mean)"

    def predicted_draws(self, draws) -> np.ndarray:
        """The quantity under every draw."""
        from perfsim.uncertainty.sampling import group_systems

        out = np.empty(draws.n)
        measured = np.array([r["_t"] for r in self.records])[:, None]
        for rows, system in group_systems(draws):
            times = self._times(system)  # points x rows, or points x 1 where only link numbers matter
            out[rows] = np.exp(np.mean(np.log(np.broadcast_to(times / measured, (len(self.records), rows.size))),
                                       axis=0))
        return out

    def _times(self, system) -> np.ndarray:
        if self.suite == "gemm":
            from perfsim.cost.layer import gemm_curve_time
            from perfsim.predict import peak_flops

            shape = lambda k, default=None: np.array([[r["shape"].get(k, default)] for r in self.records], float)  # noqa: E731
            return np.asarray(gemm_curve_time(system.device, peak_flops(system, self.dtype), shape("count", 1),
                                              shape("m"), shape("n"), shape("k")))
        if self.suite == "memory":
            from perfsim.cost.layer import measured_memory_op, memory_time

            times = []
            for r in self.records:  # a handful of sizes per kind: a call each is cheap
                op, backward = measured_memory_op(r["op"], float(r["nbytes"]))
                times.append(np.atleast_1d(memory_time(system.device, op, backward)))
            return np.array(np.broadcast_arrays(*times))
        from perfsim.calibrate.collectives import collective_times

        return collective_times(system, list(self.records))[:, None]


def _spread(records: list, size_of) -> list:
    """At most MAX_POINTS of `records`, evenly over their sizes."""
    records = sorted(records, key=size_of)
    if len(records) <= MAX_POINTS:
        return records
    return [records[int(i)] for i in np.linspace(0, len(records) - 1, MAX_POINTS).round()]


def _gemm_flops(r) -> float:
    s = r["shape"]
    return 2.0 * s.get("count", 1) * s["m"] * s["n"] * s["k"]


def ledger_observations(path: str, system) -> tuple:
    """The KernelObservations of the calibration ledger at `path`, for pricing with `system`'s
    numbers (its device and links: a ledger from another machine explains nothing)."""
    from perfsim.calibrate.collectives import link_class
    from perfsim.calibrate.common import ELEMENTWISE_OPS, statistic_key
    from perfsim.calibrate.overlap import is_concurrent
    from perfsim.spec.system import BACKWARD
    from perfsim.ledger import read_ledger
    from perfsim.predict import peak_flops

    records, _ = read_ledger(path)
    usable = []
    for r in records:
        if "error" in r or r["suite"] not in ("gemm", "memory", "collective") or is_concurrent(r):
            continue  # a collective timed beside compute measures the overlap, not the call's time
        t = r["stats"].get(statistic_key("expected", r["suite"]), r["stats"]["median_s"])
        if isinstance(t, (int, float)) and t > 0:
            usable.append({**r, "_t": float(t)})
    observations = []
    for dtype in sorted({r["dtype"] for r in usable if r["suite"] == "gemm"}):
        try:
            peak_flops(system, dtype)
        except PerfsimError:
            continue  # the profile has no peak for it: nothing to price
        gemms = sorted((r for r in usable if r["suite"] == "gemm" and r["dtype"] == dtype), key=_gemm_flops)
        half = len(gemms) // 2
        for label, part in (("small", gemms[:half]), ("large", gemms[half:])):
            if part:
                observations.append(_observation(path, "gemm", dtype, f"{dtype} GEMMs, {label}", _spread(part, _gemm_flops)))
    kernels = [r for r in usable if r["suite"] == "memory" and r["op"].replace(BACKWARD, "") in ELEMENTWISE_OPS]
    kernel_dtype = _training_dtype(kernels)
    kernels = sorted((r for r in kernels if r["dtype"] == kernel_dtype), key=lambda r: r["nbytes"])
    half = len(kernels) // 2
    for label, part in (("small", kernels[:half]), ("large", kernels[half:])):
        if part:
            observations.append(_observation(path, "memory", kernel_dtype, f"{kernel_dtype} element-wise kernels, "
                                             f"{label}", _spread(part, lambda r: r["nbytes"])))
    collectives = [r for r in usable if r["suite"] == "collective"]
    dtype = _training_dtype(collectives)
    groups: dict = {}
    for r in collectives:
        if r["dtype"] == dtype:
            cls = link_class(system, r["group"][0], r["group"][1])
            size = "small" if r["shape"]["nbytes"] < LATENCY_BYTES else "large"
            groups.setdefault((cls, size), []).append(r)
    for (cls, size), part in sorted(groups.items()):
        observations.append(_observation(path, "collective", dtype, f"{dtype} collectives over {cls} links, {size} "
                                         f"messages", _spread(part, lambda r: (r["op"], r["shape"]["nbytes"]))))
    if not observations:
        raise PerfsimError(f"ledger {path}: no GEMM or collective measurement the profile {system.name} can price; "
                           "--observe takes a calibration ledger (perfsim calibrate --ledger)")
    return tuple(observations)


def _training_dtype(records: list):
    """The dtype a training step runs these kernels in where the ledger has it, else its first."""
    from perfsim.calibrate.common import TRAINING_DTYPE

    dtypes = {r["dtype"] for r in records}
    return TRAINING_DTYPE if TRAINING_DTYPE in dtypes else min(dtypes, default=None)


def _observation(path: str, suite: str, dtype: str, what: str, records: list) -> KernelObservation:
    return KernelObservation(f"{what} ({len(records)} points of {path})",
                             f"ledger {path}: {len(records)} measured {what}", suite, dtype, tuple(records))
