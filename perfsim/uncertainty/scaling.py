"""A scaling study over the draws of a profile's ranges (its posterior where it names
observations): each node count's step time and scaling efficiency as P10 / P50 / P90.

Every node count is priced under the same draws, and a draw's efficiency is taken against its
own first point, so the band is that of whole curves: a draw with slow links is slow at every
count, rather than slow at one count and fast at the next.
"""

from __future__ import annotations

import numpy as np

from perfsim.uncertainty.predict import percentiles
from perfsim.uncertainty.sampling import evaluate_plans


def scaling_spreads(model, draws, studies: list, dtype: str = "bf16") -> list:
    """Per study (perfsim.scaling.scale's ScalePoints, weak or not), per point
    {"samples", "step_time_s": {p10, p50, p90}, "efficiency": {...}} under `draws`
    (perfsim.uncertainty.posterior.profile_draws); every study's plans priced in one call."""
    plans = [p.prediction.plan for points, _ in studies for p in points]
    steps = evaluate_plans(model, draws, plans, dtype)["step_time_s"]  # plans x draws
    out, start = [], 0
    for points, weak in studies:
        study, start = steps[start:start + len(points)], start + len(points)
        nodes = np.array([p.nodes for p in points], float)
        ideal_ratio = np.ones_like(nodes) if weak else nodes[0] / nodes  # as perfsim.scaling.scale
        efficiency = study[0][None, :] * ideal_ratio[:, None] / study
        out.append([{"samples": int(draws.n), "step_time_s": percentiles(study[i]),
                     "efficiency": percentiles(efficiency[i])} for i in range(len(points))])
    return out
