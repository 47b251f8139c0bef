"""Which profile numbers move one plan's prediction most (`perfsim sensitivity`): first-order
variance shares over the prior draws.

For each uncertain number (and each named cause of one), the draws are split into BINS equal
groups by that number; the share of the step time's variance that the groups' means explain,
Var(E[T | x]) / Var(T), is the number's first-order index (the correlation ratio, a binned
estimate of the first-order Sobol index). It is estimated over the prior: what measuring a number
exactly would take away from the spread before any observation narrows it. The indices of
independent inputs add up to at most 1; the share noise alone would give (about (BINS - 1) /
draws) is taken off, so a number that does nothing shows about 0 (within a few % at the default
256 draws). Every draw gets
its own link numbers here (predict --uncertainty shares them among draws, which would tie the
link numbers' indices together), so a draw costs one closed-form evaluation.
"""

from __future__ import annotations

import numpy as np

from perfsim.cost.columns import columns_of
from perfsim.uncertainty.sampling import draw, evaluate_draws

BINS = 8
DEFAULT_SAMPLES = 256


def first_order_shares(x: np.ndarray, y: np.ndarray, bins: int = BINS) -> float:
    """Var(E[y | bin of x]) / Var(y), bins of equal counts by x's rank, less the share that
    noise alone gives bins of that size (epsilon-squared: the within-bin variance per degree of
    freedom over the total's; 0 at least)."""
    n = len(y)
    total = np.sum((y - y.mean()) ** 2)
    if total == 0:
        return 0.0
    groups = np.array_split(np.argsort(x, kind="stable"), bins)
    within = sum(np.sum((y[g] - y[g].mean()) ** 2) for g in groups)
    return float(max(0.0, 1 - (within / (n - bins)) / (total / (n - 1))))


def drawn_inputs(draws) -> dict:
    """{number: its value per draw}: each uncertain number, a number made of named causes by its
    causes ("<key>.causes.<name>") instead of by itself."""
    ranges = draws.system.ranges
    return {key: draws.values[:, j] for j, key in enumerate(draws.keys)
            if not ranges.get(key) or not ranges[key].causes} | draws.factors


def sensitivity(model, system, plan, samples: int = DEFAULT_SAMPLES, dtype: str = "bf16", seed: int = 0) -> list:
    """[(number, first-order share of the step time's variance, P10 and P90 of the number)], largest
    share first, over `samples` prior draws."""
    draws = draw(system, samples, seed, comm_points=samples)  # every draw its own link numbers
    step = evaluate_draws(model, draws, columns_of(plan), dtype)["step_time_s"]
    rows = [(key, first_order_shares(x, step), *np.percentile(x, (10, 90))) for key, x in drawn_inputs(draws).items()]
    return sorted(rows, key=lambda r: -r[1])
