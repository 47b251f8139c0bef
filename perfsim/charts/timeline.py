"""One simulated training step as a Gantt chart: per pipeline stage, its compute stream,
tensor-parallel collectives, pipeline sends and data-parallel traffic (the event simulator,
perfsim.schedule.simulator; the chart itself is perfsim.schedule.timeline.timeline_figure)."""

from __future__ import annotations

from perfsim.charts._common import TERM_LABELS, case_line, style, title
from perfsim.spec.plan import plan_summary


def figure(model, system, plan, dtype: str = "bf16", schedule: str | None = None, max_bars: int | None = None):
    from perfsim.schedule.simulator import simulate
    from perfsim.schedule.timeline import CHART_BARS, timeline_figure

    sim = simulate(model, system, plan, dtype, schedule)
    fig, note = timeline_figure(sim.result, max_bars=max_bars or CHART_BARS)
    r = sim.result
    subtitle = (f"{case_line(model, system, plan.devices, plan.gbs)}; {plan_summary(plan)}. Simulated step "
                f"{r.step_time_s:.2f} s ({r.schedule}, {r.m} micro-batches per pipeline) against "
                f"{sim.analytic.step_time_s:.2f} s from the closed form. Rows: per pipeline stage, its compute "
                "stream, tensor-parallel collectives, pipeline sends and data-parallel traffic; drag to zoom, "
                "double-click to reset." + (f" Note: {note}." if note else ""))
    for trace in fig.data:  # the simulator names traces by breakdown key; say what each is
        trace.name = TERM_LABELS.get(trace.name, trace.name)
    fig.update_layout(title=title("One training step, simulated stage by stage", subtitle, 150),
                      legend_title_text="what runs")
    style(fig, height=max(fig.layout.height or 0, 22 * len(fig.layout.yaxis.categoryarray or ()) + 150, 450) + 150)
    fig.update_layout(margin={"t": 170, "l": 180})
    fig.update_yaxes(title_text="pipeline stage and stream")
    return fig
