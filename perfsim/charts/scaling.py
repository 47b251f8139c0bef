"""Weak and strong scaling efficiency against the node count (perfsim.scaling), with the
published SMNG-P2 points overlaid where the case is theirs, and where the efficiency goes."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from perfsim.charts._common import TERM_COLOURS, TERM_LABELS, style, title
from perfsim.errors import PerfsimError
from perfsim.reproduce import (SMNG_PUBLISHED_EFFICIENCY, SMNG_SCALING_BASE, SMNG_SCALING_NODES, SMNG_STRONG_GBS)
from perfsim.scaling import scale
from perfsim.spec.plan import plan_summary

MODE_COLOURS = {"weak": "#4c78a8", "strong": "#f58518"}
BAND_COLOURS = {"weak": "rgba(76,120,168,0.2)", "strong": "rgba(245,133,24,0.2)"}


def published_points(model, system, base, nodes) -> dict:
    """mode -> [(nodes, efficiency)] published for this case: the SMNG-P2 paper's 175B protocol
    (TP 8, PP 16, micro-batch 3, ZeRO-1, full recomputation, 16 nodes as the base)."""
    protocol = SMNG_SCALING_BASE
    same = (model.name == "gpt3-175b" and system.name == "smng-p2" and nodes and nodes[0] == SMNG_SCALING_NODES[0]
            and all(getattr(base, k) == getattr(protocol, k) for k in ("tp", "pp", "mbs", "zero", "recompute", "tp_mode",
                                                                       "schedule", "vpp", "sp")))
    if not same:
        return {}
    first, last = SMNG_SCALING_NODES[0], SMNG_SCALING_NODES[-1]
    return {mode: [(first, 1.0), (last, eff)] for mode, eff in SMNG_PUBLISHED_EFFICIENCY.items()}


def compute(model, system, base, nodes, modes=("weak", "strong"), strong_gbs: int | None = None,
            dtype: str = "bf16") -> tuple:
    """(mode -> [ScalePoint], mode -> why it could not be computed)."""
    points, problems = {}, {}
    for mode in modes:
        plan = base.replace(gbs=strong_gbs) if mode == "strong" and strong_gbs else base
        try:
            points[mode] = scale(model, system, plan, list(nodes), weak=(mode == "weak"), dtype=dtype)
        except PerfsimError as exc:
            why = str(exc)
            problems[mode] = why[len(f"{mode} scaling: "):] if why.startswith(f"{mode} scaling: ") else why
    if not points:
        raise PerfsimError("; ".join(f"{mode} scaling: {why}" for mode, why in problems.items()))
    return points, problems


def figure(model, system, base, nodes, modes=("weak", "strong"), strong_gbs: int | None = None,
           dtype: str = "bf16", samples: int | None = None) -> go.Figure:
    """Efficiency against nodes for `base` (a Plan on nodes[0] nodes), both modes by default;
    with `samples`, each curve in its P10-P90 band over that many draws of the profile's ranges."""
    if not nodes or any(n < 1 for n in nodes):
        raise PerfsimError("scaling needs a list of positive node counts, e.g. 16,32,64,128")
    points, problems = compute(model, system, base, nodes, modes, strong_gbs, dtype)
    spreads, unexplained = {}, ""
    if samples:
        from perfsim.charts.robustness import draws_of
        from perfsim.uncertainty.scaling import scaling_spreads

        draws, unexplained = draws_of(system, samples)
        studies = [(series, mode == "weak") for mode, series in points.items()]
        spreads = dict(zip(points, scaling_spreads(model, draws, studies, dtype)))
    published = published_points(model, system, base, list(nodes))
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.1,
                        subplot_titles=("scaling efficiency against the first point",
                                        "efficiency lost, by cause (percentage points)"))
    fig.add_trace(go.Scatter(x=[nodes[0], nodes[-1]], y=[100, 100], mode="lines", name="ideal (100%)",
                             line={"color": "#999999", "dash": "dash"}, hoverinfo="skip"), row=1, col=1)
    for mode, series in points.items():
        if mode in spreads:
            _add_band(fig, mode, series, spreads[mode])
        hover = []
        for p in series:
            pr = p.prediction
            worst = sorted(p.loss_points.items(), key=lambda kv: -kv[1])[:2]
            lost = ", ".join(f"{TERM_LABELS[k]} {v:+.1f} points" for k, v in worst if abs(v) >= 0.05) or "nothing"
            hover.append(f"<b>{mode} scaling, {p.nodes} nodes ({pr.devices:,} devices)</b><br>efficiency "
                         f"{p.efficiency:.1%}<br>global batch {pr.plan.gbs:,}, step {pr.step_time_s:.2f} s, "
                         f"{pr.tokens_per_s:,.0f} tokens/s<br>largest losses: {lost}"
                         + ("" if pr.fits else "<br><b>does not fit in device memory</b>"))
        fig.add_trace(go.Scatter(x=[p.nodes for p in series], y=[100 * p.efficiency for p in series],
                                 mode="lines+markers", name=f"{mode} scaling, perfsim", hovertext=hover, hoverinfo="text",
                                 line={"color": MODE_COLOURS[mode], "width": 3}, marker={"size": 9}), row=1, col=1)
        for term in TERM_LABELS:
            values = [p.loss_points[term] for p in series[1:]]
            if all(abs(v) < 0.05 for v in values):
                continue
            fig.add_trace(go.Bar(x=[f"{mode} {p.nodes}" for p in series[1:]], y=values, name=TERM_LABELS[term],
                                 marker_color=TERM_COLOURS[term], legendgroup=term, showlegend=TERM_LABELS[term] not in _shown(fig),
                                 hovertemplate="%{x} nodes: %{y:+.2f} points<extra>" + TERM_LABELS[term] + "</extra>"),
                          row=1, col=2)
    for mode, pts in published.items():
        if mode in points:
            fig.add_trace(go.Scatter(x=[n for n, _ in pts], y=[100 * e for _, e in pts], mode="markers",
                                     name=f"{mode} scaling, published (SMNG-P2 paper)",
                                     marker={"symbol": "diamond-open", "size": 15, "color": MODE_COLOURS[mode],
                                             "line": {"width": 3}},
                                     hovertemplate="published " + mode + ": %{y:.0f}% at %{x} nodes<extra></extra>"),
                          row=1, col=1)
    fig.update_xaxes(type="log", tickvals=list(nodes), ticktext=[str(n) for n in nodes],
                     title_text="nodes (log scale)", row=1, col=1)
    fig.update_yaxes(title_text="scaling efficiency (%)", row=1, col=1,
                     range=[min(50, min(100 * p.efficiency for s in points.values() for p in s) - 5,
                                min((100 * u["efficiency"]["p10"] for s in spreads.values() for u in s), default=100) - 5),
                            105])
    fig.update_xaxes(title_text="scaling mode and nodes", row=1, col=2)
    fig.update_yaxes(title_text="efficiency lost (percentage points)", row=1, col=2)
    notes = [f"{model.name} on {system.name}, starting from {nodes[0]} nodes with {plan_summary(base)}.",
             "Weak: data parallelism and the global batch grow with the nodes (micro-batches per pipeline kept); "
             "strong: the global batch stays fixed" + (f" at {points['strong'][0].prediction.plan.gbs:,}" if "strong"
                                                       in points else "") + "."]
    if published:
        notes.append("Diamonds: the SMNG-P2 paper's published 93% weak and 82% strong efficiency at 128 nodes "
                     "(16 nodes = 100%).")
    else:
        notes.append("No published points for this case (they exist for the SMNG-P2 175B protocol only).")
    notes += [f"No {mode} scaling: {why}." for mode, why in problems.items()]
    if spreads:
        first = next(iter(spreads.values()))[0]
        what = "the posterior conditioned on the profile's observations" if system.observations else "the profile's ranges"
        notes.append(f"Shaded: P10 to P90 of the efficiency over {first['samples']} draws of {what}, the same draws at "
                     "every node count (each draw against its own first point)." + (f" {unexplained}" if unexplained else ""))
    fig.update_layout(title=title("How well does training scale with more nodes?", " ".join(notes), 150),
                      barmode="relative", legend={"x": 1.02, "y": 1})
    style(fig, height=620)
    fig.update_layout(margin={"t": 150, "r": 300})
    return fig


