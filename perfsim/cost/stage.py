"""Time of one micro-batch on one device of a pipeline stage, by kind (docs/equations.md, section 8).

A stage holds L/p layers; the first also holds the embedding, the last the final norm, the
logits and the loss (with p = 1 one stage holds all). Per micro-batch a stage runs forward,
backward (twice the forward) and what recomputation repeats, issues its tensor-parallel
collectives (not overlapped, as in Megatron-LM), and sends its activation forward and its
gradient backward (v times each with v interleaved chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.collectives import CommModel
from perfsim.cost.columns import FULL, SELECTIVE, Columns
from perfsim.cost.data_parallel import zero3_microbatch_time
from perfsim.cost.layer import BF16, embedding_work, head_work, layer_work
from perfsim.cost.memory import stage_params
from perfsim.spec.model import ModelSpec
from perfsim.spec.system import System


@dataclass
class StageTime:
    """Seconds per micro-batch on one device of a stage, by kind; `total` is their sum."""

    compute: object = 0.0
    recompute: object = 0.0
    tp_comm: object = 0.0
    pp_comm: object = 0.0
    dp_comm: object = 0.0  # ZeRO-3 gathers not hidden behind compute
    backward: object = 0.0  # part of compute + recompute + tp_comm spent in backward

    @property
    def total(self):
        return self.compute + self.recompute + self.tp_comm + self.pp_comm + self.dp_comm

    def kinds(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "backward"}


@dataclass
class StageCosts:
    first: StageTime
    middle: StageTime
    last: StageTime
    params_first: object
    params_last: object


def stage_costs(model: ModelSpec, system: System, c: Columns, peak_flops: float) -> StageCosts:
    dev, comm = system.device, CommModel(system)
    b, t, p, sp = c.mbs, c.tp, c.pp, c.sp
    strides = c.strides
    tp_time = lambda coll: tpc.collectives_time(comm, coll, t, strides["tp"])  # noqa: E731

    layer = layer_work(model, dev, peak_flops, b, t, sp)
    fwd_coll, bwd_coll = tpc.layer_collectives(model, b, sp)
    layer_tp_fwd, layer_tp_bwd = tp_time(fwd_coll), tp_time(bwd_coll)
    recompute = np.where(c.recompute == FULL, layer.time_s, np.where(c.recompute == SELECTIVE, layer.core_time_s, 0.0))
    recompute_tp = np.where(c.recompute == FULL, layer_tp_fwd, 0.0)
    n = model.layers / p
    middle = StageTime(compute=n * 3 * layer.time_s, recompute=n * recompute,
                       tp_comm=n * (layer_tp_fwd + layer_tp_bwd + recompute_tp),
                       backward=n * (2 * layer.time_s + recompute + layer_tp_bwd + recompute_tp))

    # Pipeline neighbours exchange [b, s, h] / t (scatter/gather optimisation; with SP the
    # activation is already split); without SP the receiver all-gathers it inside its TP group.
    activation = BF16 * b * model.seq * model.hidden
    hop = comm.send(activation / t, strides["pp"]) + np.where(sp, 0.0, comm.all_gather(activation, t, strides["tp"]))
    middle.pp_comm = np.where(p > 1, 2 * c.vpp * hop, 0.0)

    emb = embedding_work(model, dev, b)
    emb_fwd, emb_bwd = tpc.embedding_collectives(model, b, sp)
    head = head_work(model, dev, peak_flops, b, t, sp, model.padded_vocab(t))
    head_fwd, head_bwd = tpc.head_collectives(model, b, sp)
    first = _plus(middle, 3 * emb.time_s, tp_time(emb_fwd) + tp_time(emb_bwd), 2 * emb.time_s + tp_time(emb_bwd))
    last = _plus(middle, 3 * head.time_s, tp_time(head_fwd) + tp_time(head_bwd), 2 * head.time_s + tp_time(head_bwd))
    single = _plus(first, 3 * head.time_s, tp_time(head_fwd) + tp_time(head_bwd), 2 * head.time_s + tp_time(head_bwd))
    first, last = (_where(p == 1, single, s) for s in (first, last))

    params_first, params_last = stage_params(model, c, False), stage_params(model, c, True)
    for stage, params in ((first, params_first), (middle, params_first), (last, params_last)):
        busy = stage.compute + stage.recompute
        stage.dp_comm = np.maximum(zero3_microbatch_time(system, comm, c, params) - busy, 0.0)
    return StageCosts(first, middle, last, params_first, params_last)


def _plus(stage: StageTime, compute, tp_comm, backward) -> StageTime:
    return StageTime(compute=stage.compute + compute, recompute=stage.recompute, tp_comm=stage.tp_comm + tp_comm,
                     pp_comm=stage.pp_comm, dp_comm=stage.dp_comm, backward=stage.backward + backward)


def _where(cond, a: StageTime, b: StageTime) -> StageTime:
    return StageTime(**{f.name: np.where(cond, getattr(a, f.name), getattr(b, f.name)) for f in fields(StageTime)})
