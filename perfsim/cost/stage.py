"""Time of one micro-batch on one device of a pipeline stage, by kind (docs/equations.md, section 8).

A stage holds L/p layers; the first also holds the embedding, the last the final norm, the
logits and the loss (with p = 1 one stage holds all); an uneven split or a layout gives each stage
its own (cost/pipeline.py). Per micro-batch a stage runs forward,
backward (cost/layer.py) and what recomputation repeats, issues its tensor-parallel collectives
(exposed, as in Megatron-LM and the 2D/3D implementations, except that with tp_overlap, 1d + SP,
they are pipelined with their GEMMs: `overlapped_tp_times`), and sends its activation
forward and its gradient backward (v times each with v interleaved chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from perfsim.cost import clocks, contention, experts, pipeline
from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.attention_dropout import fused_dropout_work
from perfsim.cost.topology import TopologyCommModel
from perfsim.cost.columns import FULL, NONE, SELECTIVE, Columns, distinct_rows_of, stage_layer_count
from perfsim.cost.context_parallel import ring_attention_times
from perfsim.cost.data_parallel import gradient_accumulation_time, microbatch_reduction_time, zero3_units
from perfsim.cost.host import layer_host_overhead, recompute_host_overhead, shown_share
from perfsim.cost.layer import Work, embedding_work, gemm_pass_times, head_memory_ops, layer_memory_ops
from perfsim.cost.overlap import overlapped_exposure
from perfsim.cost.memory import stage_params
from perfsim.spec.model import ModelSpec
from perfsim.spec.system import System


@dataclass
class StageTime:
    """Seconds per micro-batch on one device of a stage, by kind; `total` is their sum."""

    compute: object = 0.0
    recompute: object = 0.0
    tp_comm: object = 0.0
    cp_comm: object = 0.0  # ring attention (context parallelism) not hidden behind the attention blocks
    ep_comm: object = 0.0  # expert parallelism: the MoE layers' dispatch and combine (cost/experts.py)
    pp_comm: object = 0.0
    dp_comm: object = 0.0  # ZeRO-3 gathers not hidden behind compute
    backward: object = 0.0  # part of compute + recompute + tp_comm + cp_comm spent in backward
    forward_compute: object = 0.0  # part of compute spent in forward
    forward_tp: object = 0.0  # part of tp_comm spent in forward (not recomputation)
    forward_cp: object = 0.0  # part of cp_comm spent in forward (not recomputation)
    forward_ep: object = 0.0  # part of ep_comm spent in forward (not recomputation)
    weight_grad: object = 0.0  # weight-gradient GEMMs inside the backward compute
    curve: object = 0.0  # part of compute + recompute priced by the parametric curves alone (cost/measured.py)

    KINDS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm")

    @property
    def total(self):
        return self.compute + self.recompute + self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm + self.dp_comm

    def kinds(self) -> dict:
        return {k: getattr(self, k) for k in self.KINDS}


@dataclass
class StageCosts:
    first: StageTime
    middle: StageTime
    last: StageTime
    params_first: object
    params_last: object
    # every position's (StageTime, parameters), the ends first (cost/pipeline.py: a layout's "stage i"
    # too); None: first, middle and last as above, the middle's parameters from stage_params
    by_position: dict | None = None
    # what a stage's time is made of, for its chunks' shares (chunk_times): one layer (its sends a
    # whole stage's), the embedding and the head with their collectives' times, the loop's time
    parts: tuple | None = None

    def stages(self, model, c) -> list:
        """(position, StageTime, parameters, stages at the position) of every position, the ends first."""
        from perfsim.cost.pipeline import stage_count

        if self.by_position is None:
            middle = stage_params(model, c, "middle")
            found = {"first": (self.first, self.params_first), "last": (self.last, self.params_last),
                     "middle": (self.middle, middle)}
        else:
            found = self.by_position
        return [(pos, t, n, stage_count(c, pos) if pos in ("first", "middle", "last") and c.layout is None else 1)
                for pos, (t, n) in found.items()]


def stage_costs(model: ModelSpec, system: System, c: Columns, peak_flops: float) -> StageCosts:
    dev, comm = system.device, TopologyCommModel(system)
    # the SM clock of a multi-GPU job against the kernel rates' (clocks.py)
    clock = clocks.clock_ratio(system, c)
    # a context-parallel rank's work is that of mbs/cp whole sequences (its s/cp tokens of each, and
    # by causal load balancing 1/cp of their attention): every per-token cost below takes b = mbs/cp
    b, t, p = c.mbs / c.cp, c.tp, c.pp
    strides = c.strides
    layout = tpc.layout_of(model, c)
    tp_time = lambda coll: tpc.collectives_time(comm, layout, coll, strides["tp"])  # noqa: E731
    autocast = system.framework.autocast

    # a mixture of experts with dense layers: a MoE layer (`middle`) and a dense one, mixed on each
    # stage as it holds them (pipeline.dense_count; docs/equations.md 12.6)
    dense = None
    if model.moe and model.dense_layers:
        middle, host, recompute_host = _layer_time_once_each(replace(model, dense_layers=0), system, c, peak_flops,
                                                             comm, layout, tp_time, clock)
        dense = _layer_time_once_each(dense_variant(model), system, c, peak_flops, comm, layout, tp_time, clock)
    else:
        middle, host, recompute_host = _layer_time_once_each(model, system, c, peak_flops, comm, layout, tp_time,
                                                             clock)

    # Pipeline neighbours exchange the device's share of [b, s, h]: 1/t in 1d (scatter/gather
    # optimisation, or already split with SP; without SP the receiver all-gathers it in its TP
    # group), 1/P in the other modes, whose activations are always split.
    activation = c.element * b * model.seq * model.hidden
    regather = np.where((c.tp_mode == "1d") & (layout.region_split == 1),
                        comm.all_gather(activation, t, strides["tp"]), 0.0)
    hop = comm.send(activation / t, p, strides["pp"]) + regather
    middle.pp_comm = np.where(p > 1, 2 * c.vpp * hop, 0.0)

    emb = embedding_work(model, dev, b, layout.region_split, c.element)
    emb_fwd, emb_bwd = tpc.embedding_collectives(layout, model, b, c.element)
    vocab = model.padded_vocab(t)
    head = clocks.clocked_work(clock, dev, peak_flops, [tpc.head_gemm(layout, model, b, vocab)],
                               head_memory_ops(model, b, layout.split, layout.region_split, vocab, c.element, autocast))
    head_fwd, head_bwd = tpc.head_collectives(layout, model, b, vocab, c.element)
    layer_stage = middle  # one layer; a stage's pipeline transfers do not grow with its layers
    loop = system.framework.microbatch_overhead_s
    edges = (emb, tp_time(emb_fwd), tp_time(emb_bwd)), (head, tp_time(head_fwd), tp_time(head_bwd))
    found = {}
    for name in pipeline.positions(c):
        # a stage's layers (an MTP layer is one, with a head of its own), the loop, the embedding and the heads it holds
        layers = stage_layer_count(model, c, name) + pipeline.mtp_count(c, name)
        host_layers, layer_host, layer_recompute_host = layers, host, recompute_host
        if dense is None:
            stage = _with_loop(_times(layer_stage, layers), loop)
        else:  # its dense layers and its MoE layers (an MTP layer is a MoE layer)
            d = pipeline.dense_count(model, c, name)
            stage = _with_loop(_sum(_times(layer_stage, layers - d), _times(dense[0], d)), loop)
            host_layers, layer_host = 1, (layers - d) * host + d * dense[1]
            layer_recompute_host = (layers - d) * recompute_host + d * dense[2]
        stage = _plus(stage, *edges[0], pipeline.embedding_count(c, name))
        stage = _plus(stage, *edges[1], pipeline.head_count(c, name))
        params = stage_params(model, c, name)
        stage = _plus_compute(stage, gradient_accumulation_time(system, c, params))
        # with host_overlap only the host time the device's work does not cover shows (cost/host.py)
        stage = _host_beside_device(stage, host_layers, layer_host, layer_recompute_host, loop,
                                    system.framework.host_overlap)
        stage.dp_comm = microbatch_reduction_time(system, comm, c, params, stage.compute + stage.recompute,
                                                  stage.backward, zero3_units(model, c, name), layers)
        found[name] = (stage, params)
    # first, middle and last as the fields name them (a layout's stage 0, 1 and pp - 1; one stage: all three)
    p = int(c.layout.pp) if c.layout is not None else 3
    first, middle, last = (found[pipeline.position_of(c, i) if c.layout is not None else name]
                           for i, name in ((0, "first"), (min(1, p - 1), "middle"), (p - 1, "last")))
    return StageCosts(first[0], middle[0], last[0], first[1], last[1], by_position=found,
                      parts=(layer_stage, *edges, loop, dense[0] if dense else None))


# Columns one layer's time per micro-batch does not read. A search's batch repeats each layer over
# them (pipeline sizes and splits, schedules, ZeRO stages), so each distinct layer is priced once;
# they are None in the distinct rows, so that a layer cost coming to read one fails loudly.
NOT_LAYER_FIELDS = ("pp", "vpp", "schedule", "zero", "first_layers", "last_layers", "gbs", "dp_overlap")


def _layer_time_once_each(model: ModelSpec, system: System, c: Columns, peak_flops, comm, layout, tp_time,
                          clock) -> tuple:
    """_layer_time of a batch `c`, each distinct layer priced once (its rows alike in every column
    but NOT_LAYER_FIELDS, the rank strides and the clock) and spread back over the rows: the same
    numbers, element by element. Plans as numbers, a pipeline layout, or a system whose numbers are
    arrays over draws (aligned with the rows) are priced as they come."""
    rows, found = np.shape(c.tp), None
    if len(rows) == 1 and not np.ndim(peak_flops):
        found = distinct_rows_of(c, NOT_LAYER_FIELDS, [np.broadcast_to(x, rows) for x in
                                                       [c.strides[d] for d in ("tp", "cp", "dp", "pp")]
                                                       + ([clock] if np.ndim(clock) else [])], system)
    if found is None:
        return _layer_time(model, system, c, peak_flops, comm, layout, tp_time, clock)
    u, first, inverse = found
    layout = tpc.layout_of(model, u)
    times = _layer_time(model, system, u, peak_flops, comm, layout,
                        lambda coll: tpc.collectives_time(comm, layout, coll, u.strides["tp"]),
                        clock[first] if np.ndim(clock) else clock)
    spread = lambda x: x[inverse] if np.ndim(x) else x  # noqa: E731
    layer, host, recompute_host = times
    return (StageTime(**{f.name: spread(getattr(layer, f.name)) for f in fields(StageTime)}),
            spread(host), spread(recompute_host))


def _layer_time(model: ModelSpec, system: System, c: Columns, peak_flops: float, comm, layout, tp_time, clock) -> tuple:
    """(StageTime of one average layer of `model` per micro-batch, pipeline transfers apart; its
    host seconds; the host seconds recomputation adds to it)."""
    dev = system.device
    eta_tp, eta_cp = contention.overlap_efficiency(system, "tp"), contention.overlap_efficiency(system, "cp")
    b, strides = c.mbs / c.cp, c.strides
    gemms = tpc.layer_gemms(layout, model, b, c.cp)
    autocast = system.framework.autocast
    layer = clocks.clocked_work(clock, dev, peak_flops, gemms,
                                layer_memory_ops(model, b, layout.split, layout.region_split, c.element, autocast),
                                c.flash, c.fp8, fused_dropout_work(dev, peak_flops, model, gemms, c.flash))
    fwd_coll, bwd_coll = tpc.layer_collectives(layout, model, b, c.element)
    layer_tp_fwd, layer_tp_bwd = tp_time(fwd_coll), tp_time(bwd_coll)
    if c.tp_mode == "1d":
        overlapped_fwd, overlapped_bwd = overlapped_tp_times(model, dev, peak_flops, layout, gemms,
                                                             c.element * b * model.seq * model.hidden, tp_time, c.fp8,
                                                             eta_tp, clock)
        layer_tp_fwd = np.where(c.tp_overlap, overlapped_fwd, layer_tp_fwd)
        layer_tp_bwd = np.where(c.tp_overlap, overlapped_bwd, layer_tp_bwd)
    # mixture of experts: an average layer's MLP replaced in moe_share of the layers by the MoE
    # block on the slowest expert-parallel rank, and its dispatch and combine (cost/experts.py)
    layer_ep_fwd, layer_ep_bwd = experts.ep_comm_times(system, comm, model, c)
    if model.moe:
        mlp_ops = [op for op in layer_memory_ops(model, b, layout.split, layout.region_split, c.element, autocast)
                   if op.name == "activation"]
        layer = experts.moe_layer_work(model, system, c, layer, [g for g in gemms if g.name in ("fc1", "fc2")],
                                       mlp_ops, peak_flops, clock)
        keep = experts.tp_comm_share(model, c)
        layer_tp_fwd, layer_tp_bwd = keep * layer_tp_fwd, keep * layer_tp_bwd
        hidden_fwd, hidden_bwd = experts.overlapped_ep_times(system, layer_ep_fwd, layer_ep_bwd,
                                                             layer.time_s + layer.backward_s)
        layer_ep_fwd = np.where(c.ep_overlap, hidden_fwd, layer_ep_fwd)
        layer_ep_bwd = np.where(c.ep_overlap, hidden_bwd, layer_ep_bwd)
    # the host time of each layer, a third in forward (docs/equations.md 8.1-8.2), and what
    # recomputation adds to it in backward
    host = layer_host_overhead(system, model, c)
    host_fwd, host_bwd = host / 3, 2 * host / 3
    recompute_host = recompute_host_overhead(system, model, c, host)
    recompute = np.where(c.recompute == FULL, layer.time_s, np.where(c.recompute == SELECTIVE, layer.core_time_s, 0.0)) \
        + recompute_host
    recompute_tp = np.where(c.recompute == FULL, layer_tp_fwd, 0.0)
    recompute_ep = np.where(c.recompute == FULL, layer_ep_fwd, 0.0)  # the recomputed forward dispatches again
    # ring attention beside the attention blocks; recomputation (full or selective) runs the
    # attention core again, and its ring with it
    layer_cp_fwd, layer_cp_bwd = ring_attention_times(comm, model, c, layer.core_time_s, layer.core_backward_s, eta_cp)
    recompute_cp = np.where(c.recompute == NONE, 0.0, layer_cp_fwd)
    n = 1.0  # `middle` is one layer until each stage takes its own count of layers below (_times)
    middle = StageTime(compute=n * (layer.time_s + layer.backward_s + host), recompute=n * recompute,
                       tp_comm=n * (layer_tp_fwd + layer_tp_bwd + recompute_tp),
                       cp_comm=n * (layer_cp_fwd + layer_cp_bwd + recompute_cp),
                       ep_comm=n * (layer_ep_fwd + layer_ep_bwd + recompute_ep),
                       backward=n * (layer.backward_s + host_bwd + recompute + layer_tp_bwd + recompute_tp
                                     + layer_cp_bwd + recompute_cp + layer_ep_bwd + recompute_ep),
                       forward_compute=n * (layer.time_s + host_fwd), forward_tp=n * layer_tp_fwd,
                       forward_cp=n * layer_cp_fwd, forward_ep=n * layer_ep_fwd, weight_grad=n * layer.weight_grad_s)
    # recomputation repeats the layer's kernels: they rest on the curves in the layer's proportion
    # (host time is measured: no curve)
    kernels = n * (layer.time_s + layer.backward_s) + middle.recompute - n * recompute_host
    middle.curve = layer.curve_s / (layer.time_s + layer.backward_s) * kernels
    return middle, host, recompute_host


def dense_variant(model: ModelSpec) -> ModelSpec:
    """`model`'s dense layer as a model of such layers alone (its experts' keys cleared): a MoE
    model's first dense_layers keep the dense FFN of `ffn` columns."""
    return replace(model, experts=0, topk=0, expert_ffn=0, shared_expert_ffn=0, dense_layers=0,
                               capacity_factor=0.0, routing_nodes=0)


