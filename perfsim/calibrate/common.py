"""What every part of the fit shares: the ledger statistics and held-out rule, the quality rows, and
applying fitted values to a System."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np



STREAM_OPS = ("copy", "triad")
ELEMENTWISE_OPS = ("layernorm", "softmax", "gelu", "add")
CHECKED_MEMORY_OPS = ("dropout",)  # RNG-bound on CPUs (0.3-1 GB/s): reported, not fitted
STATISTICS = {"min": "min_s", "median": "median_s", "p25": "p25_s", "mean": "mean_s", "expected": None}
# "expected" (the default): what a training step pays on average for each call, since a step's time
# is the sum of many calls. Compute points: the mean of their repetitions. Collectives: the link
# model on the fastest repetition (the mean scatters too much to fit a model to: gloo's calls
# are bimodal), plus the mean's excess as a per-operation step overhead (_step_overheads).
EXPECTED = {"collective": "min_s"}  # suites whose "expected" statistic is not the mean


def statistic_key(statistic: str, suite: str) -> str:
    """The stats field a record of `suite` is fitted on under `statistic`."""
    return EXPECTED.get(suite, "mean_s") if statistic == "expected" else STATISTICS[statistic]
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "send")
PRIMARY_DTYPE = {"cpu": ("fp32", "bf16", "fp16"), "cuda": ("bf16", "fp16", "fp32"), "xpu": ("bf16", "fp16", "fp32")}
HELD_OUT_EVERY = 4  # one size in four is held out
TARGETS = {"gemm": 0.15, "collective": 0.20}  # held-out MAPE the issue asks for
# the dtype a training step runs in: the one whose collective measurements a profile's traffic and
# whose element-wise kernels its per-kind efficiencies are fitted on
TRAINING_DTYPE = "bf16"
# How collectives were timed, most step-like first (validate.microbench.Point.timing): alone right
# after a burst of compute; back to back; back to back after a barrier ("", the first ledgers).
COLLECTIVE_TIMINGS = ("interleaved", "stream", "")
# How GEMMs were timed, most step-like first (validate.microbench.Point.timing): operands rotated
# through more memory than the cache holds; each call after a cache flush; the same operands.
GEMM_TIMINGS = ("rotate", "cold", "")
PEAK_KEYS = ("spec", "derived")  # provenances of a true peak, kept when a fit stays below it


# --- the ledger ---

def held_out(record: dict) -> bool:
    """Whether a record's size is held out of the fit (a hash of the size alone)."""
    shape = record["shape"]
    if record["suite"] == "gemm":
        ident = f"gemm {shape.get('count', 1)} {shape['m']} {shape['n']} {shape['k']}"
    elif record["suite"] == "collective":
        ident = f"bytes {shape['nbytes']}"
    elif record["suite"] == "memory":
        ident = f"elements {shape['rows'] * shape['cols']}"
    else:
        ident = json.dumps(shape, sort_keys=True)
    return int(hashlib.sha1(ident.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def mape(predicted, measured) -> float:
    predicted, measured = np.asarray(predicted, float), np.asarray(measured, float)
    if not measured.size:
        return float("nan")
    return float(np.mean(np.abs(predicted - measured) / measured))


# --- the fit ---

@dataclasses.dataclass
class Fitted:
    """One fitted profile number: value and where it came from (the profile's source text)."""
    value: float
    source: str


@dataclasses.dataclass
class Quality:
    """MAPE of one group of points, on the points fitted and on those held out."""
    name: str
    fit_mape: float
    fit_points: int
    held_mape: float
    held_points: int
    target: float | None = None
    note: str = ""

    @property
    def passed(self):
        if self.target is None or not self.held_points:
            return None
        return self.held_mape <= self.target


@dataclasses.dataclass
class Calibration:
    values: dict  # "section.key" -> Fitted
    quality: list  # Quality rows
    notes: list  # lines for the report and the profile's header
    system: object = None  # the calibrated System
    tables: tuple = ()  # measured kernel tables (perfsim.cost.measured.KernelTable)


def least_squares(residuals, x0, bounds):
    from scipy.optimize import least_squares  # lazy: scipy's import time

    result = least_squares(residuals, np.asarray(x0, float), bounds=bounds, loss="soft_l1", f_scale=0.1,
                           x_scale="jac")
    return result.x


def split_held_out(records, suite, ops=None):
    rows = [r for r in records if r["suite"] == suite and "error" not in r and (ops is None or r["op"] in ops)]
    fit = [r for r in rows if not held_out(r)]
    held = [r for r in rows if held_out(r)]
    return fit, held


def measured_times(records):
    """Measured time of each record: the statistic `fit` chose (stored under "_t")."""
    return np.array([r["_t"] for r in records], float)


def with_fields(system, **sections):
    """System with fields of its sections replaced: with_fields(s, device={"gemm_efficiency": 0.8})."""
    changes = {name: dataclasses.replace(getattr(system, name), **fields) for name, fields in sections.items()}
    return dataclasses.replace(system, **changes)



def with_values(system, values: dict):
    """System with the fitted values in place, their provenance "calibrated"."""
    from perfsim.spec.system import operation_names

    sections: dict = {}
    provenance = dict(system.provenance)
    tables: dict = {}
    for key, fitted in values.items():
        section, name = key.split(".", 1)
        if "." in name:  # <section>.<table>.<name>: one entry of an optional per-operation table
            table, op = name.split(".")
            tables.setdefault((section, table), dict(getattr(getattr(system, section), table)))[op] = fitted.value
        else:
            sections.setdefault(section, {})[name] = fitted.value
        if not isinstance(fitted.value, str):  # plain strings (collectives.algorithm) carry no provenance
            provenance[key] = ("calibrated", fitted.source)
    for (section, table), entries in tables.items():
        order = operation_names(f"{section}.{table}")
        sections.setdefault(section, {})[table] = tuple((op, entries[op]) for op in order if op in entries)
    return dataclasses.replace(with_fields(system, **sections), provenance=provenance)


def profile_value(system, key: str):
    """The value of a "section.key" (or "<section>.<table>.<name>") in a System; a table's entry
    the profile leaves out reads as what stands in for it (1 for a collective factor, the device's
    memory_efficiency for an element-wise kind, 0 for a step overhead)."""
    section, name = key.split(".", 1)
    if "." in name:
        from perfsim.spec.system import OPERATION_TABLE_DEFAULTS

        table, op = name.split(".")
        default = system.device.memory_efficiency if section == "device" else OPERATION_TABLE_DEFAULTS[table]
        return dict(getattr(getattr(system, section), table)).get(op, default)
    return getattr(getattr(system, section), name)
