"""What every chart shares: names and colours of the breakdown and memory terms, the case line,
the page style (plans in words: spec.plan.plan_summary)."""

from __future__ import annotations

from perfsim.schedule.analytic import BREAKDOWN_KEYS

GIB = 2.0 ** 30

# Exposed step time by cause (prediction.time_breakdown_s), in the order they are stacked.
TERM_LABELS = {
    "compute": "compute (forward and backward)",
    "recompute": "recomputation",
    "tp_comm": "tensor-parallel communication",
    "cp_comm": "context-parallel ring attention (not hidden)",
    "ep_comm": "expert-parallel dispatch and combine",
    "pp_comm": "pipeline sends",
    "pp_bubble": "pipeline bubble (idle)",
    "dp_comm": "data-parallel communication (not hidden)",
    "optimizer": "optimizer step",
    "other": "framework overhead",
    "synchrony": "waiting for the slowest rank",
}
TERM_COLOURS = {"compute": "#4c78a8", "recompute": "#9ecae9", "tp_comm": "#f58518", "cp_comm": "#eeca3b",
                "ep_comm": "#ff9da6", "pp_comm": "#54a24b",
                "pp_bubble": "#bab0ac", "dp_comm": "#e45756", "optimizer": "#b279a2", "other": "#9d755d",
                "synchrony": "#72b7b2"}
assert tuple(TERM_LABELS) == BREAKDOWN_KEYS

# Peak device memory by kind (prediction.memory_bytes, without "total").
MEMORY_LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer": "optimizer states",
    "activations": "activations",
    "buffers": "communication buffers and workspace",
}
MEMORY_COLOURS = {"weights": "#4c78a8", "gradients": "#72b7b2", "optimizer": "#b279a2", "activations": "#f58518",
                  "buffers": "#bab0ac"}

FONT = "Helvetica, Arial, sans-serif"


def case_line(model, system, devices: int, gbs: int | None = None) -> str:
    nodes = devices / system.node.devices_per_node
    where = f"{devices:,} x {system.device.name}"
    if nodes == int(nodes):
        where += f" ({int(nodes)} node{'s' if nodes != 1 else ''} of {system.name})"
    else:
        where += f" ({system.name})"
    return f"{model.name} on {where}" + (f", global batch {gbs:,} sequences" if gbs else "")


def wrap(text: str, width: int = 130) -> str:
    """Plotly does not wrap text: break it into lines of at most `width` characters."""
    import textwrap

    return "<br>".join(textwrap.wrap(text, width))


def title(text: str, subtitle: str = "", width: int = 130) -> dict:
    """A layout title with optional smaller lines under it."""
    lines = "".join(f"<br><span style='font-size:12px'>{line}</span>" for line in wrap(subtitle, width).split("<br>")
                    if line)
    return {"text": text + lines, "x": 0.01, "xanchor": "left", "y": 0.98, "yanchor": "top"}


def style(fig, height: int = 520):
    fig.update_layout(template="plotly_white", font={"family": FONT, "size": 13}, height=height,
                      margin={"l": 70, "r": 30, "t": 100, "b": 70}, hoverlabel={"align": "left"})
    return fig


def finish_plan_bars(fig, heading: str, subtitle: str, plans: int):
    """Layout shared by the charts with one stacked horizontal bar per plan (memory, breakdown)."""
    # The bar labels spell each plan out (TP 8 1d, PP 16 1f1b, ...); a longer rotated title would
    # run past a short chart's edge.
    fig.update_yaxes(autorange="reversed", automargin=True, title_text="plan")
    fig.update_layout(title=title(heading, subtitle, 150), barmode="stack",
                      legend={"orientation": "h", "x": 0, "y": -0.2, "traceorder": "normal"})
    style(fig, height=max(420, 70 * plans + 260))
    fig.update_layout(margin={"t": 130})
    return fig
