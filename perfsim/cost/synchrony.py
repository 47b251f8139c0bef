"""What synchrony costs: a synchronous step waits for its slowest rank (docs/equations.md 9.5).

`framework.rank_jitter` is sigma, the coefficient of variation of a rank's step time: the part of
each rank's deviation from the job's mean that the other ranks do not share (a shift common to all
ranks delays nobody's wait). A rank keeps its speed for the step (a tile's clock under its power
cap, its host's interruptions, its links), so every synchronisation paces its group by the group's
slowest member: a collective's group waits for its slowest rank, the slowest rank of a stage
paces the stage, the slowest stage its pipeline, the slowest replica the gradient reduction, and
the optimizer step's job-wide all-reduce (the gradient norm, the loss) the whole job. Nested, these
make the step's wait the expected maximum over every rank that synchronises, all n of the job:

    T_sync = sigma x E[max of n standard normals] x T_step

`expected_max_normal` is that expectation, exact (numerical quadrature of its integral); it grows
like sqrt(2 ln n) but stays below it (3.24 at n = 1,024, where sqrt(2 ln n) is 3.72).
Left out of a profile (rank_jitter None or 0): no term, every number as before.
"""

from __future__ import annotations

import math

import numpy as np

# Quadrature grid of E[max]: the integrand vanishes beyond x = 12 for every n up to 2^40
# (n Q(12) < 1e-20) and is smooth, so the trapezoid rule on a step of 1/256 is exact to about 1e-6.
_X = np.linspace(0.0, 12.0, 12 * 256 + 1)
_Q = np.array([0.5 * math.erfc(x / math.sqrt(2.0)) for x in _X])  # 1 - Phi(x) = Phi(-x)
_LOG_PHI, _LOG_Q = np.log1p(-_Q), np.log(_Q)
_KNOWN: dict = {}


def _expected_max(n: int) -> float:
    """E[max of n i.i.d. N(0, 1)] = int_0^inf (1 - Phi(x)^n - Phi(-x)^n) dx (docs/equations.md 9.5)."""
    if n <= 1:
        return 0.0
    if n not in _KNOWN:
        integrand = 1.0 - np.exp(n * _LOG_PHI) - np.exp(n * _LOG_Q)
        _KNOWN[n] = float(np.trapezoid(integrand, _X))
    return _KNOWN[n]


def expected_max_normal(n):
    """E[max of n independent standard normals] (0 for n <= 1), for a count or an array of counts."""
    counts = np.asarray(n, dtype=float)
    if counts.ndim == 0:
        return _expected_max(int(round(float(counts))))
    unique, index = np.unique(np.rint(counts).astype(np.int64), return_inverse=True)
    return np.array([_expected_max(int(k)) for k in unique])[index].reshape(counts.shape)


def synchronised_ranks(c):
    """The ranks whose slowest member a step waits for: every rank of the job (tensor x context x
    pipeline x data parallel), which the optimizer step's job-wide all-reduce joins, each collective
    group already joined inside it (module docstring)."""
    return c.tp * c.cp * c.pp * c.dp


def rank_jitter(system) -> float:
    """The profile's framework.rank_jitter (0 when it names none); an array under uncertainty draws."""
    sigma = system.framework.rank_jitter
    return 0.0 if sigma is None else sigma


def synchrony_time(system, c, step):
    """Seconds a step of `step` seconds (everything but this wait) waits for its slowest rank."""
    return rank_jitter(system) * expected_max_normal(synchronised_ranks(c)) * step
