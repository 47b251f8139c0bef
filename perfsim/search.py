"""Plan search: enumerate every plan for a model, system, device count and global batch, reject
the invalid ones by reason, evaluate the rest in vectorised batches, rank the ones that fit.

The space: tensor-parallel mode and size (1d with and without SP, 2d, 2.5d with every depth,
3d keeping or re-gathering), pipeline size, schedule (GPipe, 1F1B, interleaved with every chunk
count), context-parallel size (1d only, sequences of CONTEXT_PARALLEL_FROM tokens or more: see
`_context_sizes`), data-parallel size (the rest of the devices), ZeRO stage, micro-batch size
(divisors of the global batch), recomputation, attention kernel (unfused or flash), and rank
placement order.
Overlapped communication (dp_overlap with data parallelism, tp_overlap with 1d + SP) is never slower
in the model and changes no memory, so it is not a dimension of the space: a plan overlaps wherever
it can unless --fix turns it off. Validity rules are the vectorised twins of
spec.plan.plan_problems (tests/test_search.py checks they agree plan by plan).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from perfsim.cost.columns import INTERLEAVED, Columns
from perfsim.errors import PerfsimError
from perfsim.predict import evaluate, predict
from perfsim.spec.model import LARGEST_SIZE, ModelSpec
from perfsim.spec.plan import (ATTENTION, DIMENSIONS, MOE_DISPATCHERS, ORDERS, RECOMPUTE, SCHEDULES, TP_MODES, Plan,
                               canonical_order, edge_chunk_layers)
from perfsim.spec.system import System

INT_KNOBS = ("tp", "tp_depth", "cp", "pp", "vpp", "dp", "zero", "mbs", "first_stage_layers", "last_stage_layers",
             "ep", "etp")
BOOL_KNOBS = ("sp", "tp_regather", "dp_overlap", "tp_overlap", "ep_overlap")
TEXT_KNOBS = {"tp_mode": TP_MODES, "schedule": SCHEDULES, "recompute": RECOMPUTE, "order": ORDERS,
              "attention": ATTENTION, "moe_dispatcher": MOE_DISPATCHERS}
RANKINGS = ("throughput", "time-to-train", "device-hours", "memory-headroom")
BATCH = 1 << 20  # plans evaluated per vectorised call
MOST_CANDIDATES = 10_000_000  # before rank orders, about 100 bytes each (a 1T model on 3072 GPUs: 0.65 M)
MOST_SPLIT_COUNTS = 1_000  # layer counts one --fix first_stage_layers / last_stage_layers may allow
# Sequences from which the search tries context parallelism unasked (--fix cp=... tries it at any
# length): below, a rank's attention blocks are too short to hide the ring's transfers and the
# activations it divides rarely decide whether a plan fits (Megatron-Core and NeMo use it from 8k).
CONTEXT_PARALLEL_FROM = 8192
# Each whole-number knob's domain (inclusive); a --fix value outside it is a typo, not a wish. Sizes
# stop where the model's sizes do (spec.model.LARGEST_SIZE).
ZERO_STAGES = (0, 3)
LAYER_COUNT_KNOBS = ("first_stage_layers", "last_stage_layers")


def knob_domain(knob: str) -> tuple:
    """(lowest, highest) whole value a knob may take."""
    if knob == "zero":
        return ZERO_STAGES
    return (0 if knob in LAYER_COUNT_KNOBS else 1), LARGEST_SIZE


class WholeNumbers:
    """The allowed values of a whole-number knob as ranges, so that `pp=1..10**30` costs no more
    than `pp=1..32`: membership is arithmetic, nothing is listed."""

    def __init__(self, spans=()):
        self.spans = tuple(r for r in spans if r.start < r.stop)  # len() overflows past 2**63

    def __contains__(self, value) -> bool:
        return isinstance(value, (int, np.integer)) and any(int(value) in r for r in self.spans)

    def __or__(self, other: "WholeNumbers") -> "WholeNumbers":
        return WholeNumbers(self.spans + other.spans)

    def __and__(self, other: "WholeNumbers") -> "WholeNumbers":
        return WholeNumbers(range(max(a.start, b.start), min(a.stop, b.stop)) for a in self.spans for b in other.spans)

    def __bool__(self) -> bool:
        return bool(self.spans)


def parse_fixes(items: list[str]) -> dict:
    """`KNOB=VALUE`, `KNOB=V1,V2` or `KNOB=LOW..HIGH` (whole numbers; a range may be of any size)
    into knob -> allowed values (a set, or WholeNumbers for whole-number knobs)."""
    fixes: dict = {}
    for item in items:
        knob, sep, text = item.partition("=")
        knob = knob.strip().replace("-", "_")
        if not sep or not text:
            raise PerfsimError(f"--fix {item!r}: expected KNOB=VALUE, e.g. --fix tp_mode=1d --fix zero=1 --fix pp=8..32")
        values = WholeNumbers() if knob in INT_KNOBS else set()
        for part in text.split(","):
            part = part.strip()
            if knob in INT_KNOBS:
                low, dots, high = part.partition("..")
                try:
                    span = range(int(low), int(high) + 1) if dots else range(int(part), int(part) + 1)
                except ValueError:
                    raise PerfsimError(f"--fix {item!r}: {knob} takes whole numbers or LOW..HIGH") from None
                if span.start >= span.stop:
                    raise PerfsimError(f"--fix {item!r}: the range {part} is empty; write LOW..HIGH with LOW <= HIGH")
                lowest, highest = knob_domain(knob)
                if span.start < lowest or span.stop - 1 > highest:
                    raise PerfsimError(f"--fix {item!r}: {knob} takes whole numbers from {lowest} to {highest}")
                values |= WholeNumbers((span,))
            elif knob in BOOL_KNOBS:
                if part.lower() not in ("true", "false", "1", "0"):
                    raise PerfsimError(f"--fix {item!r}: {knob} takes true or false")
                values.add(part.lower() in ("true", "1"))
            elif knob in TEXT_KNOBS:
                if part not in TEXT_KNOBS[knob]:
                    raise PerfsimError(f"--fix {item!r}: {knob} must be one of {', '.join(TEXT_KNOBS[knob])}")
                values.add(part)
            else:
                known = ", ".join(INT_KNOBS + BOOL_KNOBS + tuple(TEXT_KNOBS))
                raise PerfsimError(f"--fix {item!r}: unknown knob {knob!r}; knobs: {known} (gbs is --gbs)")
        fixes[knob] = fixes[knob] & values if knob in fixes else values
        if not fixes[knob]:
            raise PerfsimError(f"--fix gives {knob} no value that all its --fix flags allow")
    return fixes


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) steps (a device count may be a large prime)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def allowed_values(fixes: dict, knob: str, values):
    return [v for v in values if knob not in fixes or v in fixes[knob]]


def _tp_configs(devices: int, fixes: dict) -> list[tuple]:
    """(mode, tp, depth, sp, regather) for every tensor-parallel layout with tp dividing devices."""
    configs = []
    for tp in allowed_values(fixes, "tp", divisors(devices)):
        if tp == 1:  # every mode is the same plan on one device: keep it once, as 1d
            configs.append(("1d", 1, 1, False, False))
            continue
        configs += [("1d", tp, 1, sp, False) for sp in (False, True)]
        q2 = round(tp ** 0.5)
        if q2 * q2 == tp:
            configs.append(("2d", tp, 1, False, False))
        q3 = round(tp ** (1 / 3))
        if q3 ** 3 == tp:
            configs += [("3d", tp, 1, False, regather) for regather in (False, True)]
        for q in range(math.isqrt(tp // 2), 1, -1):  # tp = q x q x depth with depth >= 2, shallowest first
            if tp % (q * q) == 0:
                configs.append(("2.5d", tp, tp // (q * q), False, False))
    if fixes.get("tp_overlap") == {True}:  # only 1d + SP can overlap its collectives with its GEMMs
        configs = [c for c in configs if c[3]]
    return [c for c in configs
            if ("tp_mode" not in fixes or c[0] in fixes["tp_mode"])
            and ("tp_depth" not in fixes or c[2] in fixes["tp_depth"])
            and ("sp" not in fixes or c[3] in fixes["sp"])
            and ("tp_regather" not in fixes or c[4] in fixes["tp_regather"])]


def _context_sizes(model: ModelSpec, mode: str, devices_left: int, fixes: dict) -> list[int]:
    """Context-parallel sizes to try beside a tensor-parallel layout leaving `devices_left`
    devices: 1, and with 1d tensor parallelism the divisors of devices_left that cut the sequence
    into 2 cp equal chunks, for sequences of CONTEXT_PARALLEL_FROM tokens or more; --fix cp=...
    tries its values at any length (those the sequence does not allow are rejected with a reason)."""
    if "cp" in fixes:
        return [cp for cp in divisors(devices_left) if cp in fixes["cp"] and (cp == 1 or mode == "1d")]
    if mode != "1d" or model.seq < CONTEXT_PARALLEL_FROM:
        return [1]
    return [cp for cp in divisors(devices_left) if model.seq % (2 * cp) == 0 or cp == 1]


def _schedules(model: ModelSpec, pp: int, fixes: dict) -> list[tuple]:
    """(schedule index, vpp): GPipe and 1F1B, and interleaved with every chunk count dividing the
    stage, or the middle stages of a split `_auto_splits` proposes. With one stage there is no
    pipeline: GPipe's order only keeps more micro-batches alive (same time, more memory), so it is
    a candidate only where --fix leaves no 1F1B."""
    out = [(SCHEDULES.index(s), 1) for s in ("gpipe", "1f1b")]
    if pp > 1:
        whole = [model.layers // pp] if model.layers % pp == 0 else []
        chunks = {v for n in whole + [middle for _, _, middle in _auto_splits(model.layers, pp)]
                  for v in divisors(n) if v > 1}
        out += [(SCHEDULES.index("interleaved"), v) for v in sorted(chunks)]
    allowed = [(s, v) for s, v in out if ("schedule" not in fixes or SCHEDULES[s] in fixes["schedule"])
               and ("vpp" not in fixes or v in fixes["vpp"])]
    return sorted(allowed, key=lambda sv: SCHEDULES[sv[0]] != "1f1b")[:1] if pp == 1 else allowed


@functools.lru_cache(maxsize=1024)
def _auto_splits(layers: int, pp: int) -> tuple:
    """(first, last, middle) layer counts of the uneven splits the search proposes on pp stages: the
    first and last stage lighter than the others, which keeps the embedding and the loss from making
    them the bottleneck, and pipelines layer counts pp does not divide (docs/equations.md 9.4).
    Two rules: the ends ceil(L / pp) - 1 each, the rest even over the middle stages where that
    divides (Llama 3 405B's 7 + 14 x 8 + 7 on pp 16); and the middle stages S = ceil((L + 2) / pp)
    each, the embedding and the loss counted as a layer, the rest over the ends, one or two layers
    lighter than S (126 layers on pp 8: 15 + 6 x 16 + 15, NVIDIA's Llama 3.1 405B recipe with
    interleaving; 61 on pp 8: 7 + 6 x 8 + 6, DeepSeek-V3's but for its MTP layer). None that is the even split."""
    out = []
    if pp > 2:
        ends = -(-layers // pp) - 1
        rest = layers - 2 * ends
        if ends >= 1 and rest % (pp - 2) == 0 and rest // (pp - 2) > ends:
            out.append((ends, ends, rest // (pp - 2)))
    if pp >= 2:
        share = -(-(layers + 2) // pp)
        rest = layers - (pp - 2) * share
        first, last = -(-rest // 2), rest // 2
        if 1 <= last and share - 2 <= last <= first <= share - 1:
            out.append((first, last, share))
    even = layers / pp  # a split giving every stage as many layers is the even one (pp 2 has no middle)
    return tuple(dict.fromkeys(split for split in out
                               if not (split[0] == split[1] == even and (pp == 2 or split[2] == even))))


def _pipeline_splits(model: ModelSpec, pp: int, vpp: int, fixes: dict) -> list[tuple]:
    """(first_stage_layers, last_stage_layers) to try: the even split (0, 0), and `_auto_splits`
    where its middle stages' layers fill the vpp chunks evenly and its ends' chunks fill (the chunk
    holding the embedding or the loss may hold fewer: spec.plan.edge_chunk_layers).
    --fix first_stage_layers / last_stage_layers tries every count it allows (0: as the other
    stages) with every count of the other end; the splits that do not divide are rejected."""
    auto = [(first, last) for first, last, middle in _auto_splits(model.layers, pp)
            if middle % vpp == 0 and edge_chunk_layers(first, vpp) >= 0 and edge_chunk_layers(last, vpp) >= 0]
    ends = auto[0][0] if auto else -(-model.layers // pp) - 1
    if "first_stage_layers" not in fixes and "last_stage_layers" not in fixes:
        return [(0, 0)] + auto

    def counts(knob):
        if knob not in fixes:
            return [0] + sorted({split[knob == "last_stage_layers"] for split in auto})
        spans = [range(max(r.start, 0), min(r.stop, model.layers + 1)) for r in fixes[knob].spans]
        if sum(len(r) for r in spans) > MOST_SPLIT_COUNTS:
            raise PerfsimError(f"--fix {knob} allows more than {MOST_SPLIT_COUNTS:,} layer counts; give a few, "
                               f"e.g. --fix {knob}=0,{max(ends, 1)}")
        return sorted({n for r in spans for n in r})

    return list(itertools.product(counts("first_stage_layers"), counts("last_stage_layers")))


def _expert_layouts(model: ModelSpec, tp: int, cp: int, dp: int, fixes: dict) -> list[tuple]:
    """(ep, etp, allgather, flex, ep_overlap) to try beside a tp x cp x dp stage of a mixture of
    experts (Megatron-Core's parallel folding): etp 1 or tp, every ep dividing the experts and the
    stage's tp x cp x dp / etp ranks, every dispatcher (flex where etp x ep > 1), and the all-to-alls
    overlapped or not (alltoall and flex, ep > 1); a dense model's one (1, tp, 0, 0, 0)."""
    if not model.moe:
        if ("ep" in fixes and 1 not in fixes["ep"]) or fixes.get("ep_overlap") == {True}:
            raise PerfsimError(f"--fix ep and ep_overlap split a mixture of experts; {model.name} is dense (no experts)")
        return [(1, tp, 0, 0, 0)]
    out = []
    ranks = tp * cp * dp
    for etp in allowed_values(fixes, "etp", sorted({1, tp})):
        for ep in allowed_values(fixes, "ep", divisors(ranks // etp) if ranks % etp == 0 else []):
            if model.experts % ep or model.expert_ffn % etp:
                continue
            for dispatcher in allowed_values(fixes, "moe_dispatcher", MOE_DISPATCHERS):
                if dispatcher == "flex" and etp * ep < 2:  # DeepEP needs a group of two or more
                    continue
                overlaps = (False, True) if ep > 1 and dispatcher != "allgather" else (False,)
                for overlap in allowed_values(fixes, "ep_overlap", overlaps):
                    out.append((ep, etp, int(dispatcher == "allgather"), int(dispatcher == "flex"), int(overlap)))
    return out


def candidates(model: ModelSpec, devices: int, gbs: int, fixes: dict):
    """Yield (tp_mode, columns of numpy arrays) for the whole raw space but the rank order, by mode.
    Without data or context parallelism the ZeRO stage changes nothing (one replica has nothing to
    shard), so such plans come once, with the lowest stage --fix allows."""
    # a mixture of experts runs beside 1d TP (with SP where tp > 1) and ZeRO 0 or 1, latent attention
    # beside 1d TP (spec.plan)
    zeros = allowed_values(fixes, "zero", (0, 1) if model.moe else (0, 1, 2, 3))
    recomputes = [RECOMPUTE.index(r) for r in allowed_values(fixes, "recompute", RECOMPUTE)]
    kernels = [ATTENTION.index(a) for a in allowed_values(fixes, "attention", ATTENTION)]
    overlap = {knob: int(True in fixes.get(knob, {True})) for knob in ("dp_overlap", "tp_overlap")}
    mbs_all = allowed_values(fixes, "mbs", divisors(gbs))
    by_mode: dict = {}
    count = 0
    for mode, tp, depth, sp, regather in _tp_configs(devices, fixes):
        if ((model.moe or model.mla) and mode != "1d") or (model.moe and tp > 1 and not sp):
            continue
        for cp, pp in ((cp, pp) for cp in _context_sizes(model, mode, devices // tp, fixes)
                       for pp in allowed_values(fixes, "pp", divisors(devices // (tp * cp)))):
            dp = devices // (tp * cp * pp)
            if "dp" in fixes and dp not in fixes["dp"]:
                continue
            schedules = _schedules(model, pp, fixes)
            splits = {vpp: _pipeline_splits(model, pp, vpp, fixes) for _, vpp in schedules}
            experts = _expert_layouts(model, tp, cp, dp, fixes)
            count += sum(len(splits[vpp]) for _, vpp in schedules) * len(mbs_all) * (len(zeros) if dp * cp > 1 else 1) \
                * len(recomputes) * len(kernels) * len(experts)
            if count > MOST_CANDIDATES:
                raise PerfsimError(f"the search space for {devices:,} devices and global batch {gbs:,} holds more than "
                                   f"{MOST_CANDIDATES:,} candidate plans (the most perfsim searches); narrow it with "
                                   "--fix, e.g. --fix tp=1..8 --fix mbs=1..4 --fix zero=1")
            for (schedule, vpp), mbs, expert in itertools.product(schedules, mbs_all, experts):
                for first, last in splits[vpp]:
                    by_mode.setdefault(mode, []).append((tp, depth, int(sp), int(regather), pp, dp, schedule, vpp, mbs, cp,
                                                         first, last) + expert)
    for mode, rows in by_mode.items():
        head = np.array(rows, dtype=float)
        inner = np.array(list(itertools.product(zeros, recomputes, kernels)), dtype=float).reshape(-1, 3)
        table = np.repeat(head, len(inner), axis=0)
        tail = np.tile(inner, (len(head), 1))
        cols = dict(zip(("tp", "tp_depth", "sp", "regather", "pp", "dp", "schedule", "vpp", "mbs", "cp",
                         "first_layers", "last_layers", "ep", "etp", "allgather", "flex", "ep_overlap"), table.T))
        cols.update(zero=tail[:, 0], recompute=tail[:, 1], flash=tail[:, 2], gbs=np.full(len(table), float(gbs)),
                    dp_overlap=overlap["dp_overlap"] * (cols["dp"] * cols["cp"] > 1),
                    tp_overlap=overlap["tp_overlap"] * (cols["sp"] == 1) * (mode == "1d"))
        keep = (cols["dp"] * cols["cp"] > 1) | (cols["zero"] == zeros[0])
        yield mode, {k: v[keep] for k, v in cols.items()}


def order_rows(cols: dict, orders) -> dict:
    """For each rank order of `orders`, the rows (a mask) it is a candidate for: orders that differ
    only in where size-1 dimensions sit number the ranks alike, so a row takes the first of them."""
    block = {"tp": np.asarray(cols["tp"]) * np.asarray(cols["cp"])}  # cp rides right after tp
    sizes = [block.get(d, np.asarray(cols[d])) > 1 for d in DIMENSIONS]
    pattern = sum(big.astype(int) << k for k, big in enumerate(sizes))
    rows = {}
    for order in orders:
        canonical_in = [p for p in range(1 << len(DIMENSIONS))
                        if canonical_order(order, *(2 if p >> k & 1 else 1 for k in range(len(DIMENSIONS))),
                                           orders=orders) == order]
        rows[order] = np.isin(pattern, canonical_in)
    return rows


def rejection_reasons(model: ModelSpec, mode: str, cols: dict) -> list[tuple[str, np.ndarray]]:
    """(reason, invalid mask) in the order plan_problems checks them; the first that applies counts."""
    tp, pp, dp, mbs, vpp, gbs = (cols[k] for k in ("tp", "pp", "dp", "mbs", "vpp", "gbs"))
    reasons = []
    if mode == "1d":
        reasons.append(("tp does not divide the attention heads", (model.heads % tp != 0)
                        | (model.kv_head_count % tp != 0)))
        reasons.append(("tp does not divide the MLP width", model.ffn_size % tp != 0))
        reasons.append(("sequence parallelism: tp does not divide the sequence",
                        (cols["sp"] == 1) & (model.seq % (tp * cols["cp"]) != 0)))
        reasons.append(("context parallelism: the sequence is not a multiple of 2 x cp",
                        (cols["cp"] > 1) & (model.seq % (2 * cols["cp"]) != 0)))
    else:
        depth = cols["tp_depth"]
        q = np.rint(np.cbrt(tp)) if mode == "3d" else np.rint(np.sqrt(tp / depth))
        rows = q * q if mode == "3d" else (depth * q if mode == "2.5d" else q)
        weight_rows = q * q if mode == "3d" else q
        reasons.append((f"{mode}: the micro-batch is not divisible by the grid's row split", mbs % rows != 0))
        reasons.append((f"{mode}: the grid does not divide hidden or MLP width",
                        (model.hidden % weight_rows != 0) | (model.ffn_size % weight_rows != 0)))
        reasons.append((f"{mode}: the grid does not divide the heads", (model.heads % q != 0) | (model.kv_head_count % q != 0)))
    first, last = cols["first_layers"], cols["last_layers"]
    others = pp - (first > 0) - (last > 0)
    rest = model.layers - first - last
    spread = others * vpp  # the other stages' chunks
    uneven_misfit = np.where(others == 0, rest != 0, (rest < spread) | (rest % np.maximum(spread, 1) != 0))
    unfilled = ((first > 0) & (edge_chunk_layers(first, vpp) < 0)) | ((last > 0) & (edge_chunk_layers(last, vpp) < 0))
    reasons.append(("uneven pipeline split: needs pp 2 or more, the other layers even over the other stages and "
                    "their chunks, the end stages' chunks filled",
                    ((first > 0) | (last > 0)) & ((pp < 2) | uneven_misfit | unfilled)))
    reasons.append(("pp x vpp does not divide the layers", (model.layers % (pp * vpp) != 0)
                    & (cols["first_layers"] == 0) & (cols["last_layers"] == 0)))
    reasons.append(("the interleaved schedule needs pp of 2 or more", (cols["schedule"] == INTERLEAVED) & (pp < 2)))
    reasons.append(("global batch not divisible by mbs x dp", gbs % (mbs * dp) != 0))
    micro = gbs // (mbs * dp)
    reasons.append(("interleaved: micro-batches not a multiple of pp",
                    (cols["schedule"] == INTERLEAVED) & (micro % pp != 0)))
    return reasons


@dataclass
class ModeCandidates:
    """The candidates of one tensor-parallel mode, classified: the first rejection reason each
    invalid row fails (the charts count them by cell)."""
    mode: str
    cols: dict  # every candidate of the mode (numpy columns)
    order_rows: dict  # rank order -> the rows it is a candidate for (order_rows)
    reasons: list  # rejection reasons, in the order plan_problems checks them
    first_reason: np.ndarray  # per row, the index into `reasons` of the first it fails; -1 for a valid row

    def rejections(self):
        """(reason, rows that fail it and none before it), for the reasons some row fails first."""
        for j in np.unique(self.first_reason[self.first_reason >= 0]):
            yield self.reasons[j], self.first_reason == j


@dataclass
class Batch:
    """At most BATCH valid plans of one mode and rank order, and what evaluate makes of them."""
    mode: str
    order: str
    cols: dict  # the plans' numpy columns (plan_at reads them)
    columns: Columns  # the same as the cost layer reads them
    result: dict  # evaluate's


class PlanSpace:
    """Every plan for a model, device count, global batch and --fix: classified once, then walked
    batch by batch. The one loop behind search, the robust search (perfsim.uncertainty.robust) and
    the charts' sweep (perfsim.charts.space)."""

    def __init__(self, model: ModelSpec, devices: int, gbs: int, fixes: dict):
        self.model = model
        orders = allowed_values(fixes, "order", TEXT_KNOBS["order"])
        self.modes = []
        self.rejected: dict = {}  # reason -> candidates it rejects, each rank order counted
        self.candidates = 0  # the space, each rank order a row stands for counted
        for mode, cols in candidates(model, devices, gbs, fixes):
            rows = order_rows(cols, orders)
            times = sum(mask.astype(int) for mask in rows.values())  # the rank orders each row stands for
            self.candidates += int(times.sum())
            named = rejection_reasons(model, mode, cols)
            first = np.full(len(cols["tp"]), -1, dtype=np.int8)
            for j, (_, mask) in enumerate(named):
                first[mask & (first < 0)] = j
            invalid = first >= 0
            rows_failing = np.bincount(first[invalid], minlength=len(named))
            counts = np.bincount(first[invalid], weights=times[invalid], minlength=len(named))
            for (reason, _), failing, n in zip(named, rows_failing, counts):
                if failing:
                    self.rejected[reason] = self.rejected.get(reason, 0) + int(n)
            self.modes.append(ModeCandidates(mode, cols, rows, [reason for reason, _ in named], first))

    def valid(self):
        """(mode, order, columns of at most BATCH valid plans) for every rank order of every mode
        and the valid rows it is a candidate for."""
        for m in self.modes:
            for order, mask in m.order_rows.items():
                valid = np.flatnonzero(mask & (m.first_reason < 0))
                for chunk in range(0, len(valid), BATCH):
                    index = valid[chunk: chunk + BATCH]
                    yield m.mode, order, {k: v[index] for k, v in m.cols.items()}

    def batches(self, system: System, dtype: str = "bf16", fitting_only: bool = False):
        """Every valid plan evaluated on `system`, a Batch at a time; `fitting_only`: the time of
        those that fit in memory alone (predict.evaluate)."""
        for mode, order, cols in self.valid():
            columns = to_columns(mode, order, cols)
            yield Batch(mode, order, cols, columns, evaluate(self.model, system, columns, dtype, fitting_only))


@dataclass
class SearchResult:
    evaluated: int
    feasible: int
    rejected: dict
    plans: list = field(default_factory=list)  # Predictions, best first
    pareto: list = field(default_factory=list)  # Predictions: no other plan is faster and smaller
    seconds: float = 0.0
    candidates: int = 0


def plan_at(mode: str, order: str, cols: dict, i: int) -> Plan:
    return Plan(tp=int(cols["tp"][i]), tp_mode=mode, tp_depth=int(cols["tp_depth"][i]), sp=bool(cols["sp"][i]),
                pp=int(cols["pp"][i]), vpp=int(cols["vpp"][i]), schedule=SCHEDULES[int(cols["schedule"][i])],
                dp=int(cols["dp"][i]), zero=int(cols["zero"][i]), mbs=int(cols["mbs"][i]), gbs=int(cols["gbs"][i]),
                recompute=RECOMPUTE[int(cols["recompute"][i])], order=order, tp_regather=bool(cols["regather"][i]),
                attention=ATTENTION[int(cols["flash"][i])], dp_overlap=bool(cols["dp_overlap"][i]),
                tp_overlap=bool(cols["tp_overlap"][i]), cp=int(cols["cp"][i]),
                first_stage_layers=int(cols["first_layers"][i]), last_stage_layers=int(cols["last_layers"][i]),
                **_expert_fields(cols, i))


def _expert_fields(cols: dict, i: int) -> dict:
    """Plan fields ep, etp (0 where it is tp), moe_dispatcher and ep_overlap of row i (columns that
    a batch built without them holds as single numbers, or not at all: a dense model's)."""
    at = lambda name, default: np.asarray(cols.get(name, default))[i] if np.ndim(cols.get(name, default)) \
        else cols.get(name, default)  # noqa: E731
    tp, ep, etp = at("tp", 1), at("ep", 1), at("etp", 0)
    return {"ep": int(ep), "etp": 0 if etp in (0, tp) else int(etp),
            "moe_dispatcher": MOE_DISPATCHERS[2 if at("flex", 0) else int(at("allgather", 0))],
            "ep_overlap": bool(at("ep_overlap", 0))}


def to_columns(mode: str, order: str, cols: dict) -> Columns:
    """Candidate columns (one tensor-parallel mode and rank order) as the cost layer reads them."""
    return Columns(tp=cols["tp"], pp=cols["pp"], dp=cols["dp"], vpp=cols["vpp"], mbs=cols["mbs"], gbs=cols["gbs"],
                   sp=cols["sp"], zero=cols["zero"], recompute=cols["recompute"], schedule=cols["schedule"],
                   tp_depth=cols["tp_depth"], regather=cols["regather"], flash=cols["flash"],
                   dp_overlap=cols["dp_overlap"], tp_overlap=cols["tp_overlap"], cp=cols["cp"],
                   first_layers=cols["first_layers"], last_layers=cols["last_layers"], ep=cols["ep"], etp=cols["etp"],
                   allgather=cols["allgather"], flex=cols.get("flex", 0), ep_overlap=cols["ep_overlap"], tp_mode=mode,
                   order=order)


def _score(rank: str, r: dict, capacity: float):
    if rank == "memory-headroom":
        return capacity - r["memory_bytes"]["total"]
    return r["tokens_per_s"]  # for a fixed device count, time-to-train and device-hours rank the same


# Training precisions `--dtype any` explores: bf16 everywhere, fp8 where the profile has an FP8 peak.
ANY_PRECISION = ("bf16", "fp8")


def precisions(system: System, dtypes) -> tuple:
    """The dtypes a search runs: `dtypes` as given, "any" standing for ANY_PRECISION less fp8 on a
    device without an FP8 peak."""
    chosen = []
    for d in dtypes:
        for x in (ANY_PRECISION if d == "any" else (d,)):
            if x not in chosen and not (d == "any" and x == "fp8" and system.device.peak_flops_fp8 is None):
                chosen.append(x)
    return tuple(chosen)


def search_precisions(model: ModelSpec, system: System, devices: int, gbs: int, dtypes, fixes: dict | None = None,
                      top: int = 10, rank: str = "throughput", progress=None) -> SearchResult:
    """`search` in each training dtype (precisions), the plans of all ranked together and one
    Pareto front over them; a plan's prediction says its dtype. One dtype: `search` itself."""
    runs = [search(model, system, devices, gbs, fixes, top, rank, d, progress) for d in precisions(system, dtypes)]
    if len(runs) == 1:
        return runs[0]
    capacity = system.device.memory_bytes
    score = (lambda p: capacity - p.memory_bytes["total"]) if rank == "memory-headroom" else (lambda p: p.tokens_per_s)
    everything = [p for r in runs for p in r.plans]
    front = [p for r in runs for p in r.pareto]
    front = [p for p in front if not any(q.tokens_per_s > p.tokens_per_s and q.memory_bytes["total"] < p.memory_bytes["total"]
                                         for q in front)]
    rejected: dict = {}
    for r in runs:
        for reason, n in r.rejected.items():
            rejected[reason] = rejected.get(reason, 0) + n
    return SearchResult(evaluated=sum(r.evaluated for r in runs), feasible=sum(r.feasible for r in runs),
                        rejected=rejected, plans=sorted(everything, key=score, reverse=True)[:top],
                        pareto=sorted(front, key=lambda p: p.tokens_per_s, reverse=True),
                        seconds=sum(r.seconds for r in runs), candidates=sum(r.candidates for r in runs))


def search(model: ModelSpec, system: System, devices: int, gbs: int, fixes: dict | None = None, top: int = 10,
           rank: str = "throughput", dtype: str = "bf16", progress=None) -> SearchResult:
    fixes = fixes or {}
    if rank not in RANKINGS:
        raise PerfsimError(f"rank must be one of {', '.join(RANKINGS)}, got {rank!r}")
    start = time.perf_counter()
    evaluated = feasible = 0
    kept = []  # (score, mode, order, cols, index, tokens/s, memory) of each batch's best and Pareto points
    space = PlanSpace(model, devices, gbs, fixes)
    rejected = dict(space.rejected)
    for batch in space.batches(system, dtype, fitting_only=True):  # only plans that fit are ranked
        r, mode, order, sub = batch.result, batch.mode, batch.order, batch.cols
        evaluated += len(sub["tp"])
        fits = np.asarray(r["fits"], dtype=bool)
        if (~fits).any():
            too_big = "does not fit in device memory"
            rejected[too_big] = rejected.get(too_big, 0) + int((~fits).sum())
        feasible += int(fits.sum())
        ok = np.flatnonzero(fits)
        if len(ok):
            score = np.asarray(_score(rank, r, system.device.memory_bytes))[ok]
            speed, memory = np.asarray(r["tokens_per_s"])[ok], np.asarray(r["memory_bytes"]["total"])[ok]
            best = ok[np.argsort(-score, kind="stable")[:top]] if len(ok) > top else ok
            chosen = set(best.tolist()) | set(ok[pareto_front(speed, memory)].tolist())
            position = {int(i): j for j, i in enumerate(ok)}
            kept += [(float(score[position[i]]), mode, order, sub, i, float(speed[position[i]]),
                      float(memory[position[i]])) for i in chosen]
        if progress and space.candidates > 1_000_000:
            progress(f"search: {evaluated:,} valid plans evaluated ({mode}, order {order})")
    seconds = time.perf_counter() - start
    if feasible == 0:
        raise PerfsimError(nothing_fits(evaluated, rejected, devices, gbs))
    kept.sort(key=lambda k: -k[0])
    plans = [predict(model, system, plan_at(m, o, s, i), dtype) for _, m, o, s, i, _, _ in kept[:top]]
    speed = np.array([k[5] for k in kept])
    memory = np.array([k[6] for k in kept])
    front = sorted((kept[i] for i in pareto_front(speed, memory)), key=lambda k: k[6])
    pareto = [predict(model, system, plan_at(m, o, s, i), dtype) for _, m, o, s, i, _, _ in front]
    return SearchResult(evaluated, feasible, rejected, plans, pareto, seconds, space.candidates)


def pareto_front(speed: np.ndarray, memory: np.ndarray) -> np.ndarray:
    """Indices of points no other point beats in both throughput (higher) and memory (lower)."""
    order = np.lexsort((-speed, memory))
    best = np.maximum.accumulate(speed[order])
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = speed[order][1:] > best[:-1]
    return order[keep]


def nothing_fits(evaluated: int, rejected: dict, devices: int, gbs: int) -> str:
    top = ", ".join(f"{reason} ({count:,})" for reason, count in sorted(rejected.items(), key=lambda kv: -kv[1])[:3])
    if not rejected:
        return (f"no valid plan for {devices} devices and global batch {gbs}: the --fix values (and plan flags) "
                "given leave no candidate (say, tp 1 with sp, or a tp or pp that does not divide the devices); relax them")
    if evaluated == 0:
        return (f"no valid plan for {devices} devices and global batch {gbs}: every candidate was rejected ({top}); "
                "relax --fix, or change the device count or --gbs")
    return (f"none of the {evaluated:,} valid plans fits in device memory ({top}); use more devices, "
            "a smaller --gbs, or allow recomputation and higher ZeRO stages")


def stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
