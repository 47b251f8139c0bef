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


def scaling_spread(model, draws, points, weak: bool, dtype: str = "bf16") -> list:
    """[{"samples", "step_time_s": {p10, p50, p90}, "efficiency": {...}}] per point of
    perfsim.scaling.scale's `points`, under `draws` (perfsim.uncertainty.posterior.profile_draws)."""
    steps = evaluate_plans(model, draws, [p.prediction.plan for p in points], dtype)["step_time_s"]  # points x draws
    nodes = np.array([p.nodes for p in points], float)
    ideal_ratio = np.ones_like(nodes) if weak else nodes[0] / nodes  # as perfsim.scaling.scale
    efficiency = steps[0][None, :] * ideal_ratio[:, None] / steps
    return [{"samples": int(draws.n), "step_time_s": percentiles(steps[i]), "efficiency": percentiles(efficiency[i])}
            for i in range(len(points))]
