"""Closed-form step time of a pipeline schedule (docs/equations.md, section 9).

With stage times T_i per micro-batch (forward + backward + recompute + communication) and m
micro-batches, GPipe and 1F1B both take
    T = (m - 1) max_i T_i + sum_i T_i,
which is SC21's (m + p - 1) T for equal stages: the bubble is (p - 1) T. They differ in memory
(GPipe keeps all m micro-batches' activations), not in time. Interleaved 1F1B with v chunks per
device shrinks the bubble v-fold:
    T = m max_i T_i + (p - 1)/v * mean_i T_i.
After the pipeline drains: the data-parallel gradient reduction and weight gather (what of them
does not hide behind the last backward and the first forward when the plan overlaps them), the tied-embedding gradient all-reduce between first and last stage, the
optimizer step and the framework's fixed per-step overhead. Last, what the whole step waits for its
slowest rank (framework.rank_jitter, cost/synchrony.py).
"""

from __future__ import annotations

import functools

import numpy as np

from perfsim.cost import experts
from perfsim.cost.contention import overlap_efficiency
from perfsim.cost.topology import TopologyCommModel
from perfsim.cost.columns import INTERLEAVED, Columns, stage_layer_count
from perfsim.cost.data_parallel import optimizer_time, step_reduction_time, tied_embedding_time, zero3_units
from perfsim.cost.fp8 import weight_cast_time
from perfsim.cost.grad_passes import grad_buffer_pass_time
from perfsim.cost.host import shown_step_overhead
from perfsim.cost.overlap import overlapped_exposure
from perfsim.cost.stage import StageCosts
from perfsim.cost.tensor_parallel import replicated_grad_params, replicated_grad_time
from perfsim.cost.synchrony import synchrony_time
from perfsim.spec.model import ModelSpec
from perfsim.spec.system import System

BREAKDOWN_KEYS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "pp_bubble", "dp_comm", "optimizer", "other",
                  "synchrony")


