"""A simulated step as a picture: a Chrome trace (opens in Perfetto or chrome://tracing) and a
self-contained Plotly Gantt chart (docs/simulator.md, section 5).

Each stage is one process (trace) or a group of rows (chart) with up to five rows: the compute
stream (forward, backward, recomputation, weight gradient, optimizer), its tensor-parallel
collectives, its blocking pipeline sends, data-parallel traffic (the data-parallel stream's
prefetches and gradient buckets, and the weight all-gather after the optimizer), and the ring
attention waits of context parallelism.

Large steps are cut down so that files stay small: the chart first draws one bar per task instead
of one per segment (a pass with its TP collective and its send is one bar, coloured by its main
kind), then both keep a sample of the stages (always the first, the last and the stage the
breakdown is taken from, the rest evenly spread) until they fit their budget; the files say which.
"""

from __future__ import annotations

import json

from perfsim.schedule.simulator import LANE_OF, LANES, SimResult

TRACE_EVENTS = 150_000   # about 15 MB of JSON
CHART_BARS = 25_000      # a browser still pans and zooms such a chart smoothly

KIND_COLOURS = {"compute": "#4c78a8", "recompute": "#9ecae9", "tp_comm": "#f58518", "cp_comm": "#eeca3b",
                "ep_comm": "#ff9da6", "pp_comm": "#54a24b",
                "dp_comm": "#e45756", "optimizer": "#b279a2", "other": "#9d755d", "synchrony": "#72b7b2"}


def _name(label, kind: str | None = None) -> str:
    """Readable task names: F12, B3 c1 (chunk 1), W5, send B3, gather F7, bucket 2 c0, ..."""
    if not label:
        return "?"
    head = label[0]
    if head in ("F", "B", "W") and len(label) == 3:
        name = f"{head}{label[1]}" + (f" c{label[2]}" if label[2] else "")
        if kind == "recompute":
            return f"recompute {name}"
        if kind == "tp_comm":
            return f"tp {name}"
        if kind == "cp_comm":
            return f"ring {name}"
        if kind == "ep_comm":
            return f"all-to-all {name}"
        if kind == "pp_comm":
            return f"send {name}"
        return name
    if head in ("send", "tp", "gather") and len(label) == 4:
        return f"{head} {_name(label[1:])}"
    if head == "bucket":
        return f"bucket {label[1]}" + (f" c{label[2]}" if label[2] else "")
    return " ".join(str(x) for x in label)


def _stage_tasks(result: SimResult, stage: int) -> list:
    return result.main[stage] + result.side[stage]


def _segments(result: SimResult, t: int):
    """(kind, start, end) of each non-empty segment of task t, the last stretched to its end."""
    stage, segments, label = result.meta[t]
    s, e = result.start[t], result.end[t]
    out, clock = [], s
    for n, (kind, d) in enumerate(segments):
        z = e if n == len(segments) - 1 else clock + d
        if z > clock:
            out.append((kind, clock, z))
        clock = z
    return out


