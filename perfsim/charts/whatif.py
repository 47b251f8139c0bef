"""What if the hardware were different: the best plan's throughput and time breakdown as one
hardware multiplier moves (device FLOP/s, HBM bandwidth, intra-node and inter-node bandwidth,
link latency, memory capacity).

Precomputed, so the page needs no server: the search runs once on the profile as it is, and keeps
the plans that can be best elsewhere (space.PlanPool: the fastest that fit, the fastest of all,
the throughput-memory Pareto front). Each slider value scales the profile (dataclasses.replace),
re-evaluates the kept plans in one vectorised call per tensor-parallel mode and rank order, and
takes the fastest that fits. A plan outside the pool cannot win, so far from 1x the best shown is
a lower bound on the true best; the page says so.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from perfsim.charts._common import GIB, TERM_COLOURS, TERM_LABELS, case_line, style, title
from perfsim.charts.space import best_index, evaluate_pool, fastest_fitting, pick, plan_pool
from perfsim.errors import PerfsimError
from perfsim.spec.plan import plan_summary
from perfsim.spec.system import System

MULTIPLIERS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)

# knob -> (what the slider says, what it scales)
KNOBS = {
    "flops": "device FLOP/s (all precisions)",
    "hbm": "device memory (HBM) bandwidth",
    "intra": "intra-node bandwidth (card and node links)",
    "inter": "inter-node bandwidth (network)",
    "latency": "link latency (card, node and network)",
    "memory": "device memory capacity",
}
KNOB_COLOURS = {"flops": "#4c78a8", "hbm": "#72b7b2", "intra": "#f58518", "inter": "#e45756", "latency": "#9d755d",
                "memory": "#b279a2"}


def scaled_system(system: System, flops: float = 1.0, hbm: float = 1.0, intra: float = 1.0, inter: float = 1.0,
                  latency: float = 1.0, memory: float = 1.0) -> System:
    """`system` with its hardware scaled: each argument multiplies the numbers its knob names."""
    for name, value in (("flops", flops), ("hbm", hbm), ("intra", intra), ("inter", inter), ("latency", latency),
                        ("memory", memory)):
        if not value > 0:
            raise PerfsimError(f"{name} multiplier must be positive, got {value!r}")
    d, n, w = system.device, system.node, system.network
    device = dataclasses.replace(d, peak_flops_bf16=d.peak_flops_bf16 * flops, peak_flops_fp16=d.peak_flops_fp16 * flops,
                                 peak_flops_fp32=d.peak_flops_fp32 * flops, memory_bandwidth_Bps=d.memory_bandwidth_Bps * hbm,
                                 memory_bytes=d.memory_bytes * memory)
    node = dataclasses.replace(n, card_link_bandwidth_Bps=n.card_link_bandwidth_Bps * intra,
                               node_link_bandwidth_Bps=n.node_link_bandwidth_Bps * intra,
                               card_link_latency_s=n.card_link_latency_s * latency,
                               node_link_latency_s=n.node_link_latency_s * latency)
    network = dataclasses.replace(w, nic_bandwidth_Bps=w.nic_bandwidth_Bps * inter, latency_s=w.latency_s * latency)
    return dataclasses.replace(system, device=device, node=node, network=network)


@dataclasses.dataclass
class WhatIf:
    """The precomputed scenarios: best[knob][j] is the best plan (space.Best, or None when no kept
    plan fits) with that knob at MULTIPLIERS[j] and every other at 1x; baseline[knob][j] is the
    1x best plan on that hardware."""
    multipliers: tuple
    best: dict
    baseline: dict
    pool_size: int
    counts: dict
    keep: int
    leaders: tuple = ()  # the fastest plans that fit at 1x, fastest first: the candidates of P(best)


def precompute(model, system, devices: int, gbs: int, fixes: dict | None = None, dtype: str = "bf16",
               keep: int = 1000, multipliers=MULTIPLIERS, knobs=tuple(KNOBS), pooled: tuple | None = None,
               prune: bool = True) -> WhatIf:
    """The scenarios. `pooled`: (groups, counts) of a PlanPool filled by a sweep already run (the
    report shares one sweep between charts); by default the sweep runs here. `prune`: skip the
    groups of plans that cannot be fastest (see _scenarios); False evaluates every kept plan."""
    if 1.0 not in multipliers:
        raise PerfsimError("the multipliers must include 1 (the profile as it is)")
    if keep < 1:
        raise PerfsimError(f"keep must be at least 1, got {keep}")
    groups, counts = pooled or plan_pool(model, system, devices, gbs, fixes, dtype, keep)
    results = evaluate_pool(model, system, groups, dtype)
    home = best_index(results)
    if home is None:
        raise PerfsimError(f"no plan fits in device memory for {devices} devices and global batch {gbs}; "
                           "use more devices or a smaller --gbs")
    one = pick(groups, results, *home)
    capacity = system.device.memory_bytes
    # Only device memory decides what fits, and it changes no time: for every other knob the
    # plans that do not fit at 1x cannot win (the `keep` fastest that fit are evaluated again), and
    # for memory nothing needs evaluating again (the whole pool, Pareto front included, is ranked).
    fit_groups = fastest_fitting(groups, results, keep)
    fit_results = evaluate_pool(model, system, fit_groups, dtype)
    fit_home = best_index(fit_results)
    fastest = [float(np.min(np.asarray(r["step_time_s"], float))) for r in fit_results]
    best = {k: [] for k in knobs}
    baseline = {k: [] for k in knobs}
    for knob in knobs:
        moved = [m for m in multipliers if m != 1.0]
        if knob != "memory":
            scenarios = _scenarios(model, system, fit_groups, fastest, fit_home[0], knob, moved, dtype, prune)
        for m in multipliers:
            if m == 1.0:
                best[knob].append(one)
                baseline[knob].append(one)
            elif knob == "memory":
                where = best_index(results, capacity * m)
                best[knob].append(None if where is None else pick(groups, results, *where))
                baseline[knob].append(one if one.memory_bytes <= capacity * m else None)
            else:
                r = scenarios[m]
                where = best_index(r)
                best[knob].append(None if where is None else pick(fit_groups, r, *where))
                baseline[knob].append(pick(fit_groups, r, *fit_home))
    pool_size = sum(len(cols["tp"]) for _, _, cols in groups)
    return WhatIf(tuple(multipliers), best, baseline, pool_size, counts, keep, _leaders(fit_groups, fit_results))


def _leaders(groups: list, results: list) -> tuple:
    """The robust.CANDIDATES fastest plans that fit, fastest first: the page ranks these over the draws
    (perfsim search --robust ranks the whole space, so its P(best) may differ)."""
    from perfsim.uncertainty.robust import CANDIDATES

    found = []
    for g, (_, _, cols) in enumerate(groups):
        step = np.broadcast_to(np.asarray(results[g]["step_time_s"], float), np.shape(cols["tp"]))
        fits = np.broadcast_to(np.asarray(results[g]["fits"], bool), step.shape)
        found += [(float(step[i]), g, int(i)) for i in np.flatnonzero(fits)]
    return tuple(pick(groups, results, g, i).plan for _, g, i in sorted(found)[:CANDIDATES])


# Knobs that change only the device's numbers: every cost function takes them as numbers in
# broadcasting arithmetic, so all their settings evaluate in one call, one row per plan and
# setting (the link numbers key the topology model's caches and must stay plain numbers).
DEVICE_KNOBS = {"flops": ("peak_flops_bf16", "peak_flops_fp16", "peak_flops_fp32"), "hbm": ("memory_bandwidth_Bps",)}


def gain(knob: str, m: float) -> float:
    """How much faster the hardware gets: m for bandwidths and FLOP/s, 1/m for latency."""
    return 1.0 / m if knob == "latency" else m


def _scenarios(model, system: System, groups: list, fastest: list, home: int, knob: str, moved: list, dtype: str,
               prune: bool = True) -> dict:
    """multiplier -> results per group (None where a group was skipped) with `knob` at that
    multiplier.

    Skipping: every time in the model is a sum, maximum or minimum of terms that are either fixed
    or inversely proportional to one bandwidth or FLOP rate (or proportional to a latency), so
    hardware g times faster makes no step time longer and none shorter than 1/g of what it was,
    and slower hardware makes none shorter. A group whose fastest plan at 1x, divided by the gain
    (when above 1), is already slower than the best found on the new hardware cannot hold the
    best; groups go fastest first, the one holding the 1x best first of all, so once one is
    skipped for every multiplier all later ones are. tests/test_charts.py checks skipping changes
    nothing."""
    from perfsim.charts.space import to_columns
    from perfsim.predict import evaluate

    order = [home] + sorted((g for g in range(len(groups)) if g != home), key=lambda g: fastest[g])
    out = {m: [None] * len(groups) for m in moved}
    best = {m: np.inf for m in moved}
    for g in order:
        need = [m for m in moved if g == home or not prune or fastest[g] / max(gain(knob, m), 1.0) < best[m]]
        if not need:
            break
        if knob in DEVICE_KNOBS:
            found = dict(zip(need, (r[0] for r in evaluate_device_knob(model, system, [groups[g]], knob, need, dtype))))
        else:
            found = {m: evaluate(model, scaled_system(system, **{knob: m}), to_columns(*groups[g]), dtype) for m in need}
        for m, r in found.items():
            out[m][g] = r
            step = np.broadcast_to(np.asarray(r["step_time_s"], float), np.shape(groups[g][2]["tp"]))
            fits = np.broadcast_to(np.asarray(r["fits"], bool), step.shape)
            if fits.any():
                best[m] = min(best[m], float(step[fits].min()))
    return out


def _slice(r, n: int, total: int, k: int):
    if isinstance(r, dict):
        return {key: _slice(v, n, total, k) for key, v in r.items()}
    return np.broadcast_to(np.asarray(r), (total,))[k * n:(k + 1) * n]


def evaluate_device_knob(model, system: System, groups: list, knob: str, moved: list, dtype: str) -> list:
    """evaluate_pool on the system with `knob` at each multiplier of `moved`, in one vectorised
    evaluation per group: the plans repeated once per multiplier, the device's numbers arrays."""
    from perfsim.predict import evaluate
    from perfsim.charts.space import to_columns

    out = [[] for _ in moved]
    for mode, order, cols in groups:
        n, K = len(cols["tp"]), len(moved)
        factor = np.repeat(np.asarray(moved, float), n)
        device = dataclasses.replace(system.device, **{f: getattr(system.device, f) * factor for f in DEVICE_KNOBS[knob]})
        r = evaluate(model, dataclasses.replace(system, device=device),
                     to_columns(mode, order, {k: np.tile(v, K) for k, v in cols.items()}), dtype)
        for k in range(K):
            out[k].append(_slice(r, n, n * K, k))
    return out


