"""Peak device memory per plan, stacked by kind, against the device's capacity."""

from __future__ import annotations

import plotly.graph_objects as go

from perfsim.charts._common import GIB, MEMORY_COLOURS, MEMORY_LABELS, case_line, finish_plan_bars
from perfsim.charts.plans import labels
from perfsim.spec.plan import plan_summary


def figure(model, system, plans: list, note: str = "") -> go.Figure:
    """`plans`: [(name, Prediction)] of one model on one system (perfsim.charts.plans.plan_set)."""
    names = labels(plans)
    capacity = system.device.memory_bytes
    fig = go.Figure()
    for kind, label in MEMORY_LABELS.items():
        values = [p.memory_bytes[kind] / GIB for _, p in plans]
        shares = [p.memory_bytes[kind] / p.memory_bytes["total"] for _, p in plans]
        fig.add_trace(go.Bar(y=names, x=values, orientation="h", name=label, marker_color=MEMORY_COLOURS[kind],
                             customdata=shares,
                             hovertemplate="%{x:.2f} GiB (%{customdata:.0%} of the peak)<extra>" + label + "</extra>"))
    totals = [p.memory_bytes["total"] / GIB for _, p in plans]
    fig.add_trace(go.Scatter(
        y=names, x=totals, mode="text", showlegend=False, textposition="middle right",
        text=[f"  {t:.1f} GiB" + ("" if p.fits else " - does not fit") for t, (_, p) in zip(totals, plans)],
        textfont={"color": ["#222" if p.fits else "#c0392b" for _, p in plans]},
        hovertext=[f"{plan_summary(p.plan, long=True)}<br>peak on the {p.memory_peak_stage} pipeline stage"
                   for _, p in plans], hoverinfo="text"))
    fig.add_vline(x=capacity / GIB, line={"color": "#c0392b", "dash": "dash", "width": 2},
                  annotation_text=f"device memory {capacity / GIB:.1f} GiB", annotation_position="top")
    fig.update_xaxes(title_text="peak memory per device (GiB)", range=[0, 1.25 * max(max(totals), capacity / GIB)])
    subtitle = (f"{case_line(model, system, plans[0][1].devices)}. Each bar: the peak memory of one device under a "
                "plan (the larger of the first and last pipeline stage), by what holds it; the dashed line is the "
                "device's capacity." + (f" {note}." if note else ""))
    return finish_plan_bars(fig, "Does the plan fit in device memory?", subtitle, len(plans))