def chunk_times(model: ModelSpec, c: Columns, costs: StageCosts, position: str) -> list:
    """The StageTimes of the chunks of the stage at `position` (one plan), chunk 0 first, from what
    its time is made of: each chunk's layers (MTP layers with their heads), the embedding and the
    loss's head on the chunks holding them, 1/v of the loop's time and of the stage's sends. What
    depends on the stage as a whole (the host time the device hides, gradient accumulation,
    data-parallel waits) is not in them: they give the chunks' shares of the stage's time."""
    layer_stage, embedding, head, loop, dense = costs.parts
    v = len(pipeline.chunk_layers(model, c, position))
    out = []
    for layers, d, (e, loss, mtp) in zip(pipeline.chunk_layers(model, c, position),
                                         pipeline.chunk_dense(model, c, position), pipeline.chunk_edges(c, position)):
        body = _times(layer_stage, layers + mtp) if dense is None else \
            _sum(_times(layer_stage, layers + mtp - d), _times(dense, d))  # a chunk's dense layers and MoE layers
        chunk = replace(_with_loop(body, loop / v), pp_comm=layer_stage.pp_comm / v)
        out.append(_plus(_plus(chunk, *embedding, e), *head, loss + mtp))
    return out


def overlapped_tp_times(model, device, peak_flops: float, layout, gemms: list, activation_bytes, tp_time, fp8=0,
                        efficiency=1.0, clock=1.0) -> tuple:
    """(forward, backward) exposed seconds of one 1d + SP layer's collectives with tp_overlap
    (Megatron-Core's --tp-comm-overlap): each all-gather is cut into t chunks pipelined with the
    column-parallel GEMM it feeds (QKV, FC1), each reduce-scatter with the row-parallel GEMM it
    leaves (projection, FC2), and likewise backward beside those GEMMs' two backward products;
    what a GEMM cannot hide, and always one chunk, stays exposed, and the 1 - `efficiency` share of
    the rest (collectives.overlap_efficiency less the SMs the kernels hold, contention.py; docs/equations.md 4.2,
    6.1). `gemms`: the layer's GEMMs (tensor_parallel.layer_gemms), at the SM clock ratio `clock`
    (clocks.py); `activation_bytes`: the [b, s, h] tensor. Latent attention's gathers are its
    latents', beside the up projections they feed (tensor_parallel.overlapped_pairs)."""
    times = {}
    for g in gemms:
        forward, _, first, second, _ = gemm_pass_times(device, peak_flops, g, fp8)  # fp8: layer.gemm_rate
        times[g.name] = (forward / clock, (first + second) / clock)
    pairs, exposed = tpc.overlapped_pairs(model, activation_bytes)
    pairs = [(tp_time([x]), name) for x, name in pairs]
    t = layout.size
    forward = sum(overlapped_exposure(comm, times[name][0], t, efficiency) for comm, name in pairs)
    backward = sum(overlapped_exposure(comm, times[name][1], t, efficiency) for comm, name in pairs)
    if exposed:
        forward, backward = forward + tp_time(exposed[0]), backward + tp_time(exposed[1])
    return forward, backward


