"""The machine's drift during a campaign, taken out of its compute points (docs/calibration.md,
"Drift during a campaign").

A shared machine changes speed for minutes at a time: on the project's VM the same fp32 GEMM ran at
86 GFLOP/s and, three minutes later, at 54, with the rank's CPU time equal to the wall clock (the
core itself ran slower; no other process took it). A table of measured kernels then records the
spell a shape happened to be measured in: a plan-aware campaign's tp = 1 GEMMs, measured in such a
spell, priced every pipeline and data-parallel plan 20-24% too slow.

So the campaign times two reference kernels right before every compute point (validate.campaign,
`reference_s`: a GEMM and a LayerNorm of fixed shapes, each the median of a few calls). Here each
point's times are scaled by the reference's median over the whole ledger over its rolling median
around the point (WINDOW points of the ledger's order, which is time order): the profile describes
the machine at its typical speed over the campaign, which validate's speed probes then compare each
step's machine with. GEMM and attention points follow the GEMM reference, element-wise kernels the
LayerNorm's. Collectives, and ledgers without references, are left as measured.
"""

from __future__ import annotations

import numpy as np

REFERENCE_OF = {"gemm": "gemm", "attention": "gemm", "memory": "memory"}  # suite -> its reference kernel
WINDOW = 9  # points around each one whose references' median is its machine's speed (a reference scatters ~5%)
TIME_FIELDS = ("median_s", "min_s", "max_s", "mean_s", "std_s", "p25_s", "p75_s")


def _reference(record: dict, kind: str):
    """The record's time of reference `kind` (None without one; the ledger reader checked the rest)."""
    references = record.get("reference_s")
    value = references.get(kind) if isinstance(references, dict) else None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _scaled(stats: dict, factor: float) -> dict:
    return {k: v * factor if k in TIME_FIELDS and isinstance(v, (int, float)) else v for k, v in stats.items()}


def steadied(records: list) -> tuple:
    """(records with each compute point's times at the ledger's typical speed, notes, {reference:
    its typical seconds}). A record that was rescaled carries `drift_factor` (what its times were
    multiplied by). The typical times become the profile's device.speed_reference_*_s, at which
    `perfsim validate` judges each step's machine."""
    out, notes, typical_s = list(records), [], {}
    for kind in sorted(set(REFERENCE_OF.values())):
        where = [i for i, r in enumerate(out) if REFERENCE_OF.get(r.get("suite")) == kind and "error" not in r
                 and _reference(r, kind) is not None]
        if len(where) < WINDOW:
            continue
        refs = np.array([_reference(out[i], kind) for i in where])
        typical = typical_s[kind] = float(np.median(refs))
        half = WINDOW // 2
        factors = []
        for j, i in enumerate(where):
            lo = min(max(0, j - half), len(where) - WINDOW)
            factor = typical / float(np.median(refs[lo:lo + WINDOW]))
            factors.append(factor)
            r = out[i]
            out[i] = {**r, "stats": _scaled(r["stats"], factor), "drift_factor": factor}
            if "cpu_stats" in r:
                out[i]["cpu_stats"] = _scaled(r["cpu_stats"], factor)
        speed = np.array(factors)
        notes.append(f"machine drift during the campaign, by the {kind} reference timed before each of {len(where)} "
                     f"points: the machine ran at {speed.min():.2f}-{speed.max():.2f}x its typical speed "
                     f"(rolling median of {WINDOW}); those points' times are scaled to the typical speed, "
                     f"{np.mean(np.abs(speed - 1) > 0.1) * 100:.0f}% of them by more than 10%")
    return out, notes, typical_s
