"""Predicted against measured: the records of a measurement ledger (validate/, JSON Lines; read
with perfsim.ledger.read_ledger) beside what perfsim predicts for each, with +-10% bands.

Both kinds of ledger are drawn: calibration measurements (perfsim calibrate) and training steps
(perfsim validate --device, suite "step": the step time validate recorded, the median of the steps
at the profile's speed, against the prediction recorded with it).

A record's measured time is the statistic of its repetitions that the calibrated profile prices
(by default "expected": the mean, which a profile fitted with calibrate's default prices every
call at, collectives included through their step overhead; the rank's CPU time for compute
points where the ledger has it; `statistic` and `clock` choose as calibrate's --statistic and
--clock do). Its predicted time is the record's own
`predicted_s` when it has one (a whole training step checked by a validation run); otherwise
perfsim predicts it with a system profile through the very cost functions a prediction uses:
GEMMs with perfsim.cost.layer.gemm_time, element-wise and streaming ops with memory_time (for the
kernel's kind and direction), collectives with perfsim.calibrate.collective_times (the topology
model). Other records (attention, failed points) are counted and left out, and the page says how
many.
"""

from __future__ import annotations

import sys

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from perfsim.charts._common import style, title
from perfsim.errors import PerfsimError
from perfsim.ledger import STEP_SUITE

BAND = 0.10
SUITE_COLOURS = {"gemm": "#4c78a8", "memory": "#72b7b2", "collective": "#e45756", "attention": "#b279a2",
                 "step": "#f58518"}
SUITE_SYMBOLS = {"gemm": "circle", "memory": "square", "collective": "diamond", "attention": "triangle-up",
                 "step": "star"}


def _predicted(system, records: list) -> tuple:
    """(predicted seconds per record, NaN where perfsim has no prediction, and notes)."""
    from perfsim.calibrate.overlap import is_concurrent
    from perfsim.cost.layer import Gemm, gemm_time, measured_memory_op, memory_time
    from perfsim.predict import peak_flops
    from perfsim.spec.system import for_dtype

    out = np.full(len(records), np.nan)
    collectives = []
    for i, r in enumerate(records):
        own = (r.get("predicted") or {}).get("step_time_s") if r["suite"] == STEP_SUITE else r.get("predicted_s")
        if isinstance(own, (int, float)) and not isinstance(own, bool) and own > 0:
            out[i] = float(own)
        elif system is None:
            continue
        elif r["suite"] == "gemm":
            s = r["shape"]
            try:
                peak = peak_flops(system, r["dtype"])
            except PerfsimError:
                continue
            device = for_dtype(system, r["dtype"]).device  # its measured tables of that dtype
            out[i] = float(gemm_time(device, peak, Gemm(r["op"], s.get("count", 1), s["m"], s["n"], s["k"])))
        elif r["suite"] == "memory":
            op, backward = measured_memory_op(r["op"], float(r["nbytes"]))  # its kind and direction
            out[i] = float(memory_time(for_dtype(system, r["dtype"]).device, op, backward))
        elif r["suite"] == "collective" and not is_concurrent(r):  # beside compute: a ratio, no call's time
            collectives.append(i)
    if collectives:
        from perfsim.calibrate import collective_times

        out[collectives] = collective_times(system, [records[i] for i in collectives])
    return out


def measured_time(record: dict, statistic: str = "expected", clock: str = "auto") -> float:
    """The measured seconds of a record, chosen as perfsim calibrate's fit chooses them."""
    from perfsim.calibrate import STATISTICS

    if statistic not in STATISTICS:
        raise PerfsimError(f"statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")
    if clock not in ("auto", "wall"):
        raise PerfsimError(f"clock must be auto or wall, got {clock!r}")
    if record.get("suite") == STEP_SUITE:  # what perfsim validate compares: its recorded step time
        return float(record["measured"]["step_time_s"])
    stats = record["cpu_stats"] if clock == "auto" and isinstance(record.get("cpu_stats"), dict) else record["stats"]
    # "expected": the profile prices every call at its mean (collectives: the link model's fastest
    # repetition plus the step overhead)
    t = stats.get("mean_s" if statistic == "expected" else STATISTICS[statistic], record["stats"]["median_s"])
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 else float("nan")


def _warn(message: str) -> None:
    print(f"perfsim: warning: {message}", file=sys.stderr)


def load(path: str, system=None, statistic: str = "expected", clock: str = "auto", warn=_warn) -> tuple:
    """(records with a measured and a predicted time, their measured and predicted times, a note
    on the rest). Skipped lines and repeated keys are told to `warn`, one line each."""
    from perfsim.ledger import any_problem, read_ledger, skipped_lines

    duplicates: list = []
    records, problems = read_ledger(path, any_problem, duplicates)
    for line in skipped_lines(path, problems, duplicates):
        warn(line)
    measured_ok = [r for r in records if "error" not in r]
    failed = len(records) - len(measured_ok)
    measured = np.array([measured_time(r, statistic, clock) for r in measured_ok], float)
    predicted = _predicted(system, measured_ok)
    keep = [i for i in range(len(measured_ok)) if np.isfinite(predicted[i]) and np.isfinite(measured[i])]
    left = len(measured_ok) - len(keep)
    notes = []
    if failed:
        notes.append(f"{failed} failed points")
    if left:
        suites = sorted({measured_ok[i]["suite"] for i in range(len(measured_ok)) if i not in set(keep)})
        notes.append(f"{left} records without a prediction ({', '.join(suites)}"
                     + ("; give --system to predict them" if system is None else "") + ")")
    if problems:
        notes.append(f"{len(problems)} damaged or unusable lines skipped")
    if duplicates:
        notes.append(f"{len(duplicates)} keys on more than one line (the last copy of each drawn)")
    if not keep:
        raise PerfsimError(f"ledger {path}: no record with both a measured and a predicted time"
                           + (f" ({'; '.join(notes)})" if notes else "")
                           + ("; give --system PROFILE to predict the measured operations" if system is None else ""))
    return [measured_ok[i] for i in keep], measured[keep], predicted[keep], "; ".join(notes)


