"""collectives.overlap_efficiency from collectives timed beside compute (docs/calibration.md,
"Collectives beside compute"; docs/equations.md 6.1).

A "concurrent" ledger point (validate.microbench.Communicator.time_concurrent) holds, measured in
alternation at one size of one operation: the collective started asynchronously with a compute
burst as long as itself running on the same rank (`stats`, T_both), the burst alone
(`burst_stats`, T_k) and the collective alone (`alone_stats`, T_c). perfsim's model of the pair is

    T_both = max(T_c, T_k) + (1 - eta) min(T_c, T_k)

so each point shows the share its shorter side hid, (T_c + T_k - T_both) / min(T_c, T_k). eta is
the median of those shares (a robust average: a drifting machine throws single points far off),
clipped to (0, 1]: a point that ran slower together than one after the other (both sides slowed
by contention) hid nothing the model can take.
"""

from __future__ import annotations

import numpy as np

from perfsim.calibrate.common import Fitted, Quality, mape

CONCURRENT_TIMING = "concurrent"  # validate.microbench.CONCURRENT_TIMING, the ledger's timing field
ETA_FLOOR = 0.01  # the profile's fraction must stay above 0
TARGET = 0.15  # held-out MAPE the issue asks of collectives


def is_concurrent(record: dict) -> bool:
    return record.get("suite") == "collective" and record.get("timing") == CONCURRENT_TIMING


def _sides(record: dict) -> tuple:
    """(T_both, T_c, T_k): the mean of each over the point's rounds, what a step pays on average
    (the collective's tables hold means too; a ledger without means gives medians)."""
    return tuple(stats.get("mean_s", stats["median_s"])
                 for stats in (record["stats"], record["alone_stats"], record["burst_stats"]))


def hidden_share(record: dict) -> float:
    """The share of the shorter side that running the two together hid (may leave [0, 1])."""
    both, alone, burst = _sides(record)
    return (alone + burst - both) / min(alone, burst)


def overlap_efficiency(records: list) -> float:
    """eta over `records`: the median hidden share, clipped to [ETA_FLOOR, 1]."""
    return float(np.clip(np.median([hidden_share(r) for r in records]), ETA_FLOOR, 1.0))


def predicted_both(record: dict, eta: float) -> float:
    _, alone, burst = _sides(record)
    return max(alone, burst) + (1.0 - eta) * min(alone, burst)


def _usable(records: list) -> list:
    return [r for r in records if is_concurrent(r) and "error" not in r and isinstance(r.get("alone_stats"), dict)
            and isinstance(r.get("burst_stats"), dict) and min(_sides(r)) > 0]


def fit_overlap(records: list, ledger: str) -> tuple:
    """(values, quality rows, notes) of collectives.overlap_efficiency from the ledger's concurrent
    points; nothing with fewer than 3. Every point is held out once: its T_both predicted with the
    eta of the others (leave-one-out), as the points are few."""
    rows = _usable(records)
    if len(rows) < 3:
        return {}, [], []
    eta = overlap_efficiency(rows)
    measured = [_sides(r)[0] for r in rows]
    fitted = [predicted_both(r, eta) for r in rows]
    held = [predicted_both(r, overlap_efficiency(rows[:i] + rows[i + 1:])) for i, r in enumerate(rows)]
    perfect = [predicted_both(r, 1.0) for r in rows]
    shares = [hidden_share(r) for r in rows]
    ops = sorted({r["op"] for r in rows})
    quality = [Quality("collectives beside compute (T_both = max + (1 - eta) min)", mape(fitted, measured), len(rows),
                       mape(held, measured), len(rows), TARGET, "held out: each point with the others' eta"),
               Quality("  the same with perfect overlap (eta = 1)", mape(perfect, measured), len(rows),
                       float("nan"), 0)]
    raw = float(np.median(shares))
    notes = [f"overlap beside compute: median hidden share {raw:.3g} over {len(rows)} points ({', '.join(ops)}; "
             f"range {min(shares):.3g} to {max(shares):.3g})"
             + (f", clipped to {eta:.3g}" if eta != raw else "")
             + (": together slower than one after the other, contention slows both sides" if raw < 0 else "")]
    source = (f"median over {len(rows)} collectives ({', '.join(ops)}) of ledger {ledger}, each timed with a compute "
              f"burst as long as itself on the same rank, the burst alone and the call alone in alternation, of "
              f"the share of the shorter side hidden, (T_burst + T_alone - T_both) / min(T_burst, T_alone)"
              + (f" ({raw:.3g}, clipped to (0, 1])" if eta != raw else ""))
    return {"collectives.overlap_efficiency": Fitted(eta, source)}, quality, notes
