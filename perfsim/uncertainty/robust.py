"""`perfsim search --robust`: the point search's best plans ranked again over the draws of the
profile's ranges (its posterior where it names observations).

Every candidate is priced under every draw; a plan that does not fit in a draw's memory takes no
part in that draw. Per plan: P(best), the share of draws in which it is the fastest candidate,
and P(within 5%), the share in which its step time is within 5% of that draw's fastest. Plans
are ranked by their median step time over the draws. The top choice is called robust when it is
within 5% of the best in at least ROBUST_SHARE of the draws.

The candidates are the point search's best CANDIDATES plans (or --top, if more): a plan far
down the point ranking may still win in some draws; the text says how many were compared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfsim.uncertainty.posterior import profile_draws
from perfsim.uncertainty.sampling import evaluate_plans

CANDIDATES = 30
WITHIN = 0.05
ROBUST_SHARE = 0.9
ROBUST_SAMPLES = 256


@dataclass(frozen=True)
class RobustPlan:
    prediction: object  # the point Prediction
    step_time_s: dict  # p10, p50, p90 over the draws where it fits
    p_best: float
    p_within_5pct: float
    p_fits: float

    def as_json(self) -> dict:
        return self.prediction.as_json() | {"p_best": self.p_best, "p_within_5pct": self.p_within_5pct,
                                            "p_fits": self.p_fits, "step_time_s_percentiles": self.step_time_s}


def robust_ranking(model, system, predictions, samples: int = ROBUST_SAMPLES, dtype: str = "bf16", seed: int = 0):
    """(RobustPlans ranked by median step time, the note on unexplained observations or '')."""
    draws, posterior = profile_draws(system, samples, seed)
    r = evaluate_plans(model, draws, [p.plan for p in predictions], dtype)
    steps = np.where(r["memory_total_bytes"] <= system.device.memory_bytes, r["step_time_s"], np.inf)  # plans x draws
    best = steps.min(axis=0)
    winner = np.argmin(steps, axis=0)
    ranked = []
    for i, p in enumerate(predictions):
        fits = np.isfinite(steps[i])
        spread = np.percentile(steps[i][fits], (10, 50, 90)) if fits.any() else (np.inf,) * 3
        ranked.append(RobustPlan(p, dict(zip(("p10", "p50", "p90"), map(float, spread))),
                                 float(np.mean(winner == i)), float(np.mean(steps[i] <= (1 + WITHIN) * best)),
                                 float(np.mean(fits))))
    ranked.sort(key=lambda rp: (rp.p_fits < 0.5, rp.step_time_s["p50"]))  # plans that mostly fit first
    return ranked, posterior.unexplained_text() if posterior is not None else ""


def verdict(ranked) -> str:
    """One sentence: is the top choice robust?"""
    top = ranked[0]
    if top.p_within_5pct >= ROBUST_SHARE:
        return (f"The top plan is robust: within 5% of the best in {top.p_within_5pct:.0%} of the draws "
                f"(best in {top.p_best:.0%}).")
    rivals = [rp for rp in ranked[1:] if rp.p_best > 0.05]
    return (f"The top plan is not robust: within 5% of the best in only {top.p_within_5pct:.0%} of the draws "
            f"(best in {top.p_best:.0%}); {len(rivals)} other plan(s) are best in more than 5% of them. "
            "Measure the numbers that separate them first (docs/validation.md).")


def print_robust(result, model, system, devices: int, args) -> None:
    """`perfsim search --robust`: the ranking as text or JSON (plan objects with p_best and
    p_within_5pct); what the observations cannot explain goes to stderr as a note."""
    import json
    import sys

    from perfsim.commands.search import _summary

    ranked, note = robust_ranking(model, system, result.plans, args.samples or ROBUST_SAMPLES, args.dtype)
    if note:
        print(f"perfsim: note: {note}", file=sys.stderr)
    samples = args.samples or ROBUST_SAMPLES
    what = "posterior conditioned on the profile's observations" if system.observations else "the profile's ranges"
    if args.json:
        print(json.dumps({"evaluated": result.evaluated, "feasible": result.feasible, "candidates": result.candidates,
                          "seconds": result.seconds, "rejected": result.rejected,
                          "robust": {"samples": samples, "compared": len(ranked), "draws": what,
                                     "top_is_robust": ranked[0].p_within_5pct >= ROBUST_SHARE,
                                     "verdict": verdict(ranked)},
                          "plans": [rp.as_json() for rp in ranked[:args.top]]}, indent=2))
        return
    lines = [f"{model.name} on {devices} x {system.device.name} ({system.name}), global batch {args.gbs}",
             f"the point search's best {len(ranked)} of {result.feasible:,} plans that fit, ranked over {samples} draws "
             f"of {what}", "",
             f"{'#':>3} {'step P10 .. P50 .. P90':>26} {'point':>8} {'P(best)':>8} {'P(<=5%)':>8}  plan"]
    for i, rp in enumerate(ranked[:args.top], 1):
        q = rp.step_time_s
        lines.append(f"{i:>3} {q['p10']:>8.2f} .. {q['p50']:>6.2f} .. {q['p90']:>6.2f}s {rp.prediction.step_time_s:>7.2f}s "
                     f"{rp.p_best:>8.0%} {rp.p_within_5pct:>8.0%}  {_summary(rp.prediction)}"
                     + (f" (fits in {rp.p_fits:.0%} of the draws)" if rp.p_fits < 1 else ""))
    lines += ["", verdict(ranked)]
    print("\n".join(lines))