def shown_stages(result: SimResult, cost_per_stage: list, budget: int) -> list:
    """Stages to draw so that their cost stays within budget: all if they fit, else the first,
    the last, the breakdown's stage, and evenly spread others."""
    p = result.p
    if sum(cost_per_stage) <= budget:
        return list(range(p))
    keep = sorted({0, p - 1, result.breakdown_stage})
    per = max(cost_per_stage) or 1
    room = max(budget // per, len(keep))
    extra = room - len(keep)
    if extra > 0:
        step = p / (extra + 1)
        keep = sorted(set(keep) | {min(p - 1, round(step * (n + 1))) for n in range(extra)})
    return keep


def _sample_note(result: SimResult, stages: list) -> str:
    if len(stages) == result.p:
        return ""
    return (f"showing {len(stages)} of {result.p} stages ({', '.join(str(s) for s in stages)}) "
            f"to keep the file small")


def chrome_trace(result: SimResult, max_events: int = TRACE_EVENTS) -> dict:
    """The Trace Event Format object (complete events, ph "X", microseconds)."""
    costs = [sum(len(result.meta[t][1]) for t in _stage_tasks(result, i)) for i in range(result.p)]
    stages = shown_stages(result, costs, max_events)
    events = []
    for i in stages:
        events.append({"name": "process_name", "ph": "M", "pid": i, "args": {"name": f"stage {i}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": i, "args": {"sort_index": i}})
        for lane, name in enumerate(LANES):
            events.append({"name": "thread_name", "ph": "M", "pid": i, "tid": lane, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": i, "tid": lane, "args": {"sort_index": lane}})
        for t in _stage_tasks(result, i):
            label = result.meta[t][2]
            for kind, s, e in _segments(result, t):
                ts = round(s * 1e6, 3)  # round both ends, so that abutting segments still abut
                events.append({"name": _name(label, kind), "cat": kind, "ph": "X", "pid": i,
                               "tid": LANE_OF[kind], "ts": ts, "dur": round(round(e * 1e6, 3) - ts, 3)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"step_time_s": result.step_time_s, "schedule": result.schedule,
                          "note": _sample_note(result, stages) or "every stage shown"}}


def write_trace(result: SimResult, path: str, max_events: int = TRACE_EVENTS) -> str:
    """Write the Chrome trace; returns a note on sampling ("" when every stage is shown)."""
    from perfsim.files import write_output

    trace = chrome_trace(result, max_events)
    write_output(path, "--trace", json.dumps(trace, separators=(",", ":")), example="step.json")
    note = trace["otherData"]["note"]
    return "" if note == "every stage shown" else note


def _bars(result: SimResult, stage: int, coarse: bool):
    """(kind, row lane, start, end, name) per bar of one stage."""
    for t in _stage_tasks(result, stage):
        label = result.meta[t][2]
        segments = _segments(result, t)
        if not segments:
            continue
        if coarse and len(segments) > 1:
            lengths: dict = {}
            for kind, s, e in segments:
                lengths[kind] = lengths.get(kind, 0.0) + (e - s)
            kind = max(lengths, key=lengths.get)
            yield kind, LANE_OF[segments[0][0]], segments[0][1], segments[-1][2], _name(label) + " (with TP, send)"
        else:
            for kind, s, e in segments:
                yield kind, LANE_OF[kind], s, e, _name(label, kind)


def timeline_figure(result: SimResult, title: str = "", max_bars: int = CHART_BARS):
    """The Plotly figure: one row per stage and stream, one bar per segment (or per task)."""
    import plotly.graph_objects as go  # lazy: plotly's import is slow and only charts need it

    detail = [sum(len(result.meta[t][1]) for t in _stage_tasks(result, i)) for i in range(result.p)]
    coarse = sum(detail) > max_bars
    costs = [len(_stage_tasks(result, i)) for i in range(result.p)] if coarse else detail
    stages = shown_stages(result, costs, max_bars)
    columns: dict = {}
    used = set()
    for i in stages:
        for kind, lane, s, e, name in _bars(result, i, coarse):
            used.add(lane)
            col = columns.setdefault(kind, {"y": [], "base": [], "x": [], "text": []})
            col["y"].append(f"stage {i} {LANES[lane]}")
            col["base"].append(s)
            col["x"].append(e - s)
            col["text"].append(name)
    # A stream that is idle on every stage (dp without data parallelism, pp without a pipeline)
    # gets no row: it would only push the time axis further down.
    rows = [f"stage {i} {name}" for i in stages for lane, name in enumerate(LANES) if lane in used]
    fig = go.Figure()
    for kind, col in columns.items():
        fig.add_trace(go.Bar(y=col["y"], base=col["base"], x=col["x"], orientation="h", name=kind,
                             marker_color=KIND_COLOURS.get(kind), hovertext=col["text"],
                             hovertemplate="%{hovertext}<br>%{base:.4f} s + %{x:.4f} s<extra>" + kind + "</extra>"))
    # The time axis also on top, so that a chart taller than the screen shows it without
    # scrolling; an empty trace puts the second axis on the page, `matches` zooms both together.
    fig.add_trace(go.Scatter(x=[0.0, result.step_time_s], y=[rows[0], rows[0]] if rows else [], xaxis="x2",
                             mode="markers", marker={"opacity": 0}, hoverinfo="skip", showlegend=False))
    notes = [n for n in (_sample_note(result, stages), "one bar per task" if coarse else "") if n]
    heading = title or f"simulated step: {result.step_time_s:.3f} s ({result.schedule})"
    if notes:
        heading += f"<br><sub>{'; '.join(notes)}</sub>"
    fig.update_layout(title=heading, barmode="overlay", xaxis_title="time in the step (s)",
                      xaxis2={"matches": "x", "overlaying": "x", "side": "top", "title": "time in the step (s)"},
                      yaxis={"categoryorder": "array", "categoryarray": rows[::-1], "title": ""},
                      height=max(400, 18 * len(rows) + 150), legend_title="kind", bargap=0.15)
    return fig, "; ".join(notes)


def write_html(result: SimResult, path: str, title: str = "", max_bars: int = CHART_BARS) -> str:
    """Write the chart as one self-contained HTML file; returns a note on sampling ("" if none)."""
    import plotly.io as pio

    from perfsim.files import write_output

    fig, note = timeline_figure(result, title, max_bars)
    write_output(path, "--html", pio.to_html(fig, include_plotlyjs=True, full_html=True), example="step.html")
    return note
