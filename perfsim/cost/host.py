"""The host's own time in a step and how much of it shows (docs/equations.md 8.1-8.3).

Beyond its kernels and collectives a step spends host time: per layer and micro-batch (autograd and
module dispatch, and a DTensor layer's redistributions), per micro-batch (the loop, the loss) and
per step (the optimizer's Python, zero_grad). Where the host runs the kernels itself (a CPU rank)
that time adds to the kernels'. Where it queues kernels for a device that runs them on its own (a
GPU: framework.host_overlap = 1), the two run side by side and a stretch of work takes the longer
of the host's time and the device's: the host's shows only where it exceeds the device's. The
harness waits for the device after every micro-batch (it reads the loss), so the comparison is
per micro-batch of a stage, and for the step's own host time against the optimizer's kernels.
"""

from __future__ import annotations

import numpy as np

from perfsim.cost.columns import FULL, NONE


# Dispatched ATen ops of one layer's forward and backward in eager PyTorch (validate.gpt's GPT layer,
# one micro-batch of one sequence on one device) with the unfused or the fused (flash) attention
# core, without, with selective and with full recomputation; counted in bf16 on torch 2.13's CPU
# build (tests/test_gpu_step_model.py counts every table here again; at one sequence a micro-batch:
# at more the unfused attention adds up to 4; in fp32 RMSNorm's casts to fp32 and back are not
# dispatched, 16/16/20 fewer a layer, and a MoE layer inside the GPT dispatches 4/4/6 fewer: not
# priced). layer_overhead_s is measured on the calibration model's layer (unfused, no
# recomputation): the host's time per layer scales with the ops the plan's layer dispatches
# (docs/equations.md 8.2). A fused kernel replaces a chain of ops; recomputation replays the
# forward's ops, and checkpointing adds its own, in backward.
HARNESS_LAYER_OPS = {"unfused": (116, 132, 189), "flash": (93, 100, 156)}
# What a Llama-shaped layer changes in those counts (none, selective, full); the changes add:
# its MLP's activation, RMSNorm for LayerNorm, no biases, and validate.gpt.GroupedAttention (rotary
# positions, fewer key/value heads, or both) for Attention.
HARNESS_FEATURE_OPS = {"gelu": (0, 0, 0), "swiglu": (16, 16, 20), "squared-relu": (6, 6, 9),
                       "rmsnorm": (40, 40, 50), "no_bias": (-12, -12, -12)}
HARNESS_GROUPED_OPS = {"unfused": {"rotary": (36, 36, 54), "gqa": (28, 36, 44), "both": (51, 59, 78)},
                       "flash": {"rotary": (36, 36, 54), "gqa": (14, 14, 22), "both": (37, 37, 56)}}
# A MoE layer (validate.moe.MoE, no biases) in place of the MLP, whose ops (HARNESS_MLP_OPS) it
# drops, and keeps again for a shared expert: the router, top-k, permutation and unpermutation on
# one device (HARNESS_ROUTE_OPS) and each local expert's (HARNESS_EXPERT_OPS). Spread over ranks
# its dispatch adds its own (HARNESS_DISPATCH_OPS, counted without recomputation; tests/
# test_validate_moe.py counts them on 2 and 4 gloo ranks): the all-to-all dispatcher its two
# all-to-alls there and back (ep > 1), the gathers and reduce-scatters of expert tensor parallelism
# (etp > 1), and, with more than one local expert and more than one source, the regrouping of the
# received chunks by expert (a fixed part and one per chunk: local experts x sources); the
# all-gather dispatcher its gathers, reduce-scatter and, with more than one local expert, a split
# by expert; under 1d tensor parallelism with SP, the shared expert's DTensor layers and the
# block's input and output taken from and handed back to the sequence shard (counted with a shared
# expert). Routing by top-k adds 3 ops with ep > 1 (the counts' all-gather), balanced routing none:
# not priced.
HARNESS_MLP_OPS = {"gelu": (30, 30, 50), "swiglu": (46, 46, 70), "squared-relu": (36, 36, 59)}
HARNESS_EXPERT_OPS = {"gelu": (27, 27, 48), "swiglu": (52, 52, 75), "squared-relu": (33, 33, 57)}
HARNESS_ROUTE_OPS = (58, 58, 92)
HARNESS_DISPATCH_OPS = {"all_to_all": 10, "expert_tp": 16, "regroup": 11, "regroup_chunk": 3, "allgather": 29,
                        "allgather_split": 2, "sequence_parallel": 31}


def _by_recompute(table, recompute):
    """Entries of a (none, selective, full) table at `recompute` (codes, numbers or arrays)."""
    return np.array(table, float)[np.asarray(recompute).astype(int)]  # a search's columns hold codes as floats


