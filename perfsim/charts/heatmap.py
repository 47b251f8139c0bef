"""Best throughput over two knobs (tp x pp by default): each cell is the fastest plan that fits
among every plan with those two values, the other knobs searched; a cell with no such plan
says why on hover (no valid plan, and the commonest reasons; or none fits in memory, and how
much the smallest needs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import plotly.graph_objects as go

from perfsim.charts._common import GIB, case_line, style, title
from perfsim.charts.space import sweep
from perfsim.errors import PerfsimError
from perfsim.search import TEXT_KNOBS, Batch, ModeCandidates, plan_at
from perfsim.spec.plan import RECOMPUTE, SCHEDULES, TP_MODES, plan_summary

KNOB_TITLES = {
    "tp": "tensor-parallel size (tp)", "pp": "pipeline stages (pp)", "dp": "data-parallel size (dp)",
    "mbs": "micro-batch size (sequences)", "vpp": "interleaved chunks per device (vpp)", "zero": "ZeRO stage",
    "recompute": "activation recomputation", "schedule": "pipeline schedule", "tp_mode": "tensor-parallel mode",
    "sp": "sequence parallelism", "tp_depth": "2.5d depth", "order": "rank order (innermost first)",
    "cp": "context-parallel size (cp)",
}
KNOBS = tuple(KNOB_TITLES)
_COLUMN = {"tp": "tp", "pp": "pp", "dp": "dp", "mbs": "mbs", "vpp": "vpp", "zero": "zero", "recompute": "recompute",
           "schedule": "schedule", "sp": "sp", "tp_depth": "tp_depth", "cp": "cp"}
ORDERS = TEXT_KNOBS["order"]


def value_label(knob: str, code) -> str:
    code = int(code)
    if knob == "recompute":
        return RECOMPUTE[code]
    if knob == "schedule":
        return SCHEDULES[code]
    if knob == "tp_mode":
        return TP_MODES[code]
    if knob == "order":
        return ORDERS[code]
    if knob == "sp":
        return "on" if code else "off"
    if knob == "zero":
        return f"ZeRO-{code}"
    return str(code)


def _codes(knob: str, mode: str, order: str | None, cols: dict) -> np.ndarray:
    n = len(cols["tp"])
    if knob == "tp_mode":
        return np.full(n, TP_MODES.index(mode), dtype=np.int64)
    if knob == "order":
        return np.full(n, ORDERS.index(order), dtype=np.int64)
    return np.asarray(cols[_COLUMN[knob]]).astype(np.int64)


@dataclass
class Cell:
    candidates: int = 0
    valid: int = 0
    fit: int = 0
    rejected: dict = field(default_factory=dict)
    min_memory: float = np.inf
    best: tuple | None = None  # (tokens/s, plan, mfu, step time, memory bytes)


class Grid:
    """Consumer of space.sweep: per (x value, y value) cell, the counts and the best plan."""

    def __init__(self, x: str, y: str):
        for knob in (x, y):
            if knob not in KNOBS:
                raise PerfsimError(f"unknown heatmap knob {knob!r}; choose from {', '.join(KNOBS)}")
        if x == y:
            raise PerfsimError(f"the heatmap needs two different knobs, got {x} twice")
        self.x, self.y = x, y
        self.cells: dict = {}

    def _cell(self, key) -> Cell:
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = Cell()
        return cell

    def _groups(self, mode, order, cols):
        """(unique (x, y) pairs, each row's pair index)."""
        pairs = np.stack([_codes(self.x, mode, order, cols), _codes(self.y, mode, order, cols)], axis=1)
        return np.unique(pairs, axis=0, return_inverse=True)

    def add(self, event) -> None:
        if isinstance(event, ModeCandidates):
            # a row counts once per rank order it is a candidate for: in that order's cell when
            # order is an axis, else as many times in its cell
            if "order" in (self.x, self.y):
                parts = [(order, rows, rows.astype(int)) for order, rows in event.order_rows.items()]
            else:
                times = sum(rows.astype(int) for rows in event.order_rows.values())
                parts = [(None, times > 0, times)]
            for order, rows, times in parts:
                if not rows.any():
                    continue
                pairs, inverse = self._groups(event.mode, order, {k: v[rows] for k, v in event.cols.items()})
                inverse, times = inverse.reshape(-1), times[rows]
                total = np.bincount(inverse, weights=times, minlength=len(pairs))
                for j, pair in enumerate(pairs):
                    self._cell(tuple(pair)).candidates += int(total[j])
                for reason, mask in event.rejections():
                    counts = np.bincount(inverse[mask[rows]], weights=times[mask[rows]], minlength=len(pairs))
                    for j in np.flatnonzero(counts):
                        rejected = self._cell(tuple(pairs[j])).rejected
                        rejected[reason] = rejected.get(reason, 0) + int(counts[j])
            return
        if not isinstance(event, Batch):
            return
        r = event.result
        n = len(event.cols["tp"])
        speed = np.broadcast_to(np.asarray(r["tokens_per_s"], float), (n,))
        fits = np.broadcast_to(np.asarray(r["fits"], bool), (n,))
        memory = np.broadcast_to(np.asarray(r["memory_bytes"]["total"], float), (n,))
        pairs, inverse = self._groups(event.mode, event.order, event.cols)
        inverse = inverse.reshape(-1)
        valid = np.bincount(inverse, minlength=len(pairs))
        fit = np.bincount(inverse, weights=fits, minlength=len(pairs))
        smallest = np.full(len(pairs), np.inf)
        np.minimum.at(smallest, inverse, memory)
        score = np.where(fits, speed, -np.inf)
        order = np.lexsort((-score, inverse))
        firsts = order[np.r_[True, inverse[order][1:] != inverse[order][:-1]]]
        for i in firsts:
            j = inverse[i]
            cell = self._cell(tuple(pairs[j]))
            cell.valid += int(valid[j])
            cell.fit += int(fit[j])
            cell.min_memory = min(cell.min_memory, float(smallest[j]))
            if fits[i] and (cell.best is None or speed[i] > cell.best[0]):
                pick = lambda k: float(np.broadcast_to(np.asarray(k, float), (n,))[i])  # noqa: E731
                cell.best = (float(speed[i]), plan_at(event.mode, event.order, event.cols, int(i)), pick(r["mfu"]),
                             pick(r["step_time_s"]), float(memory[i]))


def _no_candidate(x, y, a, b, devices) -> str:
    if {x, y} == {"tp", "pp"}:
        tp, pp = (a, b) if x == "tp" else (b, a)
        if devices % (tp * pp):
            return f"no plan: tp x pp = {tp * pp} does not divide the {devices} devices"
    return f"no candidate plan has {x} {value_label(x, a)} and {y} {value_label(y, b)} (device count, batch or --fix)"


def _hover(cell: Cell, capacity: float) -> str:
    if cell.best is not None:
        speed, plan, mfu, step, memory = cell.best
        return (f"<b>{speed:,.0f} tokens/s</b>, step {step:.2f} s, MFU {mfu:.1%}<br>memory {memory / GIB:.1f} of "
                f"{capacity / GIB:.1f} GiB<br>{plan_summary(plan)}<br>{cell.fit:,} of {cell.valid:,} valid plans fit")
    if cell.valid:
        return (f"<b>does not fit</b>: none of the {cell.valid:,} valid plans fits in device memory;<br>the smallest "
                f"needs {cell.min_memory / GIB:.1f} GiB, the device has {capacity / GIB:.1f} GiB")
    reasons = sorted(cell.rejected.items(), key=lambda kv: -kv[1])
    listed = "<br>".join(f"{reason} ({count:,})" for reason, count in reasons[:3])
    return f"<b>no valid plan</b>: all {cell.candidates:,} candidates are invalid:<br>{listed}"


def figure(model, system, devices: int, gbs: int, x: str = "tp", y: str = "pp", fixes: dict | None = None,
           dtype: str = "bf16", grid: Grid | None = None) -> go.Figure:
    """The heatmap of the best throughput over knobs x and y (a precomputed Grid may be passed)."""
    if grid is None:
        grid = Grid(x, y)
        counts = sweep(model, system, devices, gbs, fixes, dtype, [grid])
        if counts["candidates"] == 0:
            raise PerfsimError(f"no candidate plan for {devices} devices and global batch {gbs}; relax --fix")
    x, y = grid.x, grid.y
    xs = sorted({k[0] for k in grid.cells})
    ys = sorted({k[1] for k in grid.cells})
    capacity = system.device.memory_bytes
    z, text, hover, status = [], [], [], []
    best_key, best_speed = None, -1.0
    for b in ys:
        zr, tr, hr, sr = [], [], [], []
        for a in xs:
            cell = grid.cells.get((a, b))
            if cell is None:
                zr.append(None), tr.append(""), hr.append(_no_candidate(x, y, a, b, devices)), sr.append(0.0)
            elif cell.best is not None:
                zr.append(cell.best[0]), tr.append(f"{cell.best[0] / 1e3:,.1f}k"), hr.append(_hover(cell, capacity))
                sr.append(None)
                if cell.best[0] > best_speed:
                    best_key, best_speed = (a, b), cell.best[0]
            else:
                zr.append(None), tr.append("no fit" if cell.valid else "invalid"), hr.append(_hover(cell, capacity))
                sr.append(1.0 if cell.valid else 0.0)
        z.append(zr), text.append(tr), hover.append(hr), status.append(sr)
    xl = [value_label(x, a) for a in xs]
    yl = [value_label(y, b) for b in ys]
    fig = go.Figure()
    # Cells without a plan that fits, under the throughput layer: grey (no valid plan), pink (no fit).
    fig.add_trace(go.Heatmap(x=xl, y=yl, z=status, text=[[h if s is not None else "" for h, s in zip(hr, sr)]
                                                         for hr, sr in zip(hover, status)],
                             hoverinfo="text", colorscale=[[0, "#e5e5e5"], [1, "#f4c7c3"]], zmin=0, zmax=1,
                             showscale=False, xgap=2, ygap=2, name="no plan"))
    fig.add_trace(go.Heatmap(x=xl, y=yl, z=z, text=hover, hoverinfo="text", colorscale="Viridis", xgap=2, ygap=2,
                             colorbar={"title": {"text": "best throughput<br>(tokens/s)"}}, name="best throughput"))
    top = max((v for row in z for v in row if v is not None), default=1.0)
    ink = [("#555" if v is None else ("black" if v > 0.65 * top else "white")) for row in z for v in row]
    fig.add_trace(go.Scatter(x=xl * len(yl), y=[v for v in yl for _ in xl], mode="text",
                             text=[t for row in text for t in row], hoverinfo="skip", showlegend=False,
                             textfont={"size": 11, "color": ink}))
    if best_key is not None:
        fig.add_trace(go.Scatter(x=[value_label(x, best_key[0])], y=[value_label(y, best_key[1])], mode="markers",
                                 marker={"symbol": "square-open", "size": 46, "color": "#ff4136", "line": {"width": 3}},
                                 name=f"best: {best_speed:,.0f} tokens/s", hoverinfo="skip", showlegend=True))
    fig.update_xaxes(type="category", title_text=KNOB_TITLES[x])
    fig.update_yaxes(type="category", title_text=KNOB_TITLES[y])
    subtitle = (f"{case_line(model, system, devices, gbs)}. Each cell: the fastest plan that fits with those two "
                "values, every other knob searched (labels in thousands of tokens/s; hover for the plan). "
                "Grey: no valid plan (hover for the reasons); pink: valid plans exist but none fits in device memory.")
    fig.update_layout(title=title(f"Best throughput by {KNOB_TITLES[x]} and {KNOB_TITLES[y]}", subtitle, 150),
                      legend={"orientation": "h", "x": 0, "y": -0.15}, margin={"t": 130})
    style(fig, height=max(480, 60 * len(yl) + 280))
    fig.update_layout(margin={"t": 140})
    return fig
