"""A prediction moved to the machine speed a timed step's probes measured (validate.speed_probe:
a GEMM and a LayerNorm timed right before each step, against what the profile says they take).

Each probe stands for the parts of a prediction's time_breakdown_s that run kernels like it: the
GEMM probe for the compute (and the pipeline's bubble, which waits on it), the LayerNorm probe for
the element-wise optimizer step and the per-call overheads. Communication is not probed: it stays
as predicted. A step whose GEMM probe took r times the profile's time has its GEMM-probed parts
predicted r times as long (docs/real-steps-timing.md, "Errors at the measured speed").
"""

from __future__ import annotations

GEMM_PROBED = ("compute", "recompute", "pp_bubble")
NORM_PROBED = ("optimizer", "other")


def speed_shifts(measured: dict, breakdown: dict) -> list | None:
    """Per timed step of `measured` (a step record's measurement), the seconds a prediction whose
    parts are `breakdown` gains at the speed that step's probes measured: the GEMM-probed parts
    times (GEMM probe / the profile's - 1), the LayerNorm-probed ones times (LayerNorm probe / the
    profile's - 1; the GEMM probe's ratio where there is no LayerNorm probe). None without a GEMM
    probe in every step (records from before the probes)."""
    probes, expected = measured.get("probe_s") or [], measured.get("probe_expected_s")
    if not expected or not probes or any(p is None for p in probes):
        return None
    norms = measured.get("norm_probe_s") or [None] * len(probes)
    norm_expected = measured.get("norm_probe_expected_s")
    gemm = sum(breakdown.get(k, 0.0) for k in GEMM_PROBED)
    elementwise = sum(breakdown.get(k, 0.0) for k in NORM_PROBED)
    shifts = []
    for probe, norm in zip(probes, norms):
        gemm_ratio = probe / expected
        norm_ratio = norm / norm_expected if norm is not None and norm_expected else gemm_ratio
        shifts.append(gemm * (gemm_ratio - 1) + elementwise * (norm_ratio - 1))
    return shifts