def harness_layer_ops(model, c, recompute):
    """Ops one layer's forward and backward dispatch in the harness (the tables above) under
    `recompute`, for the plan's attention core, the model's layer features and, where it has
    experts, its MoE layers on this rank (their moe_share of the layers, the rest dense)."""
    from perfsim.cost.experts import moe_share

    attention = np.where(c.flash, _by_recompute(HARNESS_LAYER_OPS["flash"], recompute),
                         _by_recompute(HARNESS_LAYER_OPS["unfused"], recompute))
    features = [model.activation] + ["rmsnorm"] * (model.norm == "rmsnorm") + ["no_bias"] * (not model.bias)
    ops = attention + sum(_by_recompute(HARNESS_FEATURE_OPS[f], recompute) for f in features)
    grouped = {(True, False): "rotary", (False, True): "gqa", (True, True): "both"}.get(
        (not model.learned_positions, model.kv_head_count < model.heads))
    if grouped:
        ops = ops + np.where(c.flash, _by_recompute(HARNESS_GROUPED_OPS["flash"][grouped], recompute),
                             _by_recompute(HARNESS_GROUPED_OPS["unfused"][grouped], recompute))
    share = moe_share(model)
    if not share:
        return ops
    mlp = _by_recompute(HARNESS_MLP_OPS[model.activation], recompute)
    return ops + share * (harness_moe_ops(model, c, recompute) - mlp)


def harness_moe_ops(model, c, recompute):
    """Ops a MoE layer's block (validate.moe.MoE: router, experts, shared expert, dispatch) dispatches
    forward and backward on this rank under `recompute` (the tables above; the dispatcher's own
    counted without recomputation: under full recomputation its replayed forward is not counted)."""
    act = model.activation
    local = model.experts / c.ep
    block = (_by_recompute(HARNESS_ROUTE_OPS, recompute) + local * _by_recompute(HARNESS_EXPERT_OPS[act], recompute)
             + bool(model.shared_expert_ffn) * _by_recompute(HARNESS_MLP_OPS[act], recompute))
    d = HARNESS_DISPATCH_OPS
    etp, sources = c.expert_tp, c.ep * c.expert_tp
    alltoall = (d["all_to_all"] * (c.ep > 1) + d["expert_tp"] * (etp > 1)
                + np.where((local > 1) & (sources > 1), d["regroup"] + d["regroup_chunk"] * local * sources, 0.0))
    allgather = np.where(c.ep > 1, d["allgather"] + np.where(local > 1, d["allgather_split"], 0.0), 0.0)
    sequence_parallel = d["sequence_parallel"] * ((c.tp_mode == "1d") & (c.tp > 1) & np.asarray(c.sp, bool))
    return block + np.where(np.asarray(c.allgather) > 0, allgather, alltoall) + sequence_parallel


def _op_share(model, c, recompute):
    """harness_layer_ops of each plan under `recompute` over the calibration layer's (unfused, no
    recomputation)."""
    return harness_layer_ops(model, c, recompute) / HARNESS_LAYER_OPS["unfused"][0]


def layer_host_overhead(system, model, c):
    """Host seconds one layer's forward and backward of a micro-batch pay beyond their kernels and
    collectives, recomputation aside: the profile's layer_overhead_s (any plan: autograd and module
    dispatch, docs/equations.md 8.2) scaled by the ops the plan's layer dispatches, plus what a
    tensor-parallel implementation adds, tp_layer_overhead_s (sp_layer_overhead_s with SP) in 1d
    with t > 1 (Megatron-LM's layers and the 2d/2.5d/3d ones add none, 8.1)."""
    fw = system.framework
    per_layer = np.where(c.sp, fw.sp_layer_overhead_s, fw.tp_layer_overhead_s)
    return (np.where((c.tp_mode == "1d") & (c.tp > 1), per_layer, 0.0)
            + fw.layer_overhead_s * _op_share(model, c, NONE + 0 * c.recompute))


def recompute_host_overhead(system, model, c, host):
    """Host seconds recomputation adds to one layer's backward: the loop's by the extra ops the
    plan's recomputation dispatches (harness_layer_ops), and with full recomputation a third of
    the tensor-parallel implementation's, whose forward runs again (`host`: layer_host_overhead)."""
    fw = system.framework
    none = _op_share(model, c, NONE + 0 * c.recompute)
    loop = fw.layer_overhead_s * none
    extra = fw.layer_overhead_s * (_op_share(model, c, c.recompute) - none)
    return extra + np.where(c.recompute == FULL, (host - loop) / 3, 0.0)


def shown_share(host, device, overlap):
    """The share of `host` seconds that shows beside `device` seconds of kernels and communication:
    all of it without host_overlap; with it, only what exceeds the device's time."""
    host = np.asarray(host, float)
    shown = np.where(bool(overlap), np.maximum(host - device, 0.0), host)
    return np.divide(shown, host, out=np.ones_like(shown * host), where=host > 0)


def shown_step_overhead(system, optimizer):
    """framework.step_overhead_s as it shows after a step's optimizer kernels of `optimizer`
    seconds: beside them with host_overlap (the host's step work is the optimizer's issue), after
    them without."""
    fw = system.framework
    return fw.step_overhead_s * shown_share(fw.step_overhead_s, optimizer, fw.host_overlap)