def _add_band(fig, mode: str, series, spread) -> None:
    """The P10-P90 band of one mode's efficiency: a lower edge, then an upper edge filled down to it."""
    x = [p.nodes for p in series]
    hover = [f"<b>{mode} scaling, {p.nodes} nodes, over {u['samples']} draws</b><br>efficiency P10 "
             f"{u['efficiency']['p10']:.1%} .. P50 {u['efficiency']['p50']:.1%} .. P90 {u['efficiency']['p90']:.1%}"
             f"<br>step time {u['step_time_s']['p10']:.2f} .. {u['step_time_s']['p50']:.2f} .. "
             f"{u['step_time_s']['p90']:.2f} s" for p, u in zip(series, spread)]
    edge = {"color": MODE_COLOURS[mode], "width": 0}
    fig.add_trace(go.Scatter(x=x, y=[100 * u["efficiency"]["p10"] for u in spread], mode="lines", line=edge,
                             showlegend=False, legendgroup=f"band-{mode}", hoverinfo="skip"), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=[100 * u["efficiency"]["p90"] for u in spread], mode="lines", line=edge,
                             fill="tonexty", fillcolor=BAND_COLOURS[mode], name=f"{mode} scaling, P10-P90 over the draws",
                             legendgroup=f"band-{mode}", hovertext=hover, hoverinfo="text"), row=1, col=1)


def _shown(fig) -> set:
    return {t.name for t in fig.data if isinstance(t, go.Bar)}


def smng_figure(system=None) -> go.Figure:
    """The SMNG-P2 authors' protocol (perfsim.reproduce): 175B, 16 to 128 nodes, weak and strong."""
    from perfsim.spec.model import load_model
    from perfsim.spec.system import load_system

    return figure(load_model("gpt3-175b"), system or load_system("smng-p2"), SMNG_SCALING_BASE, list(SMNG_SCALING_NODES),
                  strong_gbs=SMNG_STRONG_GBS)
