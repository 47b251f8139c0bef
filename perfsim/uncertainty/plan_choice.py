"""Which profile numbers decide the choice of plan (`perfsim sensitivity --plan-choice`; docs/validation.md,
"What decides the plan").

Over prior draws, every candidate plan p gets its step time T(p, d) in every draw d, and its
regret there, R(p, d) = T(p, d) / min_q T(q, d) - 1: how much slower it runs than the best
candidate of that draw (a plan that does not fit in a draw's memory gets the draw's largest
regret, at least NOT_FITTING). Choosing
a plan now, knowing only the ranges, a user runs the plan whose mean regret is smallest; that
mean regret, L, is what the doubt about the profile costs (the expected value of perfect
information, in step time). Knowing one number x exactly, the user would choose, for each value
of x, the plan best on average among the draws with about that value: with the draws split into
BINS equal groups by x,

    L_x = sum over groups g of (|g| / n) x min_p mean_{d in g} R(p, d)

and the share of the doubt that measuring x settles is (L - L_x) / L: 1 when x alone tells which
plan wins, 0 when knowing it never changes the choice (the expected value of partial perfect
information, as a share). Picking the best plan within a group of draws also gains from noise,
so the share that the number's values shuffled among the draws give (mean over NOISE_PARTITIONS)
is taken off.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfsim.uncertainty.sampling import draw, evaluate_plans
from perfsim.uncertainty.sensitivity import BINS, drawn_inputs, first_order_shares

DEFAULT_CANDIDATES = 10
DEFAULT_SAMPLES = 256
# A plan that runs out of memory in a draw gets the largest regret of that draw's plans, at least
# NOT_FITTING (a failed job costs at least a rerun): never less than a plan that runs.
NOT_FITTING = 1.0
NOISE_PARTITIONS = 16


def regret(steps: np.ndarray) -> np.ndarray:
    """R(p, d) of a (plans x draws) step-time array, inf where a plan does not fit; draws in which
    no plan fits are left out."""
    steps = steps[:, np.isfinite(steps).any(axis=0)]
    r = steps / steps.min(axis=0) - 1
    worst = np.maximum(NOT_FITTING, np.where(np.isfinite(r), r, 0).max(axis=0))
    return np.where(np.isfinite(r), r, worst)


def expected_loss(r: np.ndarray) -> float:
    """L: the mean regret of the plan best on average over the draws."""
    return float(r.mean(axis=1).min()) if r.size else 0.0


def _loss_knowing(r: np.ndarray, groups) -> float:
    return sum(len(g) * r[:, g].mean(axis=1).min() for g in groups) / r.shape[1]


def decided_share(x: np.ndarray, r: np.ndarray, bins: int = BINS, seed: int = 0) -> float:
    """(L - L_x) / L for the number x (one value per draw, the draws of r), less what x's values
    shuffled among the draws give; 0 where L is 0 (one plan is best in every draw)."""
    loss = expected_loss(r)
    if loss <= 0:
        return 0.0
    share = (loss - _loss_knowing(r, np.array_split(np.argsort(x, kind="stable"), bins))) / loss
    return round(float(min(1.0, max(0.0, share - shuffled_share(x, r, bins, seed)))), 12)  # no 1e-16 left over


def shuffled_share(x: np.ndarray, r: np.ndarray, bins: int = BINS, seed: int = 0) -> float:
    """The share (L - L_x) / L that a number doing nothing gives, as the mean over NOISE_PARTITIONS
    shuffles of x's distinct values: draws sharing a value stay together (draws share their link
    numbers, sampling.py), so a link number's null groups whole link configurations, which gains
    more from noise than groups of single draws would."""
    loss = expected_loss(r)
    values, index = np.unique(x, return_inverse=True)
    rng = np.random.default_rng(seed)
    shares = []
    for _ in range(NOISE_PARTITIONS):
        shuffled = rng.permutation(len(values))[index]
        shares.append((loss - _loss_knowing(r, np.array_split(np.argsort(shuffled, kind="stable"), bins))) / loss)
    return float(np.mean(shares))


@dataclass(frozen=True)
class Number:
    key: str
    choice_share: float  # share of the doubt about the plan that knowing it settles
    step_share: float  # first-order share of the chosen plan's step-time variance
    p10: float
    p90: float
    best_low: int  # the plan best on average among the draws where it is lowest (its bottom group)
    best_high: int  # ... where it is highest


@dataclass(frozen=True)
class PlanChoice:
    samples: int
    p_best: np.ndarray  # per plan: share of the draws in which it is the fastest
    mean_regret: np.ndarray  # per plan
    chosen: int  # the plan with the smallest mean regret
    loss: float  # its mean regret, L
    numbers: tuple  # Number, largest choice share first


def plan_choice(model, system, plans, samples: int = DEFAULT_SAMPLES, dtype: str = "bf16", seed: int = 0,
                ranges: dict | None = None) -> PlanChoice:
    """What decides between `plans` over `samples` prior draws of the profile's ranges (or `ranges`)."""
    # every draw its own link numbers (as sensitivity.py): draws sharing link configurations
    # would let a link number's groups pick plans by the whole configuration, a gain of noise
    # that the shuffled null removes only on average (a link latency read 36% where it decides nothing)
    draws = draw(system, samples, seed, comm_points=samples, ranges=ranges)
    r = evaluate_plans(model, draws, list(plans), dtype)
    steps = np.where(r["memory_total_bytes"] <= system.device.memory_bytes, r["step_time_s"], np.inf)
    return choice_of(steps, drawn_inputs(draws))


def choice_of(steps: np.ndarray, inputs: dict) -> PlanChoice:
    """The PlanChoice of a (plans x draws) step-time array (inf: does not fit) and the numbers
    {key: value per draw} the draws were made of."""
    kept = np.isfinite(steps).any(axis=0)
    r = regret(steps)
    mean = r.mean(axis=1)
    chosen = int(np.argmin(mean))
    winner = np.argmin(np.where(np.isfinite(steps[:, kept]), steps[:, kept], np.inf), axis=0)
    rows = []
    for key, x in inputs.items():
        x = x[kept]
        groups = np.array_split(np.argsort(x, kind="stable"), BINS)
        fits = np.isfinite(steps[chosen, kept])
        rows.append(Number(key, decided_share(x, r), first_order_shares(x[fits], steps[chosen, kept][fits]),
                           *map(float, np.percentile(x, (10, 90))),
                           int(np.argmin(r[:, groups[0]].mean(axis=1))), int(np.argmin(r[:, groups[-1]].mean(axis=1)))))
    rows.sort(key=lambda row: (-row.choice_share, -row.step_share))
    p_best = np.bincount(winner, minlength=steps.shape[0]) / max(1, winner.size)
    return PlanChoice(int(kept.sum()), p_best, mean, chosen, expected_loss(r), tuple(rows))
