"""What each profile number may be: its explicit range, the product of its named causes, or a
default width set by how the number is known (docs/profile-format.md, "Ranges").

A number table may carry, beside value, provenance and source:
    range = [lo, hi]                      lo <= value <= hi, inside the key's allowed values
    distribution = "uniform" | "loguniform"   (default uniform; loguniform needs lo > 0)
    [<key>.causes.<name>]                 factors whose product the number is, each with range,
    range = [lo, hi]; source = "..."      source and optionally distribution (not beside range)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from perfsim.errors import PerfsimError

DISTRIBUTIONS = ("uniform", "loguniform")
RANGE_PARTS = ("range", "distribution", "causes")
CAUSE_PARTS = ("range", "distribution", "source")

# Width of a number without a range, by provenance: ("relative", f) is value x (1 -/+ f), uniform;
# ("ratio", f) is value / f to value x f, log-uniform. A vendor or site figure is close to what the
# machine does; a benchmark on another system or stack is looser; a guess or a fit to something
# else may be off by a factor of two either way.
DEFAULT_WIDTHS = {"spec": ("relative", 0.02), "derived": ("relative", 0.02), "measured": ("relative", 0.15),
                  "assumed": ("ratio", 2.0), "calibrated": ("ratio", 2.0)}
# Numbers that are the machine's or the stack's structure rather than a rate, or that no prediction
# reads (the calibration's reference kernel times, which only validate's speed probes use): never sampled.
FIXED_KEYS = frozenset({"node.devices_per_node", "node.devices_per_card", "network.nics_per_node",
                        "device.memory_bytes", "framework.grad_bytes_per_param", "framework.dp_overlap",
                        "framework.tp_overlap", "framework.host_overlap", "framework.autocast",
                        "framework.grads_set_to_none", "framework.fp8_param_gather",
                        "framework.buffer_alignment_elements",
                        "device.speed_reference_gemm_s", "device.speed_reference_norm_s"})


@dataclass(frozen=True)
class Cause:
    name: str
    lo: float
    hi: float
    distribution: str
    source: str


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    distribution: str = "uniform"
    causes: tuple = ()  # Cause, ...: the number is their product (lo, hi are the products' bounds)
    explicit: bool = True  # False: the default width of the number's provenance kind


def _pair(where: str, key: str, raw, rule, loguniform: bool) -> tuple[float, float]:
    """[lo, hi] as floats, checked: two finite numbers, lo <= hi, inside the key's allowed values."""
    if not isinstance(raw, list) or len(raw) != 2 or any(
            isinstance(x, bool) or not isinstance(x, (int, float)) for x in raw):
        raise PerfsimError(f"{where}: {key}.range must be two numbers [lo, hi], got {raw!r}")
    lo, hi = float(raw[0]), float(raw[1])
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise PerfsimError(f"{where}: {key}.range must hold finite numbers, got {raw!r}")
    if lo > hi:
        raise PerfsimError(f"{where}: {key}.range has lo {lo:g} above hi {hi:g}; write [lo, hi]")
    if loguniform and lo <= 0:
        raise PerfsimError(f"{where}: {key}.range must be above 0 for a loguniform distribution, got {raw!r}")
    if rule is not None:
        _, low, high, low_ok = rule
        if lo < low or (lo == low and not low_ok) or hi > high:
            allowed = f"{'at least' if low_ok else 'above'} {low:g}" + (f" and at most {high:g}" if high != math.inf else "")
            raise PerfsimError(f"{where}: {key}.range {raw!r} leaves the key's allowed values ({allowed})")
    return lo, hi


def _distribution(where: str, key: str, entry: dict) -> str:
    distribution = entry.get("distribution", "uniform")
    if distribution not in DISTRIBUTIONS:
        raise PerfsimError(f"{where}: {key}.distribution must be one of {', '.join(DISTRIBUTIONS)}, got {distribution!r}")
    return distribution


