"""One pass over a search space for the charts, and the plans the what-if chart keeps.

`sweep` walks the same space as `perfsim.search.search` (its PlanSpace, evaluated in the same
vectorised batches) and hands every batch to consumers, so that one pass feeds several charts:
`PlanPool` keeps the plans that can be best when the hardware changes, `heatmap.Grid` reduces the
batches to cells.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfsim.errors import PerfsimError
from perfsim.predict import evaluate
from perfsim.search import Batch, PlanSpace, pareto_front, plan_at, to_columns
from perfsim.spec.model import ModelSpec
from perfsim.spec.system import System


def sweep(model: ModelSpec, system: System, devices: int, gbs: int, fixes: dict | None = None,
          dtype: str = "bf16", consumers=()) -> dict:
    """Evaluate every valid plan once (search.PlanSpace), handing each mode's ModeCandidates, then
    each Batch, to every consumer's `add`. Returns counts: candidates, evaluated, feasible."""
    space = PlanSpace(model, devices, gbs, fixes or {})
    counts = {"candidates": space.candidates, "evaluated": 0, "feasible": 0}
    for event in space.modes:
        for c in consumers:
            c.add(event)
    for batch in space.batches(system, dtype):
        counts["evaluated"] += len(batch.cols["tp"])
        counts["feasible"] += int(np.count_nonzero(batch.result["fits"]))
        for c in consumers:
            c.add(batch)
    return counts


def _top(score: np.ndarray, among: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k highest scores among the indices `among`."""
    if len(among) <= k:
        return among
    part = np.argpartition(-score[among], k - 1)[:k]
    return among[part]


class PlanPool:
    """The plans that can be best when the hardware changes: the `keep` fastest that fit, the
    `keep` fastest of all valid plans (they may fit when memory grows) and the Pareto front of
    throughput against memory over all valid plans (the best plan for any smaller memory)."""

    def __init__(self, keep: int = 1000):
        self.keep = keep
        self._parts = []  # (mode, order, cols subset, speed, memory, fits)

    def _select(self, speed, memory, fits) -> np.ndarray:
        everything = np.arange(len(speed))
        chosen = {*_top(speed, np.flatnonzero(fits), self.keep).tolist(), *_top(speed, everything, self.keep).tolist(),
                  *pareto_front(speed, memory).tolist()}
        return np.array(sorted(chosen), dtype=int)

    def add(self, event) -> None:
        if not isinstance(event, Batch):
            return
        r = event.result
        speed = np.asarray(r["tokens_per_s"], float)
        memory = np.asarray(r["memory_bytes"]["total"], float)
        fits = np.asarray(r["fits"], bool)
        pick = self._select(speed, memory, fits)
        self._parts.append((event.mode, event.order, {k: v[pick] for k, v in event.cols.items()},
                            speed[pick], memory[pick], fits[pick]))

    def groups(self) -> list:
        """The kept plans as [(mode, order, cols)], one entry per mode and rank order."""
        if not self._parts:
            return []
        speed = np.concatenate([p[3] for p in self._parts])
        memory = np.concatenate([p[4] for p in self._parts])
        fits = np.concatenate([p[5] for p in self._parts])
        keep = set(self._select(speed, memory, fits).tolist())
        grouped: dict = {}
        offset = 0
        for mode, order, cols, s, _, _ in self._parts:
            rows = [i - offset for i in range(offset, offset + len(s)) if i in keep]
            offset += len(s)
            if rows:
                grouped.setdefault((mode, order), []).append({k: v[rows] for k, v in cols.items()})
        return [(mode, order, {k: np.concatenate([c[k] for c in parts]) for k in parts[0]})
                for (mode, order), parts in grouped.items()]


@dataclass
class Best:
    """The fastest plan of a pool that fits, on one system."""
    plan: object
    tokens_per_s: float
    step_time_s: float
    mfu: float
    memory_bytes: float
    breakdown_s: dict


def evaluate_pool(model: ModelSpec, system: System, groups: list, dtype: str = "bf16") -> list:
    """Every pool plan evaluated on `system`: one result dict per group (vectorised)."""
    return [evaluate(model, system, to_columns(mode, order, cols), dtype) for mode, order, cols in groups]


def pick(groups: list, results: list, g: int, i: int) -> Best:
    """Plan i of group g with its numbers from `results`."""
    mode, order, cols = groups[g]
    r = results[g]
    shape = np.shape(cols["tp"])
    value = lambda x: float(np.broadcast_to(np.asarray(x, float), shape)[i])  # noqa: E731
    return Best(plan=plan_at(mode, order, cols, i), tokens_per_s=value(r["tokens_per_s"]),
                step_time_s=value(r["step_time_s"]), mfu=value(r["mfu"]), memory_bytes=value(r["memory_bytes"]["total"]),
                breakdown_s={k: value(v) for k, v in r["time_breakdown_s"].items()})


def _fits(r: dict, capacity: float | None) -> np.ndarray:
    speed = np.asarray(r["tokens_per_s"], float).reshape(-1)
    if capacity is None:
        return np.broadcast_to(np.asarray(r["fits"], bool), speed.shape)
    return np.broadcast_to(np.asarray(r["memory_bytes"]["total"], float) <= capacity, speed.shape)


def best_index(results: list, capacity: float | None = None) -> tuple | None:
    """(group, index) of the fastest plan that fits (in `capacity` bytes when given, else in the
    evaluated system's device memory), or None when none fits."""
    best = None
    for g, r in enumerate(results):
        if r is None:  # a group not evaluated
            continue
        speed = np.asarray(r["tokens_per_s"], float).reshape(-1)
        fits = _fits(r, capacity)
        if fits.any():
            i = int(np.flatnonzero(fits)[np.argmax(speed[fits])])
            if best is None or speed[i] > best[0]:
                best = (float(speed[i]), g, i)
    return None if best is None else best[1:]


def fastest_fitting(groups: list, results: list, keep: int) -> list:
    """The groups cut down to the `keep` fastest plans that fit (as evaluated in `results`)."""
    speed = np.concatenate([np.asarray(r["tokens_per_s"], float).reshape(-1) for r in results])
    fits = np.concatenate([_fits(r, None) for r in results])
    chosen = np.zeros(len(speed), bool)
    chosen[_top(speed, np.flatnonzero(fits), keep)] = True
    out, offset = [], 0
    for mode, order, cols in groups:
        n = len(cols["tp"])
        rows = np.flatnonzero(chosen[offset: offset + n])
        offset += n
        if len(rows):
            out.append((mode, order, {k: v[rows] for k, v in cols.items()}))
    return out


def best_of(model: ModelSpec, system: System, groups: list, dtype: str = "bf16") -> Best | None:
    """The pool's fastest plan that fits in `system`'s device memory, or None when none fits."""
    results = evaluate_pool(model, system, groups, dtype)
    where = best_index(results)
    return None if where is None else pick(groups, results, *where)


def plan_pool(model: ModelSpec, system: System, devices: int, gbs: int, fixes: dict | None = None,
              dtype: str = "bf16", keep: int = 1000) -> tuple:
    """(groups, counts): the what-if pool of a case, and the sweep's counts."""
    pool = PlanPool(keep)
    counts = sweep(model, system, devices, gbs, fixes, dtype, [pool])
    if counts["evaluated"] == 0:
        raise PerfsimError(f"no valid plan for {devices} devices and global batch {gbs}; change the device count, "
                           "--gbs or --fix")
    return pool.groups(), counts
