"""Measured kernel tables: every GEMM, flash-attention kernel, element-wise kernel and collective the ledger timed, kept in the profile
(perfsim.cost.measured) so that predictions interpolate the measurements and use the fitted curves
only where nothing near was measured.

A table is built from the fitted points; the held-out points measure it, against the curve alone
on the same points. Its Gaussian width (in octaves) is the one that predicts each fitted point best
from the others (leave-one-out), so nothing about it is tuned on the held-out points. Once measured,
the profile's table gets the held-out points too, at that width: they are measurements of this
machine like the others, and a shape the plan runs (plan-aware calibration measures every one)
must not be left to interpolation because its hash fell among the held-out quarter.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from perfsim.calibrate.common import Quality, mape, measured_times, split_held_out
from perfsim.cost import measured
from perfsim.errors import PerfsimError

GEMM_SHAPE = ("count", "m", "n", "k")


def _peak(system, dtype: str):
    """The profile's peak FLOP/s in `dtype`, None where it has none."""
    from perfsim.predict import peak_flops

    try:
        return peak_flops(system, dtype)
    except PerfsimError:
        return None


def _gemm_curve(system, dtype: str):
    """seconds(count, m, n, k) of the fitted GEMM model in `dtype`, None without a peak for it."""
    from perfsim.cost.layer import gemm_curve_time

    peak = _peak(system, dtype)
    return None if peak is None else lambda count, m, n, k: gemm_curve_time(system.device, peak, count, m, n, k)


def _memory_curve(system, name: str):
    """seconds(bytes) of the fitted element-wise model for kernel `name` (its bytes as recorded)."""
    from perfsim.cost.layer import measured_memory_op, memory_time

    def curve(nbytes):
        op, backward = measured_memory_op(name, np.asarray(nbytes, float))
        return memory_time(system.device, op, backward)
    return curve


def _flash_curve(system, dtype: str, kernel: str):
    """seconds(count, m, n, k) of the fitted flash-attention model, forward or backward, in `dtype`."""
    from perfsim.cost.layer import flash_curve_times

    peak, direction = _peak(system, dtype), measured.FLASH_KERNELS.index(kernel)
    return None if peak is None else lambda count, m, n, k: flash_curve_times(system.device, peak, count, m, n,
                                                                                k)[direction]


def _collective_curve(system, op: str):
    """seconds(size, stride, bytes) of the fitted link model (and step overheads) for `op`."""
    from perfsim.cost.topology import TopologyCommModel, clear_caches

    clear_caches()
    comm = TopologyCommModel(system)
    return lambda size, stride, nbytes: np.array(  # noqa: E731
        [float(getattr(comm, op)(float(n), int(g), int(s))) for g, s, n in zip(size, stride, nbytes)])


def _points(records: list, columns, times) -> tuple:
    """A table's points of `records`: each record's coordinates and its seconds."""
    return tuple(tuple(float(c) for c in columns(r)) + (float(t),) for r, t in zip(records, times(records)))


def _table(kernel: str, dtype: str, fit: list, columns, curve, times):
    """The KernelTable of the fitted records, at its leave-one-out width, and its curve at the points."""
    table = measured.KernelTable(kernel, dtype, _points(fit, columns, times))
    at_points = curve(*table.coordinates_linear())
    return measured.best_width(table, at_points), table, at_points


def _quality(name: str, table, at_points, held: list, columns, curve, times) -> Quality:
    """Leave-one-out MAPE on the fitted points, and held-out MAPE of the table beside the curve's."""
    loo = measured.leave_one_out_error(table, at_points)
    if not held:
        return Quality(name, loo, len(table.points), float("nan"), 0, note=f"width {table.width:g} octaves")
    coords = [np.array([columns(r)[i] for r in held], float) for i in range(len(columns(held[0])))]
    alone = curve(*coords)
    factor, share = measured.correction(table, coords, at_points)
    t = times(held)
    return Quality(name, loo, len(table.points), mape(alone * factor, t), len(held),
                   note=f"curve alone {100 * mape(alone, t):.1f}%; width {table.width:g} octaves, "
                        f"{100 * float(np.mean(share)):.0f}% of the held-out time on the curve")


def _collective_times(records: list) -> np.ndarray:
    """What a step pays per call of each collective point: the mean of its repetitions (the link
    model is fitted on the fastest, and the mean's excess is its step overhead)."""
    return np.array([r["stats"].get("mean_s", r["_t"]) for r in records], float)