def _describe(r: dict) -> str:
    if r["suite"] == STEP_SUITE:
        plan = ", ".join(f"{k} {v}" for k, v in r["plan"].items())
        return f"training step {r['dtype']}, {r.get('model', '')}: {plan}"
    shape = ", ".join(f"{k} {v}" for k, v in r.get("shape", {}).items())
    group = f", group of {r['group'][0]} ranks {r['group'][1]} apart" if r.get("group") else ""
    return f"{r['suite']} {r['op']} {r['dtype']}: {shape}{group}"


def figure(path: str, system=None, statistic: str = "expected", clock: str = "auto", warn=_warn) -> go.Figure:
    """The parity plot and the relative error of ledger `path` (predictions from `system`)."""
    records, measured, predicted, note = load(path, system, statistic, clock, warn)
    error = predicted / measured - 1
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=("predicted against measured (log-log)", "prediction error against measured time"))
    low, high = float(min(measured.min(), predicted.min())) / 1.5, float(max(measured.max(), predicted.max())) * 1.5
    line = np.geomspace(low, high, 50)
    fig.add_trace(go.Scatter(x=line, y=line * (1 - BAND), mode="lines", line={"width": 0}, showlegend=False,
                             hoverinfo="skip"), row=1, col=1)
    fig.add_trace(go.Scatter(x=line, y=line * (1 + BAND), mode="lines", line={"width": 0}, fill="tonexty",
                             fillcolor="rgba(84,162,75,0.18)", name="within +-10%", hoverinfo="skip"), row=1, col=1)
    fig.add_trace(go.Scatter(x=line, y=line, mode="lines", line={"color": "#333", "dash": "dash"},
                             name="prediction = measurement", hoverinfo="skip"), row=1, col=1)
    fig.add_hrect(y0=-100 * BAND, y1=100 * BAND, fillcolor="rgba(84,162,75,0.18)", line_width=0, row=1, col=2)
    fig.add_hline(y=0, line={"color": "#333", "dash": "dash"}, row=1, col=2)
    summary = []
    for suite in sorted({r["suite"] for r in records}):
        idx = [i for i, r in enumerate(records) if r["suite"] == suite]
        hover = [f"<b>{_describe(records[i])}</b><br>measured {measured[i] * 1e3:.4g} ms, predicted "
                 f"{predicted[i] * 1e3:.4g} ms ({error[i]:+.1%})" for i in idx]
        style_ = {"color": SUITE_COLOURS.get(suite, "#555"), "symbol": SUITE_SYMBOLS.get(suite, "circle"), "size": 7,
                  "opacity": 0.8}
        fig.add_trace(go.Scatter(x=measured[idx], y=predicted[idx], mode="markers", name=suite, legendgroup=suite,
                                 marker=style_, hovertext=hover, hoverinfo="text"), row=1, col=1)
        fig.add_trace(go.Scatter(x=measured[idx], y=100 * error[idx], mode="markers", name=suite, legendgroup=suite,
                                 showlegend=False, marker=style_, hovertext=hover, hoverinfo="text"), row=1, col=2)
        within = float(np.mean(np.abs(error[idx]) <= BAND))
        summary.append(f"{suite}: {len(idx)} points, {within:.0%} within +-10%, mean absolute error "
                       f"{float(np.mean(np.abs(error[idx]))):.1%}")
    fig.update_xaxes(type="log", dtick=1, title_text="measured time (s)", row=1, col=1)
    fig.update_yaxes(type="log", dtick=1, title_text="predicted time (s)", row=1, col=1)
    fig.update_xaxes(type="log", dtick=1, title_text="measured time (s)", row=1, col=2)
    span = max(25.0, min(200.0, float(np.max(np.abs(100 * error))) * 1.1))
    fig.update_yaxes(title_text="(predicted - measured) / measured (%)", range=[-span, span], row=1, col=2)
    chosen = {"min": "the best", "median": "the median", "p25": "the 25th percentile", "mean": "the mean",
              "expected": "the mean"}[statistic]
    steps = all(r["suite"] == STEP_SUITE for r in records)
    source = (f"ledger {path}" + (f", predictions from profile {system.name}" if system is not None else "")
              + ("; measured: each plan's step time as perfsim validate recorded it (the median of its steps at "
                 "the profile's speed), predicted: the prediction recorded with it" if steps else
                 f"; measured: {chosen} of each point's repetitions"
                 + (", the rank's CPU time where recorded" if clock == "auto" else ", wall clock")))
    subtitle = f"{source}. " + "; ".join(summary) + "." + (f" Left out: {note}." if note else "") + \
        " Green band: within +-10% of the measurement."
    fig.update_layout(title=title("How close are perfsim's predictions to measurements?", subtitle, 150),
                      legend={"x": 1.02, "y": 1})
    style(fig, height=600)
    fig.update_layout(margin={"t": 150})
    return fig
