"""Framework overheads measured by construction: the tensor-parallel layer overhead (tp_overhead points)."""

from __future__ import annotations


import numpy as np

from perfsim.calibrate.common import Fitted


TP_OVERHEAD_KEYS = {"1d": ("framework.tp_layer_overhead_s", "1d"), "1d_sp": ("framework.sp_layer_overhead_s", "1d + SP")}


def fit_tp_overhead(records, ledger) -> tuple:
    """(values, notes): the host time DTensor's 1d layer adds, without and with SP, from the
    tp_overhead points (every round's difference of the two layers; their median, floored at 0:
    a machine's noise can make a small overhead read negative)."""
    values, notes = {}, []
    for op, (key, label) in TP_OVERHEAD_KEYS.items():
        points = [r for r in records if r["suite"] == "tp_overhead" and r["op"] == op]
        if not points:
            continue
        diffs = sorted(d for r in points for d in r["overhead_s"])
        value = max(0.0, float(np.median(diffs)))
        d = points[0]["shape"]
        seqs = " / ".join(str(s) for s in sorted({r["shape"]["seq"] for r in points}))
        layers = sorted(r["reference_stats"]["median_s"] * 1e3 for r in points if "reference_stats" in r)
        span = f"; Megatron's layer {layers[0]:.3g}-{layers[-1]:.3g} ms" if layers else ""
        values[key] = Fitted(value, f"median of {len(diffs)} alternating rounds of ledger {ledger}: validate.gpt's "
                                    f"layer under DTensor ({label}) against "
                                    f"Megatron's, forward + backward, hidden {d['hidden']}, {seqs} tokens x {d['mbs']}, "
                                    f"tp {points[0]['group'][0]}{span} (validate/tp_overhead.py)")
        notes.append(f"tensor-parallel overhead {label}: {value * 1e3:.3g} ms a layer and micro-batch "
                     f"(rounds' differences {diffs[0] * 1e3:.3g} to {diffs[-1] * 1e3:.3g} ms)")
    return values, notes
