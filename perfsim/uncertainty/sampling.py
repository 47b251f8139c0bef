"""Quasi-random draws over a profile's ranges, and the predictions of every draw.

The cost code takes numpy arrays wherever it takes a device or framework number (their formulas
are arithmetic), but the collective model routes and picks algorithms per link configuration
and caches by it, so node, network and collectives numbers must be plain numbers. A draw
therefore pairs one of `comm_points` link configurations (a scrambled Sobol design over the link
dimensions) with its own device and framework numbers (a Sobol design over those dimensions):
draw i takes link configuration i mod comm_points. Each link configuration is one call of the
closed form with the device and framework numbers of its draws as arrays, so a prediction over
512 draws costs 64 closed-form evaluations, not 512.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from perfsim.predict import evaluate
from perfsim.spec.system import number_rule, number_value
from perfsim.uncertainty.ranges import FIXED_KEYS, default_range, widened

LINK_SECTIONS = ("node", "network", "collectives")
DEFAULT_SAMPLES = 512
DEFAULT_COMM_POINTS = 64


@dataclass(frozen=True)
class Draws:
    """`values[i, j]`: draw i's value of profile number `keys[j]`; `groups[i]`: draw i's link
    configuration; `factors[name]`: each named cause's factor per draw ("<key>.causes.<name>")."""
    system: object
    keys: tuple
    values: np.ndarray
    groups: np.ndarray
    factors: dict

    @property
    def n(self) -> int:
        return self.values.shape[0]

    def subset(self, rows) -> "Draws":
        rows = np.asarray(rows)
        return dataclasses.replace(self, values=self.values[rows], groups=self.groups[rows],
                                   factors={k: v[rows] for k, v in self.factors.items()})