def _text(knob: str, m: float, b, one, capacity: float, sure: str = "") -> str:
    """The plan box; `sure` (how sure the 1x best plan is) is added at 1x."""
    setting = "the profile as it is (every multiplier 1x)" if m == 1.0 else f"{KNOBS[knob]} x{m:g}, the rest 1x"
    if b is None:
        return f"<b>{setting}</b><br>no kept plan fits in device memory"
    change = b.tokens_per_s / one.tokens_per_s - 1
    return (f"<b>{setting}</b><br>best plan: {plan_summary(b.plan)}<br>"
            f"<b>{b.tokens_per_s:,.0f} tokens/s</b> ({change:+.1%} against 1x), step {b.step_time_s:.2f} s, "
            f"MFU {b.mfu:.1%}, memory {b.memory_bytes / GIB:.1f} of {capacity / GIB:.1f} GiB"
            + (f"<br>{sure}" if sure and m == 1.0 else ""))


def _how_sure(model, system, w: WhatIf, one, dtype: str, samples: int | None, robust_samples: int | None) -> tuple:
    """(the 1x best plan's spread, or None, and the plan box's lines on its spread and P(best))."""
    from perfsim.charts import robustness

    if not (samples or robust_samples):
        return None, ""
    lines, spread = [], None
    if samples:
        spreads, _, _ = robustness.plan_spreads(model, system, [one.plan], samples, dtype)
        spread = spreads[0]
        lines.append(f"over {spread['samples']} draws of {robustness.drawn_from(system)}: step "
                     f"{robustness.span(spread['step_time_s'], lambda v: f'{v:.2f} s')}")
    if robust_samples:
        from perfsim.predict import predict

        ranked, _ = robustness.ranked_plans(model, system, [predict(model, system, p, dtype) for p in (one.plan, *w.leaders)],
                                            robust_samples, dtype)
        among = f"the {len(ranked)} fastest plans at 1x"
        lines.append(f"over {robust_samples} draws it is {robustness.odds_text(robustness.find(ranked, one.plan), among)}")
    return spread, "<br>".join(lines)