def _host_beside_device(stage: StageTime, layers, host, recompute_host, loop, overlap) -> StageTime:
    """`stage` with only the shown share of its host time (cost/host.py): `layers` x `host` and the
    micro-batch's `loop` in compute, `layers` x `recompute_host` in recompute, a third of each in
    forward; without host_overlap all of it."""
    in_compute, in_recompute = layers * host + loop, layers * recompute_host
    total = in_compute + in_recompute
    hidden = 1 - shown_share(total, stage.total - total, overlap)
    forward = layers * host / 3 + loop / 3
    return replace(stage, compute=stage.compute - hidden * in_compute, recompute=stage.recompute - hidden * in_recompute,
                   forward_compute=stage.forward_compute - hidden * forward,
                   backward=stage.backward - hidden * (total - forward))


def _plus_compute(stage: StageTime, backward_seconds) -> StageTime:
    """`stage` with `backward_seconds` more of backward compute."""
    return replace(stage, compute=stage.compute + backward_seconds, backward=stage.backward + backward_seconds)


def _plus(stage: StageTime, extra: Work, tp_forward, tp_backward, times=1) -> StageTime:
    """`stage` with the embedding or the head added `times` times (0 or 1, or a head per MTP layer)."""
    extra_fwd, extra_bwd, tp_forward, tp_backward = (times * x for x in (extra.time_s, extra.backward_s, tp_forward,
                                                                          tp_backward))
    return StageTime(compute=stage.compute + extra_fwd + extra_bwd, recompute=stage.recompute,
                     tp_comm=stage.tp_comm + tp_forward + tp_backward, cp_comm=stage.cp_comm, pp_comm=stage.pp_comm,
                     dp_comm=stage.dp_comm, forward_cp=stage.forward_cp, ep_comm=stage.ep_comm,
                     forward_ep=stage.forward_ep,
                     backward=stage.backward + extra_bwd + tp_backward,
                     forward_compute=stage.forward_compute + extra_fwd, forward_tp=stage.forward_tp + tp_forward,
                     weight_grad=stage.weight_grad + times * extra.weight_grad_s, curve=stage.curve + times * extra.curve_s)