def cache_folder() -> str:
    """Where draws' designs and conditioning are remembered: $PERFSIM_CACHE_DIR, else ~/.cache/perfsim."""
    return os.environ.get("PERFSIM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "perfsim")


def _unit(dimensions: int, n: int, seed: int) -> np.ndarray:
    """n points of a scrambled Sobol design in [0, 1)^dimensions (the first n of the next power of two).
    The design is remembered on disk (cache_folder, by dimensions, size, seed and scipy version):
    importing scipy.stats costs about two seconds, more than the rest of `predict --uncertainty`,
    so only a first run pays it. A cache that cannot be read or written is recomputed, never an error."""
    if dimensions == 0:
        return np.zeros((n, 0))
    m = max(int(np.ceil(np.log2(max(n, 2)))), 1)
    import scipy

    path = os.path.join(cache_folder(), f"sobol-{dimensions}d-2^{m}-seed{seed}-scipy{scipy.__version__}.npy")
    try:
        design = np.load(path)
        if design.shape == (2 ** m, dimensions):
            return design[:n]
    except (OSError, ValueError):
        pass
    from scipy.stats import qmc  # lazy: scipy.stats takes about two seconds to import

    design = qmc.Sobol(dimensions, scramble=True, seed=seed).random_base2(m)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.npy"
        np.save(temporary, design)
        os.replace(temporary, path)
    except OSError:
        pass
    return design[:n]


def _scaled(u: np.ndarray, lo: float, hi: float, distribution: str) -> np.ndarray:
    if distribution == "loguniform":
        return np.exp(np.log(lo) + u * (np.log(hi) - np.log(lo)))
    return lo + u * (hi - lo)


def profile_ranges(system, widen: float = 1.0) -> dict:
    """"section.key" -> Range for every number a sample varies: its own range or causes, else the
    default width of its provenance kind (each side `widen` times as far from the value). Counts,
    switches and capacities stay fixed."""
    out = {}
    for key, (provenance, _) in system.provenance.items():
        if key in FIXED_KEYS:
            continue
        value, rule = number_value(system, key), number_rule(key)
        if value is None:
            continue
        found = system.ranges.get(key) or default_range(value, provenance, rule)
        if found is not None and widen != 1.0:
            found = widened(found, value, widen, rule)
        if found is not None and found.hi > found.lo:
            out[key] = found
    return out


def draw(system, n: int = DEFAULT_SAMPLES, seed: int = 0, comm_points: int = DEFAULT_COMM_POINTS,
         ranges: dict | None = None) -> Draws:
    """n draws of every uncertain number of `system` (profile_ranges,
    or `ranges`), reproducible for a given seed."""
    ranges = profile_ranges(system) if ranges is None else ranges
    comm_points = max(1, min(comm_points, n))
    keys = tuple(ranges)
    # one dimension per number, or one per cause of a number that has causes
    dims = [(key, cause) for key in keys for cause in (ranges[key].causes or (None,))]
    link = [d for d in dims if d[0].split(".")[0] in LINK_SECTIONS]
    rest = [d for d in dims if d[0].split(".")[0] not in LINK_SECTIONS]
    groups = np.arange(n) % comm_points
    u_link = _unit(len(link), comm_points, seed)[groups]
    # Two Sobol designs paired by index would not be independent: every scrambled design orders its
    # first points by the same stratification, so dimension k of one tracks dimension k of the
    # other. A seeded random pairing keeps them independent.
    u_rest = _unit(len(rest), n, seed + 1)[np.random.default_rng(seed).permutation(n)]
    columns = dict(zip(link, u_link.T)) | dict(zip(rest, u_rest.T))
    values, factors = np.ones((n, len(keys))), {}
    for (key, cause), u in columns.items():
        j = keys.index(key)
        if cause is None:
            r = ranges[key]
            values[:, j] = _scaled(u, r.lo, r.hi, r.distribution)
        else:
            factor = _scaled(u, cause.lo, cause.hi, cause.distribution)
            factors[f"{key}.causes.{cause.name}"] = factor
            values[:, j] *= factor
    return Draws(system, keys, values, groups, factors)


def with_numbers(system, numbers: dict):
    """`system` with the numbers {"section.key" or "section.table.name": value} replaced."""
    sections = {}
    for key, value in numbers.items():
        section, _, name = key.partition(".")
        changes = sections.setdefault(section, {})
        name, _, entry = name.partition(".")
        if entry:  # an entry of a per-operation table: ((name, value), ...)
            table = dict(changes.get(name, getattr(getattr(system, section), name)))
            table[entry] = value
            changes[name] = tuple(table.items())
        else:
            changes[name] = value
    return dataclasses.replace(system, **{section: dataclasses.replace(getattr(system, section), **changes)
                                          for section, changes in sections.items()})


def group_systems(draws: Draws, repeat: int = 1):
    """(rows, system) per link configuration: the draws that share it, and a system whose link
    numbers are that configuration's and whose device and framework numbers are arrays over the
    rows (the array tiled `repeat` times, for `repeat` plans evaluated beside each other)."""
    for g in np.unique(draws.groups):
        rows = np.flatnonzero(draws.groups == g)
        numbers = {}
        for j, key in enumerate(draws.keys):
            column = draws.values[rows, j]
            numbers[key] = float(column[0]) if key.split(".")[0] in LINK_SECTIONS else np.tile(column, repeat)
        yield rows, with_numbers(draws.system, numbers)


def _broadcast(value, rows: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(value, dtype=float), (rows,))


def evaluate_draws(model, draws: Draws, columns, dtype: str = "bf16") -> dict:
    """predict.evaluate's numbers for one plan (`columns` of a single plan) under every draw:
    each a numpy array over the draws; time_breakdown_s and memory_bytes dicts of arrays."""
    out: dict = {}
    for rows, system in group_systems(draws):
        result = evaluate(model, system, columns, dtype)
        for key, value in result.items():
            if isinstance(value, dict):
                target = out.setdefault(key, {})
                for part, v in value.items():
                    target.setdefault(part, np.empty(draws.n))[rows] = _broadcast(v, rows.size)
            elif not isinstance(value, str) and np.asarray(value).dtype.kind in "fiub":
                out.setdefault(key, np.empty(draws.n))[rows] = _broadcast(value, rows.size)
    return out


def evaluate_plans(model, draws: Draws, plans, dtype: str = "bf16", parts: bool = False) -> dict:
    """Step time and peak memory of several plans under every draw, as (plans x draws) arrays;
    with `parts`, also tokens_per_s and time_breakdown_s (a dict of such arrays), for charts.
    Plans sharing a tensor-parallel mode, rank order and grid axes are priced in one call per link
    configuration: row (plan i, draw r) of the call is plan i's columns beside draw r's numbers."""
    from perfsim.cost.columns import columns_of_many

    out = {"step_time_s": np.empty((len(plans), draws.n)), "memory_total_bytes": np.empty((len(plans), draws.n))}
    if parts:
        out |= {"tokens_per_s": np.empty((len(plans), draws.n)), "time_breakdown_s": {}}
    families: dict = {}
    for i, plan in enumerate(plans):
        families.setdefault((plan.tp_mode, plan.order, plan.tp_axes), []).append(i)
    for members in families.values():
        base = columns_of_many([plans[i] for i in members])
        for rows, system in group_systems(draws, repeat=len(members)):
            columns = dataclasses.replace(base, **{f.name: np.repeat(getattr(base, f.name), rows.size)
                                                   for f in dataclasses.fields(base)
                                                   if isinstance(getattr(base, f.name), np.ndarray)})
            r = evaluate(model, system, columns, dtype)
            shape = (len(members), rows.size)
            out["step_time_s"][np.ix_(members, rows)] = _broadcast(r["step_time_s"], rows.size * len(members)).reshape(shape)
            out["memory_total_bytes"][np.ix_(members, rows)] = _broadcast(
                r["memory_bytes"]["total"], rows.size * len(members)).reshape(shape)
            if parts:
                out["tokens_per_s"][np.ix_(members, rows)] = _broadcast(r["tokens_per_s"], shape[0] * shape[1]).reshape(shape)
                for part, v in r["time_breakdown_s"].items():
                    target = out["time_breakdown_s"].setdefault(part, np.empty((len(plans), draws.n)))
                    target[np.ix_(members, rows)] = _broadcast(v, shape[0] * shape[1]).reshape(shape)
    return out
