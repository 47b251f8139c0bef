"""Where each plan's step time goes: exposed seconds per cause, stacked (they add up to the step)."""

from __future__ import annotations

import plotly.graph_objects as go

from perfsim.charts._common import TERM_COLOURS, TERM_LABELS, case_line, finish_plan_bars
from perfsim.charts.plans import labels
from perfsim.spec.plan import plan_summary


def figure(model, system, plans: list, note: str = "", samples: int | None = None) -> go.Figure:
    """`plans`: [(name, Prediction)] of one model on one system (perfsim.charts.plans.plan_set).
    With `samples`: each part's P10-P90 over that many draws of the profile's ranges, as error bars."""
    names = labels(plans)
    fig = go.Figure()
    spreads, spread_note = _spreads(model, system, plans, samples) if samples else (None, "")
    for term, label in TERM_LABELS.items():
        values = [p.time_breakdown_s[term] for _, p in plans]
        if all(v == 0 for v in values):
            continue
        shares = [p.time_breakdown_s[term] / p.step_time_s for _, p in plans]
        fig.add_trace(go.Bar(y=names, x=values, orientation="h", name=label, marker_color=TERM_COLOURS[term],
                             customdata=shares,
                             hovertemplate="%{x:.3f} s (%{customdata:.1%} of the step)<extra>" + label + "</extra>"))
    ends = [p.step_time_s for _, p in plans]
    if spreads:
        ends = [max(end, reach) for end, reach in zip(ends, _add_error_bars(fig, names, plans, spreads))]
    fig.add_trace(go.Scatter(
        y=names, x=ends, mode="text", showlegend=False, textposition="middle right",
        text=[f"  {p.step_time_s:.2f} s" + (f" (P10-P90 {u['step_time_s']['p10']:.2f}-{u['step_time_s']['p90']:.2f} s)"
                                            if spreads else "")
              + f", {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}" for (_, p), u in zip(plans, spreads or plans)],
        hovertext=[plan_summary(p.plan, long=True) for _, p in plans], hoverinfo="text"))
    fig.update_xaxes(title_text="time per training step (s), exposed time by cause",
                     range=[0, (1.9 if spreads else 1.45) * max(ends)])
    subtitle = (f"{case_line(model, system, plans[0][1].devices)}. Each bar is one training step; a segment is the "
                "time its cause adds to the step (communication hidden behind compute is not counted), so the "
                "segments add up to the step time." + (f" {spread_note}" if spread_note else "")
                + (f" {note}." if note else ""))
    return finish_plan_bars(fig, "Where does the step time go?", subtitle, len(plans))


def _spreads(model, system, plans: list, samples: int) -> tuple:
    """(each plan's `uncertainty` object under one set of draws, as predict --uncertainty gives
    it, the sentence the chart says about them)."""
    from perfsim.charts.robustness import drawn_from, plan_spreads

    spreads, _, unexplained = plan_spreads(model, system, [p.plan for _, p in plans], samples, plans[0][1].dtype)
    return (spreads, f"Error bars: each cause's P10 to P90 (tick: P50) over {spreads[0]['samples']} draws of "
                     f"{drawn_from(system)}, drawn from where its segment starts." + (f" {unexplained}" if unexplained else ""))


SMALL = 0.01  # a cause below this share of every plan's step gets no error bar: it would sit on its neighbour's


def _add_error_bars(fig, names: list, plans: list, spreads: list) -> list:
    """One marker trace per cause: its P50 with a P10-P90 bar, placed where the cause's segment
    starts on each plan's bar. Returns how far right each plan's bars reach."""
    start = [0.0] * len(plans)
    reach = [0.0] * len(plans)
    first = True
    for term, label in TERM_LABELS.items():
        q = [u["time_breakdown_s"][term] for u in spreads]
        if all(v["p90"] < SMALL * u["step_time_s"]["p50"] for v, u in zip(q, spreads)):
            start = [s + p.time_breakdown_s[term] for s, (_, p) in zip(start, plans)]
            continue
        mid = [s + v["p50"] for s, v in zip(start, q)]
        fig.add_trace(go.Scatter(
            y=names, x=mid, mode="markers", name="P10-P90 of each cause over the draws", legendgroup="spread",
            showlegend=first, marker={"symbol": "line-ns-open", "size": 12, "color": "#222222"},
            error_x={"type": "data", "symmetric": False, "array": [v["p90"] - v["p50"] for v in q],
                     "arrayminus": [v["p50"] - v["p10"] for v in q], "color": "#222222", "thickness": 1.5, "width": 4},
            hovertext=[f"{label}: P10 {v['p10']:.3f} .. P50 {v['p50']:.3f} .. P90 {v['p90']:.3f} s" for v in q],
            hoverinfo="text"))
        first = False
        reach = [max(r, s + v["p90"]) for r, s, v in zip(reach, start, q)]
        start = [s + p.time_breakdown_s[term] for s, (_, p) in zip(start, plans)]
    return reach