def _times(stage: StageTime, layers) -> StageTime:
    """`stage`, the time of one layer, for `layers` layers (its pipeline transfers once)."""
    return StageTime(**{f.name: getattr(stage, f.name) * (1 if f.name in ("pp_comm", "dp_comm") else layers)
                        for f in fields(StageTime)})


def _sum(a: StageTime, b: StageTime) -> StageTime:
    """Two StageTimes field by field (b's pipeline transfers 0: a stage sends once)."""
    return StageTime(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(StageTime)})


def _with_loop(stage: StageTime, seconds) -> StageTime:
    """`stage` with the training loop's own host time per micro-batch (docs/equations.md 8.2), a
    third of it in forward like a layer's host time."""
    return replace(stage, compute=stage.compute + seconds, forward_compute=stage.forward_compute + seconds / 3,
                   backward=stage.backward + 2 * seconds / 3)


@dataclass
class StagePhase:
    """What `StageTime` does not separate, per micro-batch on one device of a stage: the forward
    part of `compute` and of `tp_comm` (the rest of each is backward, and all of `recompute` is
    backward), and `weight_grad`, the weight-gradient GEMMs inside the backward compute (the W
    pass of a zero-bubble schedule; the rest of the backward compute is the input gradient)."""

    forward_compute: object = 0.0
    forward_tp: object = 0.0
    weight_grad: object = 0.0


def stage_phases(model: ModelSpec, system: System, c: Columns, peak_flops: float) -> tuple:
    """(first, middle, last) `StagePhase`s of the stages `stage_costs` times, read from the same
    StageTimes. A weight-gradient GEMM has the shape of its forward GEMM, so its time is the
    forward GEMM's (the efficiency model is symmetric, docs/equations.md section 3.8); the
    attention core's GEMMs have no weights and the embedding's backward is element-wise, so
    neither has a W part."""
    costs = stage_costs(model, system, c, peak_flops)
    return tuple(StagePhase(s.forward_compute, s.forward_tp, s.weight_grad) for s in (costs.first, costs.middle, costs.last))