def step_time(model: ModelSpec, system: System, c: Columns, stages: StageCosts) -> tuple:
    """(step time in s, exposed-time breakdown dict whose values add up to it)."""
    m, p, v = c.microbatches, c.pp, c.vpp
    # every stage position (first, middle, last, or a layout's stages; cost/pipeline.py), the ends first
    rows = stages.stages(model, c)
    at = {pos: t for pos, t, _, _ in rows}
    total_all = sum(count * t.total for _, t, _, count in rows)
    # the pipeline's pace: the first or last stage, or with an uneven split or a layout another (docs/equations.md 9.4)
    paces = [np.where(count > 0, t.total, 0.0) for _, t, _, count in rows]
    slowest = functools.reduce(np.maximum, paces)
    pipeline = np.where(c.schedule == INTERLEAVED, m * slowest + (p - 1) / v * total_all / p,
                        (m - 1) * slowest + total_all)

    def slow_stage(of):  # `of` the slowest stage (position name -> value), the first in `rows` on a tie
        return _first_at(paces, slowest, [of(pos) for pos, _, _, _ in rows])

    kinds = {k: slow_stage(lambda s: getattr(at[s], k)) for k in stages.first.KINDS}
    slow = {k: slow_stage(lambda s: getattr(at[s], k)) for k in ("backward", "forward_compute", "forward_tp")}
    breakdown = {k: m * kinds[k] for k in ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm")}
    # Exactly zero without a pipeline; never negative from rounding.
    breakdown["pp_bubble"] = np.where(p == 1, 0.0, np.maximum(pipeline - m * slowest, 0.0))
    breakdown["dp_comm"] = m * kinds["dp_comm"]

    comm = TopologyCommModel(system)
    # the stage holding the most parameters: first or last, or with an uneven split or a layout another
    held = [np.where(count > 0, n, 0.0) for _, _, n, count in rows]
    params = functools.reduce(np.maximum, held)

    def heaviest(of):  # `of` the stage with the most parameters, the first in `rows` on a tie
        return _first_at(held, params, [of(pos) for pos, _, _, _ in rows])

    units = heaviest(lambda s: zero3_units(model, c, s))
    # a MoE model's routed experts reduce over the expert-data-parallel group (cost/experts.py)
    expert_params = heaviest(lambda s: experts.stage_expert_params(model, c, stage_layer_count(model, c, s),
                                                                   experts.stage_share(model, c, s)))
    reduction, gather = step_reduction_time(system, comm, c, params - expert_params, units)
    if model.moe:
        expert_reduction, expert_gather = experts.expert_reduction_times(system, comm, c, expert_params)
        reduction, gather = reduction + expert_reduction, gather + expert_gather
    # Overlapped (dp_overlap): the reduction bucket by bucket (one per layer) behind the slowest
    # stage's last backward, the gather behind the next step's first forward (docs/equations.md 9.2).
    buckets = slow_stage(lambda s: stage_layer_count(model, c, s))
    eta = overlap_efficiency(system, "dp")  # less the SMs NCCL's channels hold beside the compute
    reduction = np.where(c.dp_overlap, overlapped_exposure(reduction, slow["backward"], buckets, eta), reduction)
    gather = np.where(c.dp_overlap, overlapped_exposure(gather, slow["forward_compute"] + slow["forward_tp"], buckets,
                                                        eta), gather)
    breakdown["dp_comm"] = breakdown["dp_comm"] + reduction + gather

    # Tied embeddings: the first and last stage all-reduce the word-embedding gradient.
    breakdown["pp_comm"] = breakdown["pp_comm"] + tied_embedding_time(model, system, comm, c)
    # latent attention under 1d TP + SP: each stage all-reduces its down projections' gradients over
    # TP (their weights are whole on every rank); the step waits for the slowest stage's
    if model.mla:
        breakdown["tp_comm"] = breakdown["tp_comm"] + functools.reduce(np.maximum, [
            np.where(count > 0, replicated_stage_grad_time(model, system, comm, c, pos), 0.0) for pos, _, _, count in rows])

    # the optimizer step, the passes over the gradient buffer before it (grad_passes.py), and in
    # FP8 the cast of the updated weights it is followed by
    breakdown["optimizer"] = optimizer_time(system, c, experts.optimizer_params(c, params, expert_params)) \
        + grad_buffer_pass_time(system, params) \
        + weight_cast_time(model, system, c, heaviest(lambda s: stage_layer_count(model, c, s))) \
        + heaviest(lambda s: experts.expert_weight_cast_time(model, system, c, stage_layer_count(model, c, s),
                                                              experts.stage_share(model, c, s)))
    breakdown["other"] = shown_step_overhead(system, breakdown["optimizer"]) + 0.0 * pipeline
    # what the job waits for its slowest rank at the optimizer step, every group's wait nested in
    # it (cost/synchrony.py; docs/equations.md 9.5)
    breakdown["synchrony"] = synchrony_time(system, c, sum(breakdown[k] for k in BREAKDOWN_KEYS if k != "synchrony"))
    total = sum(breakdown[k] for k in BREAKDOWN_KEYS)
    return total, {k: breakdown[k] for k in BREAKDOWN_KEYS}


def replicated_stage_grad_time(model: ModelSpec, system: System, comm, c: Columns, position: str):
    """Seconds the position's stage all-reduces its layers' replicated gradients over TP once a step
    (its decoder and MTP layers; tensor_parallel.replicated_grad_params)."""
    from perfsim.cost.pipeline import mtp_count

    layers = stage_layer_count(model, c, position) + mtp_count(c, position)
    return replicated_grad_time(system, comm, c, layers * replicated_grad_params(model, c))


def _first_at(keys: list, best, values: list):
    """Row by row, values[k] of the first k whose keys[k] equals `best` (the last where none does)."""
    out = values[-1]
    for key, value in zip(reversed(keys[:-1]), reversed(values[:-1])):
        out = np.where(key == best, value, out)
    return out