def figure(model, system, devices: int, gbs: int, fixes: dict | None = None, dtype: str = "bf16",
           keep: int = 1000, multipliers=MULTIPLIERS, data: WhatIf | None = None, samples: int | None = None,
           robust_samples: int | None = None) -> go.Figure:
    """The what-if page: sensitivity lines, the best plan's breakdown, one slider per knob. With
    `samples`, the 1x best plan's throughput P10-P90 over that many draws of the profile's ranges;
    with `robust_samples`, its P(best) among the fastest plans at 1x over that many draws."""
    w = data or precompute(model, system, devices, gbs, fixes, dtype, keep, multipliers)
    knobs = list(w.best)
    mults = list(w.multipliers)
    home = mults.index(1.0)
    one = w.best[knobs[0]][home]
    spread, sure = _how_sure(model, system, w, one, dtype, samples, robust_samples)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.5, 0.5], horizontal_spacing=0.1,
                        subplot_titles=("best throughput with one multiplier moved",
                                        "where the step time goes (exposed seconds)"))
    for knob in knobs:
        ys = [b.tokens_per_s if b else None for b in w.best[knob]]
        hover = [f"{KNOBS[knob]} x{m:g}<br>" + (f"{b.tokens_per_s:,.0f} tokens/s<br>{plan_summary(b.plan)}" if b
                                                else "no kept plan fits") for m, b in zip(mults, w.best[knob])]
        fig.add_trace(go.Scatter(x=mults, y=ys, mode="lines+markers", name=KNOBS[knob], legendgroup="knobs",
                                 legendgrouptitle_text="multiplier moved", line={"color": KNOB_COLOURS[knob]},
                                 hovertext=hover, hoverinfo="text"), row=1, col=1)
    if spread:
        q = spread["tokens_per_s"]
        fig.add_trace(go.Scatter(
            x=[1.0], y=[q["p50"]], mode="markers", name=f"1x best plan: P10-P90 over {spread['samples']} draws",
            marker={"symbol": "line-ew-open", "size": 14, "color": "black"},
            error_y={"type": "data", "symmetric": False, "array": [q["p90"] - q["p50"]], "arrayminus": [q["p50"] - q["p10"]],
                     "color": "black", "thickness": 2, "width": 8},
            hovertext=[f"1x best plan over {spread['samples']} draws:<br>tokens/s P10 {q['p10']:,.0f} .. P50 {q['p50']:,.0f} "
                       f".. P90 {q['p90']:,.0f}"], hoverinfo="text"), row=1, col=1)
    marker = len(fig.data)
    fig.add_trace(go.Scatter(x=[1.0], y=[one.tokens_per_s], mode="markers", name="current setting",
                             marker={"size": 16, "color": "rgba(0,0,0,0)", "line": {"width": 3, "color": "black"}},
                             hoverinfo="skip"), row=1, col=1)
    rows = ["best plan at this setting", "1x best plan on this hardware"]
    first_term = len(fig.data)
    for term, label in TERM_LABELS.items():
        fig.add_trace(go.Bar(y=rows, x=[one.breakdown_s[term], one.breakdown_s[term]], orientation="h", name=label,
                             legendgroup="terms", legendgrouptitle_text="step time by cause",
                             marker_color=TERM_COLOURS[term], hovertemplate="%{x:.3f} s<extra>" + label + "</extra>"),
                      row=1, col=2)
    term_traces = list(range(first_term, len(fig.data)))
    capacity = system.device.memory_bytes
    note = len(fig.layout.annotations)
    fig.add_annotation(text=_text(knobs[0], 1.0, one, one, capacity, sure), xref="paper", yref="paper", x=0.0, y=1.06,
                       xanchor="left", yanchor="bottom", showarrow=False, align="left",
                       bgcolor="#f4f4f4", bordercolor="#cccccc", borderpad=6)

    sliders = []
    for s, knob in enumerate(knobs):
        steps = []
        for j, m in enumerate(mults):
            b, base = w.best[knob][j], w.baseline[knob][j]
            xs = [[b.breakdown_s[t] if b else 0.0, base.breakdown_s[t] if base else 0.0] for t in TERM_LABELS]
            layout = {f"annotations[{note}].text": _text(knob, m, b, one, capacity * (m if knob == "memory" else 1.0),
                                                         sure)}
            layout.update({f"sliders[{o}].active": home for o in range(len(knobs)) if o != s})
            steps.append({"label": f"{m:g}x", "method": "update",
                          "args": [{"x": [[m]] + xs, "y": [[b.tokens_per_s if b else None]] + [rows] * len(xs)},
                                   layout, [marker] + term_traces]})
        sliders.append({"active": home, "steps": steps, "x": 0.0, "len": 0.46, "xanchor": "left",
                        "y": -0.18 - 0.2 * (s // 2), "yanchor": "top", "pad": {"t": 30, "b": 0},
                        "currentvalue": {"prefix": KNOBS[knob] + ": ", "font": {"size": 13}}})
        sliders[-1]["x"] = 0.0 if s % 2 == 0 else 0.54
    fig.update_layout(sliders=sliders, barmode="stack")
    fig.update_xaxes(type="log", title_text="multiplier on the profile's value (1 = as profiled; latency: lower is faster)",
                     tickvals=mults, ticktext=[f"{m:g}x" for m in mults], row=1, col=1)
    fig.update_yaxes(title_text="best throughput (tokens/s)", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title_text="exposed time per training step (s)", row=1, col=2)
    fig.update_yaxes(autorange="reversed", row=1, col=2)
    subtitle = (f"{case_line(model, system, devices, gbs)}. Precomputed, no server needed: the search ran once "
                f"at 1x over {w.counts['evaluated']:,} valid plans and kept {w.pool_size:,}: the {w.keep:,} fastest that "
                f"fit, the {w.keep:,} fastest of all and the throughput-memory Pareto front. The memory slider ranks "
                f"all of them against the new capacity; the other sliders re-evaluate the {w.keep:,} fastest that fit "
                "on the scaled hardware (memory alone decides what fits) and show the fastest. A plan outside these "
                "cannot win, so far from 1x the true best may be a little faster. One multiplier moves at a time; "
                "moving one puts the others back to 1x.")
    fig.update_layout(title=title("What if the hardware were different?", subtitle, 150), legend={"x": 1.02, "y": 1,
                      "traceorder": "grouped"})
    style(fig, height=950)
    fig.update_layout(margin={"t": 260, "b": 300, "r": 330})
    return fig
