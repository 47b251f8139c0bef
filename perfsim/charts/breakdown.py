"""Where each plan's step time goes: exposed seconds per cause, stacked (they add up to the step)."""

from __future__ import annotations

import plotly.graph_objects as go

from perfsim.charts._common import TERM_COLOURS, TERM_LABELS, case_line, finish_plan_bars, plan_label
from perfsim.charts.plans import labels


def figure(model, system, plans: list, note: str = "") -> go.Figure:
    """`plans`: [(name, Prediction)] of one model on one system (perfsim.charts.plans.plan_set)."""
    names = labels(plans)
    fig = go.Figure()
    for term, label in TERM_LABELS.items():
        values = [p.time_breakdown_s[term] for _, p in plans]
        if all(v == 0 for v in values):
            continue
        shares = [p.time_breakdown_s[term] / p.step_time_s for _, p in plans]
        fig.add_trace(go.Bar(y=names, x=values, orientation="h", name=label, marker_color=TERM_COLOURS[term],
                             customdata=shares,
                             hovertemplate="%{x:.3f} s (%{customdata:.1%} of the step)<extra>" + label + "</extra>"))
    steps = [p.step_time_s for _, p in plans]
    fig.add_trace(go.Scatter(
        y=names, x=steps, mode="text", showlegend=False, textposition="middle right",
        text=[f"  {p.step_time_s:.2f} s, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}" for _, p in plans],
        hovertext=[plan_label(p.plan, short=False) for _, p in plans], hoverinfo="text"))
    fig.update_xaxes(title_text="time per training step (s), exposed time by cause", range=[0, 1.45 * max(steps)])
    subtitle = (f"{case_line(model, system, plans[0][1].devices)}. Each bar is one training step; a segment is the "
                "time its cause adds to the step (communication hidden behind compute is not counted), so the "
                "segments add up to the step time." + (f" {note}." if note else ""))
    return finish_plan_bars(fig, "Where does the step time go?", subtitle, len(plans))