def measured_tables(records: list, system, ledger: str, expected: bool = True) -> tuple:
    """(device tables, collective tables, quality rows, notes) from the ledger's GEMM, flash-attention,
    element-wise and collective records, against the calibrated `system`'s curves. Leave-one-out MAPE is the
    rows' "fit" figure. `expected`: collectives are tabled at each point's mean (what a step pays),
    else at the statistic the fit used."""
    from perfsim.spec.system import MEMORY_OPERATIONS, OPERATIONS

    device = dataclasses.replace(system.device, measured=(), kernel_dtype="")
    system = dataclasses.replace(system, device=device, collectives=dataclasses.replace(system.collectives, measured=()))
    device_tables, collective_tables, quality, dropped = [], [], [], []
    gemm_columns = lambda r: [r["shape"].get("count", 1), r["shape"]["m"], r["shape"]["n"], r["shape"]["k"]]  # noqa: E731
    memory_columns = lambda r: [r["nbytes"]]  # noqa: E731
    group_columns = lambda r: [r["group"][0], max(1, r["group"][1]), r["shape"]["nbytes"]]  # noqa: E731
    flash_columns = lambda r: [r["shape"]["batch"] * r["shape"]["heads"], r["shape"]["seq"], r["shape"]["seq"],  # noqa: E731
                               r["shape"]["head_dim"]]
    kernels = ([(measured.GEMM, "gemm", gemm_columns)] + [(name, "attention", flash_columns) for name in measured.FLASH_KERNELS]
               + [(name, "memory", memory_columns) for name in MEMORY_OPERATIONS]
               + [(op, "collective", group_columns) for op in OPERATIONS])
    curves = {"gemm": lambda kernel, dtype: _gemm_curve(system, dtype),  # each suite's fitted model
              "attention": lambda kernel, dtype: _flash_curve(system, dtype, kernel),
              "memory": lambda kernel, dtype: _memory_curve(system, kernel),
              "collective": lambda kernel, dtype: _collective_curve(system, kernel)}
    for kernel, suite, columns in kernels:
        ops = None if suite == "gemm" else (kernel,)
        fit_all, held_all = split_held_out(records, suite, ops)
        if suite == "collective":
            fit_all, held_all = ([r for r in rs if r.get("group") and r["group"][0] > 1] for rs in (fit_all, held_all))
        times = _collective_times if suite == "collective" and expected else measured_times
        for dtype in sorted({r["dtype"] for r in fit_all}):
            fit = [r for r in fit_all if r["dtype"] == dtype]
            held = [r for r in held_all if r["dtype"] == dtype]
            curve = curves[suite](kernel, dtype)
            if curve is None or len(fit) < 2:
                continue
            table, points, at_points = _table(kernel, dtype, fit, columns, curve, times)
            if table is None:  # the fitted model predicts the points better than they predict each other
                curve_error = mape(at_points, points.seconds)
                dropped.append(f"{kernel} {dtype} (model {100 * curve_error:.1f}%, table at best "
                               f"{100 * min(measured.leave_one_out_error(dataclasses.replace(points, width=w), at_points) for w in measured.WIDTHS):.1f}%)")
                continue
            quality.append(_quality(f"table {kernel} {dtype} (fit: leave-one-out)", table, at_points, held, columns,
                                    curve, times))
            if held:  # measured on them, the table keeps them (module docstring)
                table = dataclasses.replace(table, points=table.points + _points(held, columns, times))
            (collective_tables if suite == "collective" else device_tables).append(table)
    tables = device_tables + collective_tables
    notes = [f"measured tables: {len(tables)} kernels x dtypes, {sum(len(t.points) for t in tables)} points of ledger "
             f"{ledger}; predictions interpolate them in log2 of each coordinate (shape, bytes, group size and "
             f"stride) and rest on the fitted models only far from every point (perfsim.cost.measured); collectives "
             f"at each point's mean, what a step pays per call"] if tables else []
    if dropped:
        notes.append("no table where the fitted model predicts the fitted points better than leave-one-out "
                     "interpolation does: " + ", ".join(dropped))
    return tuple(device_tables), tuple(collective_tables), quality, notes


def table_toml(table, ledger: str) -> dict:
    """One table as the profile's [device.measured.<kernel>.<dtype>] (or [collectives.measured...])
    holds it."""
    columns = (measured.COLLECTIVE_COLUMNS if len(table.points[0]) == len(measured.COLLECTIVE_COLUMNS)
               else measured.GEMM_COLUMNS if table.kernel in measured.SHAPE_KERNELS else measured.MEMORY_COLUMNS)
    return {"provenance": "measured",
            "source": f"{len(table.points)} points of ledger {ledger} (width chosen by leave-one-out on the fitted "
                      f"ones; the held-out ones, which measured the table, added after)",
            "width_octaves": table.width, "columns": list(columns),
            "points": [[int(x) if float(x).is_integer() else float(f"{x:.6g}") for x in p] for p in table.points]}