def _causes(where: str, key: str, raw) -> tuple:
    if not isinstance(raw, dict) or not raw:
        raise PerfsimError(f"{where}: {key}.causes must be tables [{key}.causes.<name>] with range and source")
    causes = []
    for name, entry in raw.items():
        where_key = f"{key}.causes.{name}"
        if not isinstance(entry, dict):
            raise PerfsimError(f"{where}: {where_key} must be a table with range and source")
        unknown = [part for part in entry if part not in CAUSE_PARTS]
        if unknown:
            raise PerfsimError(f"{where}: unknown key {where_key}.{unknown[0]}; a cause holds {', '.join(CAUSE_PARTS)}")
        if "range" not in entry:
            raise PerfsimError(f"{where}: {where_key} has no range")
        if not isinstance(entry.get("source"), str) or not entry["source"].strip():
            raise PerfsimError(f"{where}: {where_key}.source must say where the range comes from")
        distribution = _distribution(where, where_key, entry)
        lo, hi = _pair(where, where_key, entry["range"], None, distribution == "loguniform")
        if lo <= 0:
            raise PerfsimError(f"{where}: {where_key}.range must be above 0 (a cause is a factor), got {entry['range']!r}")
        causes.append(Cause(name, lo, hi, distribution, entry["source"]))
    return tuple(causes)


def parse_range(where: str, key: str, entry: dict, rule) -> Range | None:
    """The explicit range (or causes) of one number table whose value is already checked; None
    when it has neither. `rule` is the key's (kind, low, high, low allowed?)."""
    if not any(part in entry for part in RANGE_PARTS):
        return None
    value = float(entry["value"])
    if "causes" in entry:
        if "range" in entry or "distribution" in entry:
            raise PerfsimError(f"{where}: {key} has both causes and a range; its range is its causes' product")
        causes = _causes(where, key, entry["causes"])
        lo, hi = math.prod(c.lo for c in causes), math.prod(c.hi for c in causes)
        _pair(where, f"{key}.causes", [lo, hi], rule, False)  # the product stays inside the allowed values
        return Range(lo, hi, "product", causes)
    if "range" not in entry:
        raise PerfsimError(f"{where}: {key}.distribution needs a range = [lo, hi] beside it")
    distribution = _distribution(where, key, entry)
    lo, hi = _pair(where, key, entry["range"], rule, distribution == "loguniform")
    if not lo <= value <= hi:
        raise PerfsimError(f"{where}: {key}.value {value:g} lies outside its range [{lo:g}, {hi:g}]")
    return Range(lo, hi, distribution)


def parse_ranges(where: str, data: dict, provenance: dict, rule_of) -> dict:
    """"section.key" -> Range for every number of the raw profile `data` that carries a range or
    causes (the keys of `provenance`, "section.table.name" for per-operation entries)."""
    ranges = {}
    for key in provenance:
        entry = data
        for part in key.split("."):
            entry = entry[part]
        found = parse_range(where, key, entry, rule_of(key))
        if found is not None:
            ranges[key] = found
    return ranges


def default_range(value: float, provenance: str, rule) -> Range | None:
    """The width a number without a range gets from its provenance kind, kept inside its allowed
    values; None for a zero (no width to scale)."""
    if value == 0:
        return None
    kind, width = DEFAULT_WIDTHS[provenance]
    if kind == "relative":
        lo, hi, distribution = value * (1 - width), value * (1 + width), "uniform"
    else:
        lo, hi, distribution = value / width, value * width, "loguniform"
    if rule is not None:
        _, low, high, _ = rule
        lo, hi = max(lo, low), min(hi, high)
    return Range(lo, hi, distribution, explicit=False)


def widened(r: Range, value: float, factor: float, rule) -> Range:
    """`r` with each side's distance from `value` multiplied by `factor` (in log space for a
    loguniform range; a uniform range's low end stays above 0 where it was), kept inside the
    key's allowed values. A number made of causes keeps them as they are."""
    if r.causes:
        return r
    if r.distribution == "loguniform":
        lo, hi = value * (r.lo / value) ** factor, value * (r.hi / value) ** factor
    else:
        lo, hi = value - factor * (value - r.lo), value + factor * (r.hi - value)
        lo = max(lo, r.lo / factor) if r.lo > 0 else lo
    if rule is not None:
        _, low, high, _ = rule
        lo, hi = max(lo, low), min(hi, high)
    return Range(lo, hi, r.distribution, r.causes, r.explicit)
