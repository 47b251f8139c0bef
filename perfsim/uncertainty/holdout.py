"""A test of the uncertainty method that can fail: condition dgx-a100, its ranges widened, on the
odd rows of SC21 Table 1 and predict the even rows. Each row runs the plan perfsim's point
prediction picks for it (perfsim.reproduce.sc21_best: micro-batch and interleaving tuned); the
observed quantity is the published TFLOP/s per GPU against perfsim's hardware FLOPs, as in
docs/validation.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfsim.cost.columns import columns_of
from perfsim.published import SC21_TABLE1
from perfsim.uncertainty.observations import Observation
from perfsim.uncertainty.posterior import condition
from perfsim.uncertainty.sampling import draw, evaluate_draws, profile_ranges

WIDEN = 2.0  # each range twice as wide on either side of the value
TOLERANCE = 0.05  # a draw agrees with a row when within 5% of its TFLOP/s


@dataclass(frozen=True)
class HeldOutRow:
    """One held-out row, TFLOP/s per GPU: today's point prediction; the posterior's P10/P50/P90 of
    the model's rate; and the posterior predictive's P10/P90 of a published rate, the model's times
    1 + e with e normal of standard deviation TOLERANCE: the same error model the odd rows were
    conditioned with (a published row is the model plus what the model misses)."""
    row: object  # Sc21Row
    point: float
    p10: float
    p50: float
    p90: float
    predictive_p10: float
    predictive_p90: float

    @property
    def covered(self) -> bool:
        return self.p10 <= self.row.tflops_per_gpu <= self.p90

    @property
    def predictive_covered(self) -> bool:
        return self.predictive_p10 <= self.row.tflops_per_gpu <= self.predictive_p90


def sc21_odd_even(samples: int = 1024, comm_points: int = 128, seed: int = 0, widen: float = WIDEN):
    """(posterior, held-out rows): conditioned on rows 1, 3, 5, 7, 9, predicting 2, 4, 6, 8, 10."""
    from perfsim.reproduce import sc21_best
    from perfsim.spec.system import load_system

    system = load_system("dgx-a100")
    points = [sc21_best(row, system) for row in SC21_TABLE1]
    prior = draw(system, samples, seed, comm_points, ranges=profile_ranges(system, widen))
    observations = [Observation(f"SC21 {row.params_billion}B", "SC21 Table 1", p.model, p.plan, p.plan.devices,
                                "hardware_tflops_per_device", row.tflops_per_gpu, TOLERANCE * row.tflops_per_gpu)
                    for row, p in list(zip(SC21_TABLE1, points))[0::2]]
    posterior = condition(prior, observations)
    kept = posterior.resampled(samples // 2, seed)
    error = 1 + TOLERANCE * np.random.default_rng(seed).standard_normal(kept.n)
    held = []
    for row, p in list(zip(SC21_TABLE1, points))[1::2]:
        rates = evaluate_draws(p.model, kept, columns_of(p.plan))["hardware_tflops_per_device"]
        p10, p50, p90 = np.percentile(rates, (10, 50, 90))
        q10, q90 = np.percentile(rates * error, (10, 90))
        held.append(HeldOutRow(row, p.hardware_tflops_per_device, float(p10), float(p50), float(p90),
                               float(q10), float(q90)))
    return posterior, held


def mean_error(held, attribute: str) -> float:
    return float(np.mean([abs(getattr(h, attribute) / h.row.tflops_per_gpu - 1) for h in held]))


def markdown(posterior, held) -> str:
    out = [f"Conditioned on rows 1, 3, 5, 7, 9 (tolerance {TOLERANCE:.0%} of each; {posterior.prior.n} draws, "
           f"{posterior.effective_draws:.0f} effective; {posterior.unexplained_text() or 'all explained'})", "",
           "| held-out row | published TFLOP/s | point prediction | model P10 | P50 | P90 | covered | "
           "predictive P10 - P90 | covered |", "|---|---|---|---|---|---|---|---|---|"]
    for h in held:
        out.append(f"| {h.row.params_billion}B | {h.row.tflops_per_gpu} | {h.point:.1f} | {h.p10:.1f} | {h.p50:.1f} | "
                   f"{h.p90:.1f} | {'yes' if h.covered else 'no'} | {h.predictive_p10:.1f} - {h.predictive_p90:.1f} | "
                   f"{'yes' if h.predictive_covered else 'no'} |")
    out += ["", f"The predictive P10-P90 covers {sum(h.predictive_covered for h in held)} of {len(held)}, the model's "
                f"{sum(h.covered for h in held)}; mean absolute error of the median {mean_error(held, 'p50'):.1%}, of "
                f"today's point prediction {mean_error(held, 'point'):.1%}."]
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(*sc21_odd_even()))
