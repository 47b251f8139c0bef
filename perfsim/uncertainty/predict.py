"""`perfsim predict --uncertainty`: one plan's prediction under every draw of the profile's
ranges (conditioned on its observations where it names any), as P10 / P50 / P90."""

from __future__ import annotations

import numpy as np

from perfsim.cost.columns import columns_of
from perfsim.uncertainty.posterior import profile_draws
from perfsim.uncertainty.sampling import DEFAULT_SAMPLES, evaluate_draws

PERCENTILES = (("p10", 10), ("p50", 50), ("p90", 90))


def percentiles(values) -> dict:
    values = np.asarray(values, float)
    return {name: float(np.percentile(values, q)) for name, q in PERCENTILES}


def predict_uncertainty(model, system, plan, samples: int = DEFAULT_SAMPLES, dtype: str = "bf16",
                        seed: int = 0, observe: tuple = ()) -> tuple[dict, str]:
    """(the `uncertainty` object of predict --json, a note on what the observations could not
    explain or ''); `observe`: calibration ledgers to condition on as well."""
    draws, posterior = profile_draws(system, samples, seed, observe)
    return plan_spread(model, draws, plan, dtype), posterior.unexplained_text() if posterior is not None else ""


def plan_spread(model, draws, plan, dtype: str = "bf16") -> dict:
    """The `uncertainty` object of one plan under draws already taken (several plans' charts
    share one set of draws)."""
    r = evaluate_draws(model, draws, columns_of(plan), dtype)
    return summary_of(r["step_time_s"], r["tokens_per_s"], r["memory_bytes"]["total"], r["time_breakdown_s"])


def summary_of(step_time_s, tokens_per_s, memory_total_bytes, time_breakdown_s: dict) -> dict:
    """The `uncertainty` object from one plan's numbers per draw (arrays over the draws)."""
    return {"samples": int(np.size(step_time_s)), "step_time_s": percentiles(step_time_s),
            "tokens_per_s": percentiles(tokens_per_s), "memory_total_bytes": percentiles(memory_total_bytes),
            "time_breakdown_s": {part: percentiles(v) for part, v in time_breakdown_s.items()}}


def uncertainty_lines(summary: dict, conditioned: bool, ledgers: tuple = ()) -> str:
    """The text predict prints below its table (`ledgers`: those --observe conditioned on too)."""
    def span(q, fmt):
        return f"{fmt(q['p10'])} .. {fmt(q['p50'])} .. {fmt(q['p90'])}"

    what = "posterior conditioned on the profile's observations" if conditioned else "the profile's ranges"
    if ledgers:
        what = ("posterior conditioned on the profile's observations and " if conditioned else
                "posterior conditioned on ") + "the measurements of " + ", ".join(ledgers)
    lines = [f"uncertainty (P10 .. P50 .. P90 over {summary['samples']} draws of {what})",
             f"  step time    {span(summary['step_time_s'], lambda v: f'{v:.3g} s')}",
             f"  throughput   {span(summary['tokens_per_s'], lambda v: f'{v:,.0f}')} tokens/s",
             f"  memory       {span(summary['memory_total_bytes'], lambda v: f'{v / 1e9:.1f} GB')}"]
    for part, q in summary["time_breakdown_s"].items():
        if q["p90"] > 0:
            lines.append(f"  {part:<12} {span(q, lambda v: f'{v:.3g} s')}")
    return "\n".join(lines)
