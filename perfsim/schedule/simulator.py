"""Event simulation of one training step (docs/simulator.md).

One timeline per pipeline stage: the ranks of a tensor-parallel group, and the data-parallel
replicas of a stage, run the same tasks at the same times, so one representative rank per stage
stands for all of them (docs/simulator.md says where that is not exact). Each stage has a compute
stream (forward, backward, recomputation and weight-gradient passes, with the tensor-parallel
collectives and the blocking pipeline sends between them, as in Megatron-LM) and a data-parallel
stream (ZeRO-3 weight prefetch, bucketed gradient reduction). Pipeline sends, data-parallel and
cross-node tensor-parallel collectives, and the tied-embedding all-reduce are transfers: where
they cross a node boundary they use the NIC of the rank's node, and transfers of different kinds
on one NIC share it (engine.py).

Every duration comes from the cost layer: `stage_costs` and `stage_phases` per micro-batch,
the collectives of `data_parallel`, the optimizer step; nothing is re-derived here.

`simulate(model, system, plan)` runs a plan; `step_costs` and `run_step` are the two halves, so
that tests can hand the simulator stage times of their own.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from perfsim.cost.columns import Columns, at_dtype, columns_of, stage_layer_count
from perfsim.cost.contention import overlap_efficiency
from perfsim.cost.data_parallel import (fsdp2_copy_times, is_fsdp2, optimizer_time, step_reduction_time,
                                        tied_embedding_time, zero3_gathers, zero3_units, zero_microbatch_times)
from perfsim.cost.fp8 import weight_cast_time
from perfsim.cost.grad_passes import grad_buffer_pass_time
from perfsim.cost.host import shown_step_overhead
from perfsim.cost.overlap import overlapped_exposure
from perfsim.cost.memory import stage_params
from perfsim.cost.stage import StageCosts, StagePhase, chunk_times, stage_costs, stage_phases
from perfsim.cost.synchrony import expected_max_normal, rank_jitter, synchronised_ranks
from perfsim.cost.topology import TopologyCommModel, nic_of
from perfsim.errors import PerfsimError
from perfsim.schedule import engine
from perfsim.schedule.analytic import BREAKDOWN_KEYS, replicated_stage_grad_time
from perfsim.schedule.orders import SIMULATED_SCHEDULES, B, F, W, stage_order
from perfsim.spec.model import ModelSpec
from perfsim.spec.system import System, for_dtype

POSITIONS = ("first", "middle", "last")
ZERO_BUBBLE_ONE_CHUNK = "zb-h1 has one chunk per stage: leave out --vpp and --schedule interleaved"
# Kinds of time (the breakdown keys, less pp_bubble) and the timeline rows they are drawn on.
COMPUTE, RECOMPUTE, TP, PP, DP, OPTIMIZER, OTHER = "compute", "recompute", "tp_comm", "pp_comm", "dp_comm", \
    "optimizer", "other"
CP = "cp_comm"  # ring attention's exposed waits, on the compute stream (context parallelism)
SYNC = "synchrony"  # the job's wait for its slowest rank at the optimizer step (cost/synchrony.py)
EP = "ep_comm"  # a MoE layer's dispatch and combine all-to-alls, on a stream of their own (cost/experts.py)
LANES = ("compute", "tp", "pp", "dp", "cp", "ep")
LANE_OF = {COMPUTE: 0, RECOMPUTE: 0, TP: 1, PP: 2, DP: 3, OPTIMIZER: 0, OTHER: 0, CP: 4, SYNC: 0, EP: 5}
# Traffic classes: transfers of one class never slow each other down further (engine.py).
PP_FORWARD, PP_BACKWARD, DP_TRAFFIC, TP_TRAFFIC, TIED_TRAFFIC = 1, 2, 3, 4, 5


@dataclass
class StepCosts:
    """Everything the simulation of one step needs, in seconds; per-position values are dicts over
    POSITIONS ("first", "middle", "last": a stage's time per micro-batch, all its chunks together;
    with p = 1 only "first" is used, and holds the whole model), or over a layout's stages
    ("stage 0" ... as `positions` names them, cost/pipeline.py)."""

    schedule: str
    p: int
    m: int
    v: int
    layers: int
    forward_compute: dict
    forward_tp: dict
    recompute: dict
    backward_compute: dict   # input and weight gradient together
    backward_tp: dict
    weight_grad: dict        # the weight-gradient part of backward_compute (W of zb-h1)
    hop_s: float             # one pipeline send
    dp: int = 1              # the group gradients are reduced over: dp x cp
    zero: int = 0
    forward_cp: dict = field(default_factory=lambda: dict.fromkeys(POSITIONS, 0.0))  # ring attention's
    backward_cp: dict = field(default_factory=lambda: dict.fromkeys(POSITIONS, 0.0))  # exposed waits (backward:
    # recomputation's included)
    # a MoE model's all-to-alls not hidden, forward and backward (recomputation's included)
    forward_ep: dict = field(default_factory=lambda: dict.fromkeys(POSITIONS, 0.0))
    backward_ep: dict = field(default_factory=lambda: dict.fromkeys(POSITIONS, 0.0))
    dp_overlap: float = 0.0
    # collectives.overlap_efficiency: the share of overlapped gradient buckets that their pass's
    # compute hides; the rest lengthens the pass (_contention)
    overlap_efficiency: float = 1.0
    reduction_rest: dict = field(default_factory=dict)     # ZeRO-0/1, after the last backward
    reduction_bucket: dict = field(default_factory=dict)   # ZeRO-0/1, one bucket during it
    scatter_rest: dict = field(default_factory=dict)       # ZeRO-2, per chunk and micro-batch
    scatter_bucket: dict = field(default_factory=dict)     # ZeRO-2/3, one bucket of it
    gather: dict = field(default_factory=dict)             # ZeRO-3, one chunk's weights
    # What blocks the compute stream at the start of each forward / backward pass of a chunk:
    # ZeRO-3's share that cannot hide (1 - framework.zero3_overlap: gathers, the backward's
    # scatter), and FSDP2's buffer copies (ZeRO-2/3)
    zero_block_f: dict = field(default_factory=dict)
    zero_block_b: dict = field(default_factory=dict)
    post_gather: dict = field(default_factory=dict)        # ZeRO-1/2 weights after the step
    optimizer: dict = field(default_factory=dict)
    # latent attention under 1d TP + SP: the down projections' gradients all-reduced over TP after
    # the last backward, per position (analytic.replicated_stage_grad_time)
    replicated_grads: dict = field(default_factory=dict)
    tied_s: float = 0.0
    overhead_s: float = 0.0
    recompute_full: bool = False
    # Placement: the NIC id of each stage's representative rank, and which transfers leave the node.
    nic: list = field(default_factory=list)
    pp_cross: list = field(default_factory=list)    # hop stage i -> i+1 (the last entry: p-1 -> 0)
    dp_cross: list = field(default_factory=list)
    tp_cross: list = field(default_factory=list)
    tied_cross: bool = False
    share_links: bool = True   # False: every transfer takes its own time, whatever overlaps it
    # The position of each stage (None: first, middle and last by index), and where a stage's chunks
    # differ, each chunk's share of its per-position times: position -> {field: [share per chunk]}
    # (cost/stage.py chunk_times). Without shares a chunk takes the middle's 1/v and the end chunks the
    # first's and the last's extra (the embedding, the head).
    positions: list | None = None
    chunk_shares: dict = field(default_factory=dict)
    # sigma x E[max of n normals]: the step waits this share of itself for its slowest rank, at the
    # job-wide synchronisation before the optimizer step (cost/synchrony.py)
    synchrony: float = 0.0

    def position(self, i: int) -> str:
        return self.positions[i] if self.positions is not None else _position(i, self.p)

    @property
    def buckets(self) -> int:
        """Gradient buckets per chunk: one per layer (docs/simulator.md)."""
        return max(1, self.layers // (self.p * self.v))


def _position(i: int, p: int) -> str:
    return "first" if i == 0 else "last" if i == p - 1 else "middle"


def step_costs(model: ModelSpec, system: System, c: Columns, stages: StageCosts, phases: tuple,
               schedule: str | None = None) -> StepCosts:
    """The simulator's inputs from the cost layer, for one plan given as Columns of numbers."""
    from perfsim.spec.plan import SCHEDULES as PLAN_SCHEDULES

    f = lambda x: float(np.asarray(x))  # noqa: E731
    p, v, m, dp = int(c.pp), int(c.vpp), int(c.microbatches), int(c.dp_cp)
    schedule = schedule or PLAN_SCHEDULES[int(c.schedule)]
    comm = TopologyCommModel(system)
    if stages.by_position is not None:
        times = {pos: t for pos, (t, _) in stages.by_position.items()}
        parts = {pos: StagePhase(t.forward_compute, t.forward_tp, t.weight_grad) for pos, t in times.items()}
        params = {pos: f(n) for pos, (_, n) in stages.by_position.items()}
    else:
        times = dict(zip(POSITIONS, (stages.first, stages.middle, stages.last)))
        parts = dict(zip(POSITIONS, phases))
        params = {"first": f(stages.params_first), "middle": f(stage_params(model, c, "middle")),
                  "last": f(stages.params_last)}
    keys = list(times)
    o = float(np.asarray(c.dp_overlap))  # 1: buckets overlap the last backward (and the gather the next forward)
    eta = float(overlap_efficiency(system, "dp"))  # less the SMs NCCL's channels hold (cost/contention.py)
    layers_per_chunk = max(1, model.layers // (p * v))
    zero = int(c.zero)

    def per(fn):
        return {k: f(fn(k)) for k in keys}

    optimizer = per(lambda k: optimizer_time(system, c, params[k]) + grad_buffer_pass_time(system, params[k])
                    + weight_cast_time(model, system, c, stage_layer_count(model, c, k)))
    costs = StepCosts(
        schedule=schedule, p=p, m=m, v=v, layers=model.layers,
        forward_compute=per(lambda k: parts[k].forward_compute),
        forward_tp=per(lambda k: parts[k].forward_tp),
        recompute=per(lambda k: times[k].recompute),
        backward_compute=per(lambda k: times[k].compute - parts[k].forward_compute),
        backward_tp=per(lambda k: times[k].tp_comm - parts[k].forward_tp),
        weight_grad=per(lambda k: parts[k].weight_grad),
        forward_cp=per(lambda k: times[k].forward_cp),
        backward_cp=per(lambda k: times[k].cp_comm - times[k].forward_cp),
        forward_ep=per(lambda k: times[k].forward_ep),
        backward_ep=per(lambda k: times[k].ep_comm - times[k].forward_ep),
        hop_s=f(stages.middle.pp_comm) / (2 * v) if p > 1 else 0.0,
        dp=dp, zero=zero, dp_overlap=o, overlap_efficiency=eta, recompute_full=int(c.recompute) == 2,
        overhead_s=float(shown_step_overhead(system, max(optimizer.values()))),
        tied_s=f(tied_embedding_time(model, system, comm, c)),
        replicated_grads=per(lambda k: replicated_stage_grad_time(model, system, comm, c, k)) if model.mla else {},
        optimizer=optimizer,
        synchrony=f(rank_jitter(system) * expected_max_normal(synchronised_ranks(c))),
    )
    if dp > 1:
        reduction = lambda n: step_reduction_time(system, comm, c, n)  # noqa: E731
        chunk = {k: params[k] / v for k in keys}
        units = {k: zero3_units(model, c, k) / v for k in keys}  # modules of one chunk
        if zero <= 1:
            costs.reduction_rest = per(lambda k: reduction(params[k] * (1 - o))[0] if o < 1 else 0.0)
            costs.reduction_bucket = per(lambda k: reduction(chunk[k] * o / layers_per_chunk)[0] if o > 0 else 0.0)
        scatter = lambda n, calls=1: zero_microbatch_times(system, comm, c, n, calls)[0]  # noqa: E731
        if zero == 2:
            calls = units if is_fsdp2(system) else {k: 1 for k in keys}
            costs.scatter_rest = per(lambda k: scatter(chunk[k] * (1 - o), calls[k]) if o < 1 else 0.0)
            costs.scatter_bucket = per(lambda k: scatter(chunk[k] * o / layers_per_chunk) if o > 0 else 0.0)
        if zero == 3:
            o3 = float(system.framework.zero3_overlap)
            gather = per(lambda k: zero_microbatch_times(system, comm, c, chunk[k], units[k])[1])
            costs.scatter_bucket = per(lambda k: o3 * scatter(chunk[k] / layers_per_chunk))
            costs.gather = {k: o3 * g for k, g in gather.items()}
            backward_gathers = int(zero3_gathers(system, c)) - 1
            costs.zero_block_f = {k: (1 - o3) * g for k, g in gather.items()}
            costs.zero_block_b = per(lambda k: (1 - o3) * (backward_gathers * gather[k] + scatter(chunk[k], units[k])))
        if zero >= 2 and is_fsdp2(system):  # FSDP2's buffer copies, on the compute stream
            copies = {k: [f(x) for x in fsdp2_copy_times(system, c, chunk[k])] for k in keys}
            gathers_f, gathers_b = (1, int(zero3_gathers(system, c)) - 1) if zero == 3 else (0, 0)
            for k, (g, sc, acc) in copies.items():
                costs.zero_block_f[k] = costs.zero_block_f.get(k, 0.0) + gathers_f * g
                costs.zero_block_b[k] = costs.zero_block_b.get(k, 0.0) + gathers_b * g + sc + acc * (m - 1) / m
        if zero in (1, 2):
            # overlapped, the gather runs bucket by bucket beside the next step's first forward; what
            # of it that forward cannot hide is drawn here, where the step that needs it begins
            gather = per(lambda k: step_reduction_time(system, comm, c, params[k], units[k] * v)[1])
            forward = {k: costs.forward_compute[k] + costs.forward_tp[k] for k in keys}
            costs.post_gather = {k: overlapped_exposure(g, forward[k], layers_per_chunk * v, eta) if o else g
                                 for k, g in gather.items()}
    _lay_out(costs, model, c, stages)
    _place(costs, system, c)
    return costs


# StepCosts' per-chunk fields, from a StageTime (a chunk's, cost/stage.py chunk_times)
CHUNK_FIELDS = {"forward_compute": lambda t: t.forward_compute, "forward_tp": lambda t: t.forward_tp,
                "recompute": lambda t: t.recompute, "backward_compute": lambda t: t.compute - t.forward_compute,
                "backward_tp": lambda t: t.tp_comm - t.forward_tp, "weight_grad": lambda t: t.weight_grad,
                "forward_cp": lambda t: t.forward_cp, "backward_cp": lambda t: t.cp_comm - t.forward_cp,
                "forward_ep": lambda t: t.forward_ep, "backward_ep": lambda t: t.ep_comm - t.forward_ep}


def _lay_out(costs: StepCosts, model: ModelSpec, c: Columns, stages: StageCosts) -> None:
    """Each stage's position, and its chunks' shares of its times where they are not the middle's
    1/v with the embedding and the head on the end chunks: a layout's stages, and the end stages of
    an uneven split with interleaving (cost/pipeline.py)."""
    if c.layout is not None:
        costs.positions = [f"stage {i}" for i in range(costs.p)]
    uneven = c.layout is not None or (costs.v > 1 and (float(c.first_layers) or float(c.last_layers)
                                                        or (model.moe and model.dense_layers)))  # dense layers' chunks
    if not uneven or stages.parts is None:
        return
    for pos in dict.fromkeys(costs.position(i) for i in range(costs.p)):
        chunks = chunk_times(model, c, stages, pos)
        costs.chunk_shares[pos] = {}
        for name, of in CHUNK_FIELDS.items():
            values = [float(np.asarray(of(t))) for t in chunks]
            total = sum(values)
            costs.chunk_shares[pos][name] = [x / total if total > 0 else 1 / len(values) for x in values]


def _place(costs: StepCosts, system: System, c: Columns) -> None:
    """Which transfers of each stage's representative rank (the stage's first rank) leave its node,
    and through which NIC."""
    D = system.node.devices_per_node
    s = {k: int(v) for k, v in c.strides.items()}
    p, dp, tp = costs.p, costs.dp, int(c.tp)
    rank = [i * s["pp"] for i in range(p)]
    node = [r // D for r in rank]
    nics: dict = {}
    costs.nic = [nics.setdefault((r // D, nic_of(system, r % D)), len(nics)) for r in rank]
    costs.pp_cross = [node[i] != node[(i + 1) % p] for i in range(p)]
    costs.dp_cross = [(r + (dp - 1) * s["dp_cp"]) // D != r // D for r in rank]
    costs.tp_cross = [(r + (tp - 1) * s["tp"]) // D != r // D for r in rank]
    costs.tied_cross = node[0] != node[-1]


# ---------------------------------------------------------------------------------------------
# Building the task graph


class _Builder:
    def __init__(self, costs: StepCosts):
        self.costs = costs
        self.g = engine.Graph()
        self.meta: list = []  # per task: (stage, segments ((kind, seconds), ...), label); the engine sees numbers
        self.main: list = [[] for _ in range(costs.p)]   # compute-stream tasks per stage, in order
        self.side: list = [[] for _ in range(costs.p)]   # data-parallel-stream tasks per stage
        self._main_last = [-1] * costs.p
        self._side_last = [-1] * costs.p
        self.tied = self.sync = self.end = None

    def task(self, stage, segments, label, deps=(), links=None, cls=0, stream="main", work=None, tail=0.0):
        """A task on the stage's compute stream ("main"), its data-parallel stream ("side") or on
        none (None); `work` defaults to the segments' total."""
        if work is None:
            work = sum(d for _, d in segments)
        if links is not None and tail == 0.0:  # a transfer and nothing else
            work, tail = 0.0, work
        if stream == "main":
            t = self.g.add(work, (self._main_last[stage], *deps), links, cls, tail)
            self._main_last[stage] = t
            self.main[stage].append(t)
        elif stream == "side":
            t = self.g.add(work, (self._side_last[stage], *deps), links, cls, tail)
            self._side_last[stage] = t
            self.side[stage].append(t)
        else:
            t = self.g.add(work, deps, links, cls, tail)
        self.meta.append((stage, segments, label))
        return t

    def links(self, stage: int, peer: int | None = None):
        """NIC links of a transfer from `stage` (to `peer`; a collective inside the stage without);
        None when the simulation does not share links."""
        if not self.costs.share_links:
            return None
        nic = self.costs.nic
        if peer is None:
            return (2 * nic[stage], 2 * nic[stage] + 1)
        return (2 * nic[stage], 2 * nic[peer] + 1)


class PassTemplate(NamedTuple):
    """How one (kind, chunk) pass of a stage runs, the same for every micro-batch (_templates)."""
    segments: tuple  # ((kind, seconds), ...) on the compute stream: compute, TP collectives and the
    # blocking send, unless those are transfers of their own
    work: float  # seconds on the compute stream before a send that is a shared-link transfer
    tail: float  # that send's seconds (a transfer when it crosses nodes); 0 without one
    links: tuple | None  # the NIC links the send shares
    traffic_class: int  # PP_FORWARD or PP_BACKWARD for such a send, else 0
    split_tp: float  # a cross-node TP collective's seconds: then a transfer of its own
    target: tuple | None  # (stage, chunk) the pass sends its result to
    receives: bool  # whether the pass waits for data from another stage


def _templates(builder: _Builder, costs: StepCosts, i: int, zb: bool) -> dict:
    """(kind, chunk) -> the PassTemplate of each pass of stage i."""
    p, v = costs.p, costs.v

    pos = costs.position(i)
    shares = costs.chunk_shares.get(pos)

    def part(name: str, chunk: int) -> float:
        """One chunk's share on stage i: the layers split evenly over the chunks, the embedding
        on the first chunk of the first stage, the head on the last chunk of the last stage (or
        the chunk's own share, where the stage's chunks differ)."""
        values = getattr(costs, name)
        if shares is not None:
            return values[pos] * shares[name][chunk]
        if p == 1:
            return values["first"]
        x = values["middle"] / v
        if i == 0 and chunk == 0:
            x += values["first"] - values["middle"]
        if i == p - 1 and chunk == v - 1:
            x += values["last"] - values["middle"]
        return x

    out = {}
    split = costs.tp_cross[i]  # a cross-node TP collective is a transfer of its own
    previous = (i - 1) % p
    for chunk in range(v):
        downstream, upstream = _downstream(i, chunk, p, v), _upstream(i, chunk, p)
        wg = min(part("weight_grad", chunk), part("backward_compute", chunk)) if zb else 0.0
        tp_f, tp_b = part("forward_tp", chunk), part("backward_tp", chunk)
        parts = {F: [(DP, costs.zero_block_f.get(pos, 0.0)), (COMPUTE, part("forward_compute", chunk)),
                     (CP, part("forward_cp", chunk)), (EP, part("forward_ep", chunk)), (TP, 0.0 if split else tp_f)],
                 # the ring's waits sit inside every layer's backward: drawn ahead of the compute, and
                 # the gradient buckets released over both (_reduce), the last at the pass's compute end
                 B: [(DP, costs.zero_block_b.get(pos, 0.0)), (RECOMPUTE, part("recompute", chunk)),
                     (CP, part("backward_cp", chunk)), (EP, part("backward_ep", chunk)),
                     (COMPUTE, part("backward_compute", chunk) - wg),
                     (TP, 0.0 if split else tp_b)],
                 W: [(COMPUTE, wg)]}
        for kind, segs in parts.items():
            segments = tuple((x, d) for x, d in segs if d > 0.0) or ((COMPUTE, 0.0),)
            work = sum(d for _, d in segments)
            target = None if kind == W else downstream if kind == F else upstream
            tail, links, cls = 0.0, None, 0
            if target is not None and costs.hop_s > 0 and not split:
                segments += ((PP, costs.hop_s),)
                cross = costs.pp_cross[i] if kind == F else costs.pp_cross[previous]
                links = builder.links(i, target[0]) if cross else None
                if links is not None:
                    tail, cls = costs.hop_s, PP_FORWARD if kind == F else PP_BACKWARD
                else:
                    work += costs.hop_s
            split_tp = (tp_f if kind == F else tp_b if kind == B else 0.0) if split else 0.0
            source = None if kind == W else upstream if kind == F else downstream
            out[(kind, chunk)] = PassTemplate(segments, work, tail, links, cls, split_tp, target, source is not None)
    return out


def build(costs: StepCosts):
    """The task graph of one step; returns the builder (graph, display data, stream lists)."""
    p, m, v = costs.p, costs.m, costs.v
    if costs.schedule not in SIMULATED_SCHEDULES:
        raise PerfsimError(f"schedule must be one of {', '.join(SIMULATED_SCHEDULES)}, got {costs.schedule!r}")
    zb = costs.schedule == "zb-h1"
    builder = _Builder(costs)
    buckets = costs.buckets
    orders = [stage_order(costs.schedule, i, p, m, v) for i in range(p)]
    # The pass that produces a chunk's weight gradients: B, or W under zb-h1.
    grad_kind = W if zb else B
    hop = ((PP, costs.hop_s),)
    add, meta, main_last = builder.g.add, builder.meta, builder._main_last
    sends = {}      # (kind, micro-batch, receiving stage, its chunk) -> task the receiver waits for
    receives = []   # (receiving pass, key into sends)
    zero3 = costs.zero == 3 and costs.dp > 1
    after = builder.g.after
    for i in range(p):
        pos = costs.position(i)
        dp_links = builder.links(i) if costs.dp_cross[i] else None
        order = orders[i]
        main_i = builder.main[i]
        templates = _templates(builder, costs, i, zb)
        last_grad = {}
        for index, (kind, j, chunk) in enumerate(order):
            if kind == grad_kind:
                last_grad[chunk] = index
        # ZeRO-3: every F and B pass waits for its chunk's weights (B twice over with full
        # recomputation); the gather of the next pass may start when this one starts (prefetch one).
        gather_for = [None if kind == W else costs.gather[pos] * (2 if kind == B and costs.recompute_full else 1)
                      for kind, _, _ in order] if zero3 else None

        def gather(index, after_task):
            t = builder.task(i, ((DP, gather_for[index]),), ("gather",) + order[index], links=dp_links,
                             cls=DP_TRAFFIC, stream="side")
            if after_task >= 0:
                builder.g.after_start(t, after_task, 0.0)
            return t

        pending = {}
        if zero3:
            first = next((n for n, x in enumerate(gather_for) if x is not None), None)
            if first is not None:
                pending[first] = gather(first, -1)
        dp_work = costs.dp > 1
        last = main_last[i]
        for index, entry in enumerate(order):
            kind, j, chunk = entry
            segments, work, tail, links, cls, split_tp, target, receives_data = templates[kind, chunk]
            if dp_work and kind == grad_kind and costs.overlap_efficiency < 1.0:
                extra = _contention(costs, pos, segments, index == last_grad.get(chunk), buckets)
                segments, work = ((DP, extra),) + segments, work + extra
            if index in pending:
                task = add(work, (last, pending.pop(index)), links, cls, tail)
            else:
                task = after(last, work, links, cls, tail)
            last = task
            main_i.append(task)
            meta.append((i, segments, entry))
            if receives_data:
                receives.append((task, (kind, j, i, chunk)))
            if zero3 or split_tp > 0 or (dp_work and kind == grad_kind):  # the rarer tasks use builder.task
                main_last[i] = last
                if zero3:
                    later = next((n for n in range(index + 1, len(order)) if gather_for[n] is not None), None)
                    if later is not None and later not in pending:
                        pending[later] = gather(later, task)
                if split_tp > 0:  # the TP collective and the send as transfers of their own
                    builder.task(i, ((TP, split_tp),), ("tp", kind, j, chunk), links=builder.links(i), cls=TP_TRAFFIC,
                                 work=0.0, tail=split_tp)
                    if target is not None and costs.hop_s > 0:
                        cross = costs.pp_cross[i] if kind == F else costs.pp_cross[(i - 1) % p]
                        builder.task(i, hop, ("send", kind, j, chunk),
                                     links=builder.links(i, target[0]) if cross else None,
                                     cls=PP_FORWARD if kind == F else PP_BACKWARD, work=0.0, tail=costs.hop_s)
                if target is not None:
                    sends[(kind, j, target[0], target[1])] = main_last[i]
                if dp_work and kind == grad_kind:
                    _reduce(builder, costs, i, pos, chunk, task, segments, index == last_grad.get(chunk), dp_links,
                            buckets)
                last = main_last[i]
            elif target is not None:
                sends[(kind, j, target[0], target[1])] = last
        main_last[i] = last
    depend = builder.g.depend
    for consumer, key in receives:
        depend(consumer, sends[key])
    _finish(builder, costs)
    return builder


def _downstream(i, chunk, p, v):
    """The (stage, chunk) after chunk `chunk` of stage i in the model's layer order (the last stage's
    chunk c hands over to the first stage's chunk c + 1): where its forward pass sends and its
    backward pass receives from; None at the model's end."""
    if i < p - 1:
        return (i + 1, chunk)
    return (0, chunk + 1) if chunk < v - 1 else None


def _upstream(i, chunk, p):
    """The (stage, chunk) before it: where its forward pass receives from and its backward pass
    sends to; None at the model's start."""
    if i > 0:
        return (i - 1, chunk)
    return (p - 1, chunk - 1) if chunk > 0 else None


def _bucket(costs: StepCosts, pos: str, last: bool) -> float:
    """Seconds of one overlapped gradient bucket of a gradient-producing pass (ZeRO-0/1: only the
    chunk's last such pass reduces)."""
    if costs.zero <= 1:
        return costs.reduction_bucket.get(pos, 0.0) if last else 0.0
    return costs.scatter_bucket.get(pos, 0.0)


def _release_window(segments) -> tuple:
    """(seconds before the pass's buckets start to be released, seconds over which they are)."""
    offset, grad = 0.0, 0.0
    for kind, d in segments:
        if kind == COMPUTE:
            return offset, grad + d
        if kind in (CP, EP):  # the ring's and the all-to-alls' waits sit inside the layers whose buckets follow
            grad += d
            continue
        offset += d
    return offset, grad


def _contention(costs: StepCosts, pos: str, segments, last: bool, buckets: int) -> float:
    """Seconds a gradient-producing pass is lengthened by the buckets it hides when overlap is
    imperfect: the 1 - overlap_efficiency share of what its compute hides of them, as the closed
    form charges it (overlap.overlapped_exposure; docs/equations.md 6.1). ZeRO-3's prefetch keeps
    framework.zero3_overlap, which already holds its slowdown, in both engines."""
    total = buckets * _bucket(costs, pos, last) if costs.zero <= 2 else 0.0
    if total <= 0:
        return 0.0
    window = _release_window(segments)[1]
    return float(overlapped_exposure(total, window, buckets, costs.overlap_efficiency)
                 - overlapped_exposure(total, window, buckets))


def _reduce(builder: _Builder, costs: StepCosts, i: int, pos: str, chunk: int, pass_task: int, segments, last: bool,
            links, buckets: int) -> None:
    """Gradient buckets of one gradient-producing pass: released one by one as the pass's
    compute segment runs (one bucket per layer), reduced on the data-parallel stream; ZeRO-2's
    non-overlapped share blocks the compute stream after the pass."""
    bucket = _bucket(costs, pos, last)
    if bucket > 0:
        offset, grad = _release_window(segments)
        for n in range(buckets):
            t = builder.task(i, ((DP, bucket),), ("bucket", n, chunk), links=links, cls=DP_TRAFFIC, stream="side")
            builder.g.after_start(t, pass_task, offset + grad * (n + 1) / buckets)
    if costs.zero == 2 and costs.scatter_rest.get(pos, 0.0) > 0:
        t = builder.task(i, ((DP, costs.scatter_rest[pos]),), ("reduce-scatter", chunk), deps=(pass_task,),
                         links=links, cls=DP_TRAFFIC, stream="side")
        builder.g.depend(_blocker(builder, i), t)


def _blocker(builder: _Builder, i: int) -> int:
    """A zero-length task on the compute stream that the next pass must wait behind."""
    return builder.task(i, ((DP, 0.0),), ("wait",))


def _finish(builder: _Builder, costs: StepCosts) -> None:
    """After the last pass: the rest of the gradient reduction, latent attention's replicated
    gradients all-reduced over TP (MLA under 1d TP + SP), the tied-embedding all-reduce, a
    step-wide synchronisation (the gradient-norm all-reduce of clipping, timed as free but for the
    wait for the slowest rank, set after the run: _wait_for_slowest_rank), the optimizer step, the
    ZeRO-1/2 weight all-gather, and the framework's per-step overhead."""
    p = costs.p
    done = []
    for i in range(p):
        pos = costs.position(i)
        links = builder.links(i) if costs.dp_cross[i] else None
        rest = costs.reduction_rest.get(pos, 0.0) if costs.zero <= 1 else 0.0
        if rest > 0:
            builder.task(i, ((DP, rest),), ("reduce",), deps=(builder._main_last[i],), links=links,
                         cls=DP_TRAFFIC, stream="side")
        replicated = costs.replicated_grads.get(pos, 0.0)
        if replicated > 0:  # on the compute stream, after the data-parallel reduction (finalize_model_grads)
            builder.task(i, ((TP, replicated),), ("replicated-gradient all-reduce",), deps=(builder._side_last[i],))
        done.append((builder._main_last[i], builder._side_last[i]))
    last = [builder._main_last[i] for i in range(p)]
    if costs.tied_s > 0 and p > 1:
        ends = builder.links(0), builder.links(p - 1)
        links = ends[0] + ends[1] if costs.tied_cross and ends[0] is not None else None
        tied = builder.task(0, ((PP, costs.tied_s),), ("tied embedding all-reduce",),
                            deps=(*done[0], *done[p - 1]), links=links, cls=TIED_TRAFFIC)
        last[0] = tied
        builder.tied = tied
    else:
        builder.tied = None
    sync = builder.task(0, (), ("sync",), deps=[t for pair in done for t in pair] + last, stream=None)
    for i in range(p):
        pos = costs.position(i)
        builder._main_last[i] = -1
        builder.task(i, ((OPTIMIZER, costs.optimizer.get(pos, 0.0)),), ("optimizer step",), deps=(sync,))
        gather = costs.post_gather.get(pos, 0.0)
        if gather > 0:
            builder.task(i, ((DP, gather),), ("weight all-gather",),
                         links=builder.links(i) if costs.dp_cross[i] else None, cls=DP_TRAFFIC)
    end = builder.task(0, (), ("step end",), deps=[builder._main_last[i] for i in range(p)], stream=None)
    builder.sync, builder.end = sync, end
    for i in range(p):
        builder._main_last[i] = -1
        if costs.overhead_s > 0:
            builder.task(i, ((OTHER, costs.overhead_s),), ("step overhead",), deps=(end,))


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class SimResult:
    """One simulated step. Times in seconds from the start of the step."""

    step_time_s: float
    time_breakdown_s: dict         # exposed time on `breakdown_stage`; adds up to step_time_s
    breakdown_stage: int
    stages: list                   # per stage: busy_s, idle_s, busy_by_kind_s, dp_stream_busy_s
    critical_path: dict            # by_kind_s, and runs of consecutive tasks on one stage
    schedule: str
    p: int
    m: int
    v: int
    tasks: int
    wall_s: float
    start: list = field(repr=False, default_factory=list)
    end: list = field(repr=False, default_factory=list)
    meta: list = field(repr=False, default_factory=list)
    main: list = field(repr=False, default_factory=list)
    side: list = field(repr=False, default_factory=list)

    def as_json(self) -> dict:
        return {"step_time_s": self.step_time_s, "schedule": self.schedule, "pp": self.p, "microbatches": self.m,
                "vpp": self.v, "time_breakdown_s": self.time_breakdown_s, "breakdown_stage": self.breakdown_stage,
                "stages": self.stages, "critical_path": self.critical_path, "tasks": self.tasks,
                "simulation_wall_s": self.wall_s}


def run_step(costs: StepCosts) -> SimResult:
    """Build and run the step; summarise it."""
    clock = time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()  # hundreds of thousands of small tuples and lists, none of them cyclic garbage
    try:
        builder = build(costs)
        start, end, cause = engine.run(builder.g)
    finally:
        if collecting:
            gc.enable()
    _wait_for_slowest_rank(builder, start, end, costs.synchrony * max(end))
    step = max(end)
    stages = [_stage_summary(builder, start, end, i, step) for i in range(costs.p)]
    reference = max(range(costs.p), key=lambda i: (stages[i]["busy_s"], -i))
    breakdown = _exposed(builder, start, end, cause, reference, step)
    path = _critical_path(builder, start, end, cause)
    return SimResult(step_time_s=step, time_breakdown_s=breakdown, breakdown_stage=reference, stages=stages,
                     critical_path=path, schedule=costs.schedule, p=costs.p, m=costs.m, v=costs.v,
                     tasks=len(builder.g), wall_s=time.perf_counter() - clock, start=start, end=end,
                     meta=builder.meta, main=builder.main, side=builder.side)


def _wait_for_slowest_rank(builder: _Builder, start, end, wait: float) -> None:
    """The job-wide synchronisation before the optimizer step (`builder.sync`) lasts `wait`: the step's
    wait for its slowest rank (cost/synchrony.py). Every task after it, all built after it and none
    sharing a link with one before it, moves by as much."""
    if not wait > 0:
        return
    stage, _, label = builder.meta[builder.sync]
    builder.meta[builder.sync] = (stage, ((SYNC, wait),), label)
    end[builder.sync] += wait
    for t in range(builder.sync + 1, len(end)):
        start[t] += wait
        end[t] += wait


def _kinds_of(meta, s, e, lo=-math.inf, hi=math.inf):
    """Seconds of each kind a task spends inside [lo, hi]: its segments laid out from its start s,
    the last one stretched to its end e (a transfer slowed down by sharing its links)."""
    segments = meta[1]
    out = {}
    t = s
    last = len(segments) - 1
    for n, (kind, d) in enumerate(segments):
        z = e if n == last else t + d
        a, zz = max(t, lo), min(z, hi)
        if zz > a:
            out[kind] = out.get(kind, 0.0) + (zz - a)
        t = z
    return out


def _stage_summary(builder: _Builder, start, end, i: int, step: float) -> dict:
    by_kind: dict = {}
    uses: dict = {}  # id of a shared segments tuple -> [segments, count, stretch of its last segment]
    meta = builder.meta
    for t in builder.main[i]:
        segments = meta[t][1]
        entry = uses.get(id(segments))
        if entry is None:
            entry = uses[id(segments)] = [segments, 0, 0.0, sum(d for _, d in segments)]
        entry[1] += 1
        entry[2] += end[t] - start[t] - entry[3]
    for segments, count, stretch, _ in uses.values():
        for kind, d in segments:
            by_kind[kind] = by_kind.get(kind, 0.0) + count * d
        kind = segments[-1][0]
        by_kind[kind] = by_kind.get(kind, 0.0) + stretch
    by_kind = {kind: x for kind, x in by_kind.items() if x > 1e-12}
    busy = sum(by_kind.values())
    side = sum(end[t] - start[t] for t in builder.side[i])
    return {"stage": i, "busy_s": busy, "idle_s": max(step - busy, 0.0), "busy_by_kind_s": by_kind,
            "dp_stream_busy_s": side}


def _exposed(builder: _Builder, start, end, cause, i: int, step: float) -> dict:
    """Exposed time on stage i: while its compute stream runs, the kind of what runs; while it
    waits, the kind of what it waits for, followed back along the chain of causes inside the
    gap: data-parallel transfers count as dp_comm, the tied-embedding all-reduce as pp_comm,
    and everything else (other stages' passes and sends) as the pipeline bubble."""
    out = {costs: 0.0 for costs in BREAKDOWN_KEYS}
    meta = builder.meta
    clock = 0.0
    side_tasks = set()
    for stage_side in builder.side:
        side_tasks.update(stage_side)
    for t in builder.main[i] + [None]:
        gap_end = step if t is None else start[t]
        if gap_end > clock + 1e-15:
            waiter = t if t is not None else builder.end
            _attribute_gap(builder, start, end, cause, waiter, clock, gap_end, side_tasks, out)
        if t is None:
            break
        for kind, x in _kinds_of(meta[t], start[t], end[t]).items():
            out[kind] += x
        clock = max(clock, end[t])
    return out


def _attribute_gap(builder, start, end, cause, waiter, lo, hi, side_tasks, out):
    total = hi - lo
    known = 0.0
    x = cause[waiter]
    limit = hi
    while x >= 0 and limit > lo:
        s, e = start[x], min(end[x], limit)
        kinds = builder.meta[x][1]
        kind = kinds[0][0] if len(kinds) == 1 else None
        if x in side_tasks or kind == DP:
            a = max(s, lo)
            if e > a:
                out[DP] += e - a
                known += e - a
        elif x == builder.tied or kind == SYNC:
            a = max(s, lo)
            if e > a:
                out[PP if x == builder.tied else SYNC] += e - a
                known += e - a
        limit = min(limit, s)
        x = cause[x]
    out["pp_bubble"] += max(total - known, 0.0)


def _critical_path(builder: _Builder, start, end, cause) -> dict:
    """The chain of tasks that set the step time, from the end back to 0, as runs of consecutive
    tasks on one stage (a transfer counts on its sender's stage)."""
    last = max(range(len(end)), key=lambda t: (end[t], t))
    chain = []
    t, upto = last, end[last]
    while t >= 0:
        chain.append((t, upto))
        upto = start[t]
        t = cause[t]
    chain.reverse()
    by_kind: dict = {}
    runs: list = []
    for t, upto in chain:
        kinds = _kinds_of(builder.meta[t], start[t], end[t], hi=upto)
        if not kinds:
            continue
        stage = builder.meta[t][0]
        for kind, x in kinds.items():
            by_kind[kind] = by_kind.get(kind, 0.0) + x
        if runs and runs[-1]["stage"] == stage:
            run = runs[-1]
            run["end_s"] = upto
            run["tasks"] += 1
        else:
            run = {"stage": stage, "start_s": start[t], "end_s": upto, "tasks": 1, "by_kind_s": {}}
            runs.append(run)
        for kind, x in kinds.items():
            run["by_kind_s"][kind] = run["by_kind_s"].get(kind, 0.0) + x
    return {"by_kind_s": by_kind, "runs": runs}


# ---------------------------------------------------------------------------------------------
# Whole plans


@dataclass
class Simulation:
    result: SimResult
    prediction: object   # perfsim.predict.Prediction with the simulated step time and breakdown
    analytic: object     # the closed-form Prediction of the same plan

    def as_json(self) -> dict:
        out = self.prediction.as_json()
        out["engine"] = "sim"
        out["simulation"] = self.result.as_json() | {"analytic_step_time_s": self.analytic.step_time_s,
                                                      "analytic_time_breakdown_s": self.analytic.time_breakdown_s}
        return out


# Stage passes (stages x chunks x micro-batches) one simulation builds at most: a few hundred
# thousand tasks, seconds and a few hundred MB (a 64-stage 1T-parameter plan of SC21 has 32,768).
MAX_SIMULATED_PASSES = 2**17


def simulate(model, system, plan, dtype: str = "bf16", schedule: str | None = None) -> Simulation:
    """Simulate one step of `plan`. `schedule` "zb-h1" replaces a 1F1B plan's schedule by ZB-H1
    (the plan's own schedule otherwise)."""
    from perfsim.predict import peak_flops, predict
    from perfsim.spec.model import load_model
    from perfsim.spec.system import load_system

    model = load_model(model) if isinstance(model, str) else model
    system = load_system(system) if isinstance(system, str) else system
    if schedule is not None and schedule not in SIMULATED_SCHEDULES:
        raise PerfsimError(f"schedule must be one of {', '.join(SIMULATED_SCHEDULES)}, got {schedule!r}")
    if schedule == "zb-h1":
        if plan.vpp > 1 or plan.schedule == "interleaved":
            raise PerfsimError(ZERO_BUBBLE_ONE_CHUNK)
        plan = plan.replace(schedule="1f1b")
    elif schedule is not None:
        plan = plan.replace(schedule=schedule)
    analytic = predict(model, system, plan, dtype)  # validates the plan
    passes = plan.pp * plan.vpp * plan.microbatches
    if passes > MAX_SIMULATED_PASSES:  # the task graph grows with it: refuse before building it
        raise PerfsimError(f"simulating {plan.pp} stages x {plan.vpp} chunks x {plan.microbatches:,} micro-batches = "
                           f"{passes:,} forward passes is more than the event simulation takes "
                           f"({MAX_SIMULATED_PASSES:,}, about ten seconds); use the closed form (perfsim predict), "
                           f"or fewer micro-batches (--gbs / (--mbs x dp))")
    c = at_dtype(columns_of(plan), dtype)
    peak = peak_flops(system, dtype)
    system = for_dtype(system, dtype)
    costs = step_costs(model, system, c, stage_costs(model, system, c, peak), stage_phases(model, system, c, peak),
                       schedule=schedule or plan.schedule)
    result = run_step(costs)
    return Simulation(result, with_step_time(analytic, result.step_time_s, result.time_breakdown_s), analytic)


def predict_simulated(model, system, plan, dtype: str = "bf16"):
    """`perfsim predict --engine sim`: the Prediction of `plan` with the simulated step time and
    exposed-time breakdown (and every rate that follows from them)."""
    return simulate(model, system, plan, dtype).prediction


def with_step_time(prediction, step: float, breakdown: dict):
    """`prediction` with another step time: every rate that depends on it follows."""
    ratio = prediction.step_time_s / step
    return dataclasses.replace(
        prediction, step_time_s=step, tokens_per_s=prediction.tokens_per_s * ratio,
        samples_per_s=prediction.samples_per_s * ratio,
        model_tflops_per_device=prediction.model_tflops_per_device * ratio,
        hardware_tflops_per_device=prediction.hardware_tflops_per_device * ratio,
        megatron_ds_tflops_per_device=prediction.megatron_ds_tflops_per_device * ratio,
        mfu=prediction.mfu * ratio, hfu=prediction.hfu * ratio,
        time_breakdown_s={k: float(breakdown[k]) for k in BREAKDOWN_KEYS})
