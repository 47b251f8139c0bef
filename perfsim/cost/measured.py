"""Measured kernel tables: what calibration timed, interpolated in log space (docs/equations.md 3.10).

A calibrated profile carries the kernels it measured ([device.measured.<kernel>.<dtype>]): GEMMs and
the causal fused attention kernel (forward, backward) by (count, m, n, k), each element-wise kernel
forward and backward by bytes; and its collectives
([collectives.measured.<op>.<dtype>]) by group size, stride and bytes. A prediction keeps the
parametric curve (the GEMM efficiency model, the streaming model) and corrects it by the measured
points near the shape asked for: the log ratio measured / curve of every point, averaged with
Gaussian weights over the distance in octaves (log2 of each coordinate), and shrunk towards the
curve (ratio 1) by a prior with the weight of a point PRIOR_OCTAVES away. So at a measured shape
the prediction is (nearly) the measurement, between measured shapes it follows them, and far from
all of them the curve extrapolates. The prior's share of the weight is the share of a kernel's time
that rests on the curve alone: the extrapolated share a prediction reports.

A curve that cannot describe a machine (bf16 GEMMs fast at some shapes and slow at others, as with
AMX, or element-wise kernels whose speed steps at cache sizes) is what the table is for: the curve
only has to be right where nothing was measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

GEMM = "gemm"
# The causal fused (flash) attention kernel, forward and backward, tabled like a GEMM by the
# shape of its scores product (count = batch x heads, m = n = sequence, k = head dim).
FLASH_KERNELS = ("flash", "flash_backward")
SHAPE_KERNELS = (GEMM,) + FLASH_KERNELS  # tabled by GEMM_COLUMNS; element-wise kernels by bytes
GEMM_COLUMNS = ("count", "m", "n", "k", "seconds")
MEMORY_COLUMNS = ("bytes", "seconds")
COLLECTIVE_COLUMNS = ("size", "stride", "bytes", "seconds")
PRIOR_OCTAVES = 1.5  # beyond about this distance from every measured point the curve takes over
SAMPLED = 256  # elements of a column whose distinct values _distinct_codes looks for first
WIDTHS = (0.35, 0.5, 0.7, 1.0)  # Gaussian widths (octaves) calibration chooses from, by leave-one-out


@dataclass(frozen=True)
class KernelTable:
    """Measured times of one kernel in one dtype: `points` is ((coordinate, ..., seconds), ...) in
    the order of GEMM_COLUMNS or MEMORY_COLUMNS; `width` the Gaussian width in octaves."""

    kernel: str  # GEMM, a FLASH_KERNELS name, or an element-wise kernel (perfsim.spec.system.MEMORY_OPERATIONS)
    dtype: str
    points: tuple
    width: float = 0.5
    source: str = ""  # where the points come from (a table's provenance is always "measured")

    # cached: a search's batch corrects dozens of kernels by each table (the table is frozen)
    @cached_property
    def coordinates(self) -> np.ndarray:
        return np.log2(np.array([p[:-1] for p in self.points], float))

    @cached_property
    def _linear(self) -> tuple:
        return tuple(np.array([p[i] for p in self.points], float) for i in range(len(self.points[0]) - 1))

    def coordinates_linear(self) -> list:
        """The points' coordinates as columns (count, m, n, k or bytes), to price them on the curve."""
        return list(self._linear)

    def coordinates_across(self) -> list:
        """coordinates_linear as (points, 1) columns: the curve priced at them by a device whose
        numbers are arrays over draws of a profile's ranges broadcasts to (points, draws), one
        curve per draw, which `correction` takes."""
        return [c[:, None] for c in self.coordinates_linear()]

    @cached_property
    def seconds(self) -> np.ndarray:
        return np.array([p[-1] for p in self.points], float)


def find_table(tables: tuple, kernel: str, dtype: str) -> KernelTable | None:
    return next((t for t in tables if t.kernel == kernel and t.dtype == dtype), None)


def _weights(table: KernelTable, query: np.ndarray, leave_out_self: bool = False) -> tuple:
    """(weights of each measured point for each query row, the prior's weight): Gaussian in the
    distance in octaves."""
    d2 = ((query[:, None, :] - table.coordinates[None, :, :]) ** 2).sum(axis=2)
    w = np.exp(-d2 / (2 * table.width**2))
    if leave_out_self:
        np.fill_diagonal(w, 0.0)
    return w, np.exp(-PRIOR_OCTAVES**2 / (2 * table.width**2))


def unique_rows(coordinates: list) -> tuple:
    """(distinct rows of the broadcast coordinates in log2, index of each element's row, shape): a
    search asks for the same few shapes across many plans, so interpolate each shape once."""
    arrays = np.broadcast_arrays(*[np.asarray(c, float) for c in coordinates])
    shape = arrays[0].shape
    columns = [a.ravel() for a in arrays]
    if columns[0].size == 1:
        return np.log2(np.stack(columns, axis=1)), np.zeros(1, int), shape
    first, inverse = distinct_rows([c for given, c in zip(coordinates, columns) if np.size(given) > 1],
                                   columns[0].size)
    # the log2 of the distinct rows alone: equal coordinates have equal logs
    return np.log2(np.stack([column[first] for column in columns], axis=1)), inverse.ravel(), shape


