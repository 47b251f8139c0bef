"""How sure perfsim is, for the report and the what-if page: one plan's spread over the draws of
the profile's ranges (its posterior where it names observations), the observations those draws
are conditioned on and what they cannot explain, and the best plans ranked over the draws with
P(best) and P(within 5%) (perfsim.uncertainty.robust.robust_ranking, as `perfsim search --robust`
ranks plans).

The spread is exactly `perfsim predict --uncertainty`'s (same draws, same seed); P(best) is over
the candidates given (the point search's best plans and yours, or the what-if's fastest at 1x),
under the draws `perfsim search --robust` takes.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from perfsim.charts._common import GIB, TERM_LABELS, case_line, style, title
from perfsim.spec.plan import canonical, plan_summary


def drawn_from(system) -> str:
    return "the posterior conditioned on the profile's observations" if system.observations else "the profile's ranges"


def span(q: dict, fmt) -> str:
    """P10 .. P50 .. P90 in words."""
    return f"P10 {fmt(q['p10'])} .. P50 {fmt(q['p50'])} .. P90 {fmt(q['p90'])}"


def seconds(v: float) -> str:
    return f"{v:.4g} s"


def ranked_plans(model, system, predictions: list, samples: int, dtype: str = "bf16") -> tuple:
    """perfsim.uncertainty.robust.robust_ranking of `predictions` (point Predictions; of plans equal
    up to choices that change nothing, the first kept): (RobustPlans, note)."""
    from perfsim.uncertainty.robust import robust_ranking

    unique, seen = [], set()
    for p in predictions:
        if canonical(p.plan) not in seen:
            seen.add(canonical(p.plan))
            unique.append(p)
    return robust_ranking(model, system, unique, samples, dtype)


# What a report's charts share within one process: the draws, and each plan's spread under them.
# Keyed by the identity of the model and system they belong to, whose references are kept, so a
# key is never reused by another object.
_REMEMBERED: dict = {}


def _remembered(owners: tuple, key: tuple, compute=None):
    """compute(), once per process for these owners (compared by identity) and key; with no
    `compute`, what was remembered, or None."""
    full = tuple(id(o) for o in owners) + key
    found = _REMEMBERED.get(full)
    if found is None or any(a is not b for a, b in zip(found[0], owners)):
        if compute is None:
            return None
        found = _REMEMBERED[full] = (owners, compute())
    return found[1]


def posterior_draws(system, samples: int) -> tuple:
    """perfsim.uncertainty.posterior.profile_draws(system, samples), taken once per process."""
    from perfsim.uncertainty.posterior import profile_draws

    return _remembered((system,), ("draws", samples), lambda: profile_draws(system, samples))


def draws_of(system, samples: int) -> tuple:
    """(the draws a prediction with `samples` uses, the note on what the observations cannot explain or '')."""
    draws, posterior = posterior_draws(system, samples)
    return draws, posterior.unexplained_text() if posterior is not None else ""


def plan_spreads(model, system, plans: list, samples: int, dtype: str = "bf16") -> tuple:
    """(each Plan's `uncertainty` object as perfsim predict --uncertainty --json gives it, all
    under one set of draws, the Posterior or None, the note on what the observations cannot
    explain or '')."""
    from perfsim.uncertainty.predict import summary_of
    from perfsim.uncertainty.sampling import evaluate_plans

    draws, posterior = posterior_draws(system, samples)
    owners, key = (model, system), lambda plan: ("spread", samples, dtype, plan)
    missing = [p for p in dict.fromkeys(plans) if _remembered(owners, key(p)) is None]
    if missing:
        r = evaluate_plans(model, draws, missing, dtype, parts=True)  # one call per plan family and link configuration
        for i, plan in enumerate(missing):
            _remembered(owners, key(plan), lambda i=i: summary_of(
                r["step_time_s"][i], r["tokens_per_s"][i], r["memory_total_bytes"][i],
                {part: v[i] for part, v in r["time_breakdown_s"].items()}))
    return ([_remembered(owners, key(p)) for p in plans], posterior,
            posterior.unexplained_text() if posterior is not None else "")


def find(ranked: list, plan):
    """The RobustPlan of `plan` among `ranked` (plans equal up to choices that change nothing are one), or None."""
    return next((rp for rp in ranked if canonical(rp.prediction.plan) == canonical(plan)), None)


def odds_text(rp, among: str) -> str:
    """P(best) and P(within 5%) in words; `among`: which plans they were compared with."""
    return (f"fastest in {rp.p_best:.0%} of the draws and within 5% of the fastest in {rp.p_within_5pct:.0%}, "
            f"among {among}")


def observation_lines(system, posterior) -> list:
    """Per observation the profile names: its value, what the posterior predicts for it, and
    whether the ranges can explain it with the others (without a posterior, that there is none)."""
    if posterior is None:
        return ["The profile names no observations: the draws are its ranges as they stand, conditioned on no "
                "published or measured result (docs/profile-format.md, 'Ranges')."]
    from perfsim.uncertainty.posterior import EXPLAINED

    unexplained = {obs.name for obs, _ in posterior.unexplained}
    lines = []
    for obs in posterior.observations:
        q = posterior.predicted_percentiles(obs)
        verdict = ("cannot be explained together with the others (left out of the conditioning)"
                   if obs.name in unexplained else f"explained (some draws come within {EXPLAINED:g} tolerances of it "
                                                   "and of the others)")
        lines.append(f"Observation '{obs.name}': {obs.quantity} = {obs.value:g} +- {obs.tolerance:g} "
                     f"({obs.model.name}, {obs.devices} devices); the posterior gives P10 {q[0]:.3g} .. P50 {q[1]:.3g} "
                     f".. P90 {q[2]:.3g}: {verdict}.")
    lines.append(f"Conditioning kept {posterior.effective_draws:.0f} effective of {posterior.prior.n} prior draws "
                 f"(observations file {system.observations}).")
    return lines


def figure(model, system, ranked: list, samples: int, show: int = 10, yours=None) -> go.Figure:
    """The best plans over the draws: each plan's step time P10-P90 (dot: P50, diamond: the point
    prediction), with P(best) and P(within 5%) beside it; the `show` first of the ranking and
    `yours` (a RobustPlan) wherever it ranks."""
    rows = [(i, rp) for i, rp in enumerate(ranked, 1) if i <= show or rp is yours]
    names = [("your plan" if rp is yours else f"#{i}") + f": {plan_summary(rp.prediction.plan)}" for i, rp in rows]
    q = [rp.step_time_s for _, rp in rows]
    fig = go.Figure()
    fig.add_trace(go.Scatter(
        y=names, x=[v["p50"] for v in q], mode="markers", name=f"step time P50, bar P10 to P90 over {samples} draws",
        marker={"size": 10, "color": "#4c78a8"},
        error_x={"type": "data", "symmetric": False, "array": [v["p90"] - v["p50"] for v in q],
                 "arrayminus": [v["p50"] - v["p10"] for v in q], "color": "#4c78a8", "thickness": 2, "width": 6},
        hovertext=[f"{plan_summary(rp.prediction.plan, long=True)}<br>step time {span(v, seconds)}<br>"
                   f"P(best) {rp.p_best:.0%}, P(within 5%) {rp.p_within_5pct:.0%}"
                   + (f", fits in {rp.p_fits:.0%} of the draws" if rp.p_fits < 1 else "") for (_, rp), v in zip(rows, q)],
        hoverinfo="text"))
    fig.add_trace(go.Scatter(y=names, x=[rp.prediction.step_time_s for _, rp in rows], mode="markers",
                             name="point prediction (the profile's values)",
                             marker={"symbol": "diamond-open", "size": 11, "color": "#e45756", "line": {"width": 2}},
                             hovertemplate="point prediction %{x:.2f} s<extra></extra>"))
    ends = [max(v["p90"], rp.prediction.step_time_s) if math.isfinite(v["p90"]) else rp.prediction.step_time_s
            for (_, rp), v in zip(rows, q)]
    fig.add_trace(go.Scatter(y=names, x=ends, mode="text", showlegend=False, textposition="middle right",
                             text=[f"  P(best) {rp.p_best:.0%}, P(within 5%) {rp.p_within_5pct:.0%}" for _, rp in rows],
                             hoverinfo="skip"))
    low = min((v["p10"] for v in q if math.isfinite(v["p10"])), default=ends[0])
    fig.update_xaxes(title_text="time per training step (s) over the draws",
                     range=[0.9 * min(low, min(rp.prediction.step_time_s for _, rp in rows)), 1.3 * max(ends)])
    fig.update_yaxes(autorange="reversed", automargin=True, title_text="plan, ranked over the draws")
    subtitle = (f"{case_line(model, system, ranked[0].prediction.devices, ranked[0].prediction.plan.gbs)}. "
                f"{len(ranked)} plans priced under the same {samples} draws of {drawn_from(system)} and ranked as "
                "perfsim search --robust ranks plans (perfsim.uncertainty.robust); P(best): the share of draws in which "
                "a plan is the fastest that fits, P(within 5%): the share in which it is within 5% of that draw's "
                "fastest.")
    fig.update_layout(title=title("Which plan is best, and how sure is that?", subtitle, 150),
                      legend={"orientation": "h", "x": 0, "y": -0.25})
    style(fig, height=max(420, 60 * len(rows) + 260))
    fig.update_layout(margin={"t": 130})
    return fig


def section_notes(system, plan, spread: dict, posterior, ranked: list, among: str, verdict: str, note: str,
                  robust_samples: int) -> list:
    """The report section's paragraphs: the plan's spread, the observations, the ranking's verdict
    (`among`: which plans were ranked, in words)."""
    yours = find(ranked, plan)
    lines = [f"Your plan over {spread['samples']} draws of {drawn_from(system)} (as perfsim predict --uncertainty): "
             f"step time {span(spread['step_time_s'], seconds)}; throughput "
             f"{span(spread['tokens_per_s'], lambda v: f'{v:,.0f}')} tokens/s; peak memory "
             f"{span(spread['memory_total_bytes'], lambda v: f'{v / GIB:.1f} GiB')}."]
    parts = [f"{TERM_LABELS[part]} {span(q, seconds)}" for part, q in spread["time_breakdown_s"].items() if q["p90"] > 0]
    lines.append("By cause (exposed seconds): " + "; ".join(parts) + ".")
    lines += observation_lines(system, posterior)
    if note:
        lines.append(note)
    lines.append(f"Over {robust_samples} draws (as perfsim search --robust takes them), your plan is "
                 f"{odds_text(yours, among)}. {verdict}")
    return lines
