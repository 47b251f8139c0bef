"""Element-wise and streaming kernels: the effective bandwidth, kernel overhead and per-kind efficiencies."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from perfsim.calibrate.common import (CHECKED_MEMORY_OPS, ELEMENTWISE_OPS, Fitted, PEAK_KEYS, Quality,
                                      STREAM_OPS, TRAINING_DTYPE, least_squares, mape, measured_times,
                                      split_held_out)


def fit_memory(records, system, ledger):
    """Effective element-wise bandwidth and kernel overhead; streaming bandwidth; then per-kind efficiencies."""
    from perfsim.cost.layer import MemoryOp, memory_time

    values, quality, notes = {}, [], []
    dev = system.device

    def fit_ops(ops, label):
        fit, held = split_held_out(records, "memory", ops)
        if len(fit) < 2:
            return None
        nbytes_fit, t_fit = np.array([r["nbytes"] for r in fit], float), measured_times(fit)

        def predict(x, nbytes):
            d = dataclasses.replace(dev, memory_bandwidth_Bps=math.exp(x[0]), memory_efficiency=1.0,
                                    kernel_overhead_s=math.exp(x[1]))
            return memory_time(d, MemoryOp(label, nbytes))

        x0 = [math.log(dev.memory_bandwidth_Bps * dev.memory_efficiency), math.log(max(dev.kernel_overhead_s, 1e-7))]
        x = least_squares(lambda x: np.log(predict(x, nbytes_fit) / t_fit), x0,
                           ([math.log(1e6), math.log(1e-9)], [math.log(1e15), math.log(1.0)]))
        nbytes_held = np.array([r["nbytes"] for r in held], float)
        quality.append(Quality(label, mape(predict(x, nbytes_fit), t_fit), len(fit),
                               mape(predict(x, nbytes_held), measured_times(held)) if held else float("nan"), len(held)))
        return math.exp(x[0]), math.exp(x[1]), len(fit)

    elementwise = fit_ops(ELEMENTWISE_OPS, "memory: element-wise ops (" + ", ".join(ELEMENTWISE_OPS) + ")")
    if elementwise:
        eff_bw, overhead, _ = elementwise
        d = dataclasses.replace(dev, memory_bandwidth_Bps=eff_bw, memory_efficiency=1.0, kernel_overhead_s=overhead)
        for op in ELEMENTWISE_OPS + CHECKED_MEMORY_OPS:
            fit, held = split_held_out(records, "memory", (op,))
            if fit:
                pred = lambda rows: memory_time(d, MemoryOp(op, np.array([r["nbytes"] for r in rows], float)))  # noqa: E731
                quality.append(Quality(f"  {op}" + (" (check, not fitted)" if op in CHECKED_MEMORY_OPS else ""),
                                       mape(pred(fit), measured_times(fit)), len(fit),
                                       mape(pred(held), measured_times(held)) if held else float("nan"), len(held)))
        if eff_bw >= 0.99e15 or overhead <= 1.01e-9:
            notes.append("element-wise fit ran into a bound (too few large or small sizes): memory keys left as in "
                         "the base profile")
            elementwise = None
    stream = fit_ops(STREAM_OPS, "memory: copy and triad")
    if stream and stream[0] >= 0.99e15:
        stream = None
    peak_kind = system.provenance.get("device.memory_bandwidth_Bps", ("", ""))[0]
    bandwidth = dev.memory_bandwidth_Bps
    if stream:
        stream_bw = stream[0]
        if peak_kind not in PEAK_KEYS or stream_bw > bandwidth:
            bandwidth = stream_bw
            values["device.memory_bandwidth_Bps"] = Fitted(
                stream_bw, f"copy and triad, time = bytes / bandwidth + overhead fitted over {stream[2]} points of "
                           f"ledger {ledger}: streaming bandwidth of one rank with every rank busy")
    if elementwise:
        eff_bw, overhead, n = elementwise
        if eff_bw > bandwidth:
            notes.append(f"element-wise ops reached {eff_bw / 1e9:.1f} GB/s, above the memory bandwidth "
                         f"{bandwidth / 1e9:.1f} GB/s: bandwidth raised to it, efficiency 1")
            bandwidth = eff_bw
            values["device.memory_bandwidth_Bps"] = Fitted(
                eff_bw, f"raised to the element-wise ops' fitted bandwidth (ledger {ledger})")
        values["device.memory_efficiency"] = Fitted(
            min(1.0, eff_bw / bandwidth),
            f"element-wise ops ({', '.join(ELEMENTWISE_OPS)}), {n} points of ledger {ledger}: fitted "
            f"{eff_bw / 1e9:.3g} GB/s / memory_bandwidth_Bps {bandwidth / 1e9:.3g} GB/s")
        values["device.kernel_overhead_s"] = Fitted(
            overhead, f"intercept of the element-wise fit (time = bytes / bandwidth + overhead), ledger {ledger}")
    # the per-kind fits start from what a profile without the table predicts: the global fit's numbers
    overhead = elementwise[1] if elementwise else dev.kernel_overhead_s
    efficiency = min(1.0, elementwise[0] / bandwidth) if elementwise else dev.memory_efficiency
    v, q, n = _kind_fit(records, dataclasses.replace(dev, memory_bandwidth_Bps=bandwidth, memory_efficiency=efficiency,
                                                     kernel_overhead_s=overhead, operation_memory_efficiency=()), ledger)
    values.update(v), quality.extend(q), notes.extend(n)
    return values, quality, notes


def _kind_fit(records, dev, ledger):
    """One efficiency per element-wise kind and direction measured (device.operation_memory_efficiency),
    each a least-squares fit on log time through perfsim.cost.layer.memory_time with `dev`'s
    bandwidth and kernel overhead (the global fit's), on the kind's points in the training dtype
    where the ledger has them (a step runs its element-wise kernels in it; this CPU runs fp32 ones
    2-3x faster per byte), else on all of them. The head row also gives what `dev` alone (one
    memory_efficiency, backward 1.5 x forward) predicts for the same points."""
    from perfsim.cost.layer import MEMORY_BACKWARD, measured_memory_op, memory_time
    from perfsim.spec.system import MEMORY_OPERATIONS

    values, rows, dtypes, bounded = {}, [], set(), []
    # per point: (held out?, measured, per-kind prediction, one-efficiency prediction)
    points: list = []
    for name in MEMORY_OPERATIONS:
        fit, held = split_held_out(records, "memory", (name,))
        if any(r["dtype"] == TRAINING_DTYPE for r in fit):
            fit, held = [r for r in fit if r["dtype"] == TRAINING_DTYPE], [r for r in held if r["dtype"] == TRAINING_DTYPE]
        if not fit:
            continue
        dtypes |= {r["dtype"] for r in fit}

        def predict(efficiency, rs, name=name):
            op, backward = measured_memory_op(name, np.array([r["nbytes"] for r in rs], float))
            table = ((name, efficiency),) if efficiency else ()
            return memory_time(dataclasses.replace(dev, operation_memory_efficiency=table), op, backward)

        t_fit = measured_times(fit)
        x = least_squares(lambda x: np.log(predict(math.exp(x[0]), fit) / t_fit), [math.log(dev.memory_efficiency)],
                           ([math.log(1e-4)], [math.log(1e3)]))
        efficiency = math.exp(x[0])
        if not 1.01e-4 < efficiency < 0.99e3:  # no bandwidth explains it: e.g. faster than one kernel overhead
            bounded.append(f"{name} ({len(fit)} points)")
            continue
        for is_held, rs in ((False, fit), (True, held)):
            if rs:
                points += zip([is_held] * len(rs), measured_times(rs), predict(efficiency, rs), predict(None, rs))
        gbps = dev.memory_bandwidth_Bps * efficiency / 1e9
        rows.append(Quality(f"  {name}: efficiency {efficiency:.3g} ({gbps:.3g} GB/s)", mape(predict(efficiency, fit), t_fit),
                            len(fit), mape(predict(efficiency, held), measured_times(held)) if held else float("nan"), len(held)))
        kernel = f"{MEMORY_BACKWARD:g} x forward bytes" if name.endswith("_backward") else "bytes"
        values[f"device.operation_memory_efficiency.{name}"] = Fitted(
            efficiency, f"{len(fit)} {'/'.join(sorted({r['dtype'] for r in fit}))} points of ledger {ledger}: "
                        f"{gbps:.3g} GB/s over memory_bandwidth_Bps {dev.memory_bandwidth_Bps / 1e9:.3g} GB/s (time = "
                        f"{kernel} / (memory_bandwidth_Bps x efficiency) + kernel_overhead_s "
                        f"{dev.kernel_overhead_s * 1e6:.3g} us, least squares on log time through "
                        f"perfsim.cost.layer.memory_time)")
    left = ([f"no per-kind efficiency where the fit ran into its bounds (the kind's time is not bytes over a "
             f"bandwidth plus the kernel overhead; it keeps memory_efficiency): {', '.join(bounded)}"] if bounded else [])
    if not rows:
        return values, rows, left

    def error(held: bool, column: int):
        chosen = [p for p in points if p[0] == held]
        return (mape([p[column] for p in chosen], [p[1] for p in chosen]) if chosen else float("nan")), len(chosen)

    (fit_one, _), (held_one, _) = error(False, 3), error(True, 3)
    head = Quality("memory: per kind and direction (operation_memory_efficiency)", *error(False, 2),
                   *error(True, 2), note=f"one memory_efficiency on the same points: fit {100 * fit_one:.1f}%, "
                                         f"held-out {100 * held_one:.1f}%")
    notes = [f"per-kind element-wise efficiencies fitted on {'/'.join(sorted(dtypes))} points (the dtype a training "
             f"step runs its element-wise kernels in, where measured); kinds not measured keep memory_efficiency, "
             f"and backward kernels not measured take {MEMORY_BACKWARD:g} x the forward time"] + left
    return values, [head] + rows, notes