KEY_LIMIT = 1 << 40  # distinct keys distinct_rows lets the joined codes reach before it renumbers them


def distinct_rows(columns: list, n: int) -> tuple:
    """(a row of each distinct row, each row's index among them) of `n`-long 1-d columns, the
    distinct rows in sorted order: np.unique(axis=0)'s return_index and return_inverse. Each
    column's distinct values, their codes joined into one whole-number key a row: sorting whole
    numbers is far quicker than np.unique(axis=0)'s sort of rows (same rows, same answer)."""
    key = np.zeros(n, np.int64)
    keys = 1  # how many keys the codes can make
    for column in columns:
        if column.min() == column.max():  # one value (a GEMM's k, a batch's count)
            continue
        values, codes = _distinct_codes(column)
        if keys * len(values) > KEY_LIMIT:  # many columns: renumber the keys so far densely, in order
            _, key = np.unique(key, return_inverse=True)
            keys = int(key.max()) + 1
        key = key * len(values) + codes
        keys *= len(values)
    if keys > len(key):
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    else:  # few keys (a search's batches): mark those present instead of sorting them, in np.unique's
        # order and codes, with a row of each key (every row of one key holds the same values)
        present = np.zeros(keys, bool)
        present[key] = True
        at = np.empty(keys, np.intp)
        at[key] = np.arange(len(key))
        first, inverse = at[present], (np.cumsum(present) - 1)[key]
    return first, inverse


def _distinct_codes(column: np.ndarray) -> tuple:
    """np.unique(column, return_inverse=True) (the sorted distinct values, each element's index
    among them) without sorting the column where a few values repeat, as in a search's batches: the
    distinct values of a sample of it and of the elements the sample missed."""
    values = np.unique(column[::max(1, len(column) // SAMPLED)])
    codes = np.minimum(np.searchsorted(values, column), len(values) - 1)
    missed = values[codes] != column
    if missed.any():
        values = np.unique(np.concatenate([values, column[missed]]))
        codes = np.searchsorted(values, column)
    return values, codes


def correction(table: KernelTable, coordinates: list, curve_at_points) -> tuple:
    """(factor, curve share) for kernels at `coordinates` (numbers or arrays, one per coordinate of
    the table): the curve's time times `factor` is the prediction; `curve share` is the part of it
    the measurements do not support. `curve_at_points`: the curve's seconds at the table's points."""
    rows, inverse, shape = unique_rows(coordinates)
    curve = np.asarray(curve_at_points, float)
    w, prior = _weights(table, rows)
    total = w.sum(axis=1) + prior
    if curve.ndim == 2 and curve.shape[1] > 1:  # one curve per draw (coordinates_across)
        return _correction_per_draw(table, w, total, prior, inverse, shape, curve)
    residual = np.log(table.seconds / curve.reshape(-1))
    factor = np.exp((w @ residual) / total)[inverse].reshape(shape)
    share = (prior / total)[inverse].reshape(shape)
    return (factor, share) if shape else (float(factor), float(share))


def _correction_per_draw(table, w, total, prior, inverse, shape, curve) -> tuple:
    """`correction` where the curve at the points differs per draw (columns of `curve`, one per
    element of the broadcast queries, which are aligned with the draws or the same for all)."""
    draws = curve.shape[1]
    out_shape = np.broadcast_shapes(shape, (draws,))
    query = np.broadcast_to(inverse.reshape(shape) if shape else inverse[0], out_shape).ravel()
    column = np.broadcast_to(np.arange(draws), out_shape).ravel()
    residual = np.log(table.seconds[:, None] / curve)  # (points, draws)
    factor = np.exp(np.einsum("sp,ps->s", w[query], residual[:, column]) / total[query]).reshape(out_shape)
    return factor, (prior / total)[query].reshape(out_shape)


def leave_one_out_error(table: KernelTable, curve_at_points) -> float:
    """Mean absolute relative error of each point predicted from the others (the table's own
    cross-validation, used to choose its width)."""
    residual = np.log(table.seconds / np.asarray(curve_at_points, float))
    w, prior = _weights(table, table.coordinates, leave_out_self=True)
    predicted = np.exp((w @ residual) / (w.sum(axis=1) + prior)) * curve_at_points
    return float(np.mean(np.abs(predicted - table.seconds) / table.seconds))


def best_width(table: KernelTable, curve_at_points) -> KernelTable | None:
    """`table` with the width of WIDTHS that predicts its points best from the others; None when
    the curve alone predicts them better (points too noisy, or too sparse, to interpolate)."""
    errors = {w: leave_one_out_error(replace(table, width=w), curve_at_points) for w in WIDTHS}
    width = min(errors, key=errors.get)
    curve_error = float(np.mean(np.abs(np.asarray(curve_at_points, float) - table.seconds) / table.seconds))
    if curve_error <= errors[width]:
        return None
    return replace(table, width=width)
