"""Peak memory of one device (docs/equations.md, section 7).

Model states follow mixed-precision Adam: bf16 weights (2 bytes), gradients (the framework's
grad_bytes_per_param), fp32 master weights, momentum and variance (12 bytes), sharded over the
data-parallel group by ZeRO stage: 1 shards the optimizer states, 2 also the gradients, 3 also
the weights. Activations follow Korthikanti et al. (2022) per layer, times the micro-batches a
pipeline stage holds at once. The first and the last stage are computed; the peak is the larger.
"""

from __future__ import annotations

import numpy as np

from perfsim.cost import counts
from perfsim.cost.columns import FULL, GPIPE, INTERLEAVED, SELECTIVE, Columns
from perfsim.cost.layer import BF16, FP32
from perfsim.spec.model import ModelSpec
from perfsim.spec.system import System

OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weights, Adam momentum and variance


def layer_activation_bytes(model: ModelSpec, b, t, sp, recompute):
    """Bytes one layer keeps for backward per micro-batch on one device.

    For a GPT layer (ffn = 4h, kv_heads = heads, dropout) this is Korthikanti's
    sbh(10 + 24/t + 5as/(ht)) without SP, (sbh/t)(34 + 5as/h) with SP, 34sbh/t (or sbh(10 + 24/t))
    with selective recomputation and 2sbh (2sbh/t with SP) with full recomputation.
    """
    s, h, a, f, kv = model.seq, model.hidden, model.heads, model.ffn_size, model.kv_hidden
    sbh = s * b * h
    region = np.where(sp, t, 1)
    mask = 1 if model.dropout else 0
    # norm inputs (2 x 2), QKV and FC1 inputs (2 x 2), two dropout masks (1 each)
    replicated = (8 + 2 * mask) * sbh / region
    mlp = (6 if model.gated_mlp else 4) * s * b * f
    # Q and K for the scores, V for the context, the context itself, and the MLP internals
    parallel = (2 * sbh + 2 * s * b * kv + 2 * s * b * kv + 2 * sbh + BF16 * mlp / 2) / t
    # softmax output, and with dropout its mask and output
    scores = (2 + 3 * mask) * a * s * s * b / t
    kept = replicated + parallel + np.where(recompute == SELECTIVE, 0, scores)
    return np.where(recompute == FULL, BF16 * sbh / region, kept)


def microbatches_in_flight(c: Columns, last_stage: bool):
    """Micro-batches whose activations a stage holds at its peak.

    GPipe: all m. 1F1B: the first stage p (or m if fewer), the last one. Interleaved with v chunks:
    the first stage p (1 + (p-1)/(p v)) (Korthikanti), the last 1 + (p-1)/v (an estimate: its
    warm-up covers the other chunks' micro-batches).
    """
    m, p, v = c.microbatches, c.pp, c.vpp
    if last_stage:
        steady = np.where(c.schedule == INTERLEAVED, 1 + (p - 1) / v, 1)
    else:
        steady = np.where(c.schedule == INTERLEAVED, p * (1 + (p - 1) / (p * v)), np.minimum(m, p))
    return np.where(c.schedule == GPIPE, m, steady)


def stage_params(model: ModelSpec, c: Columns, last_stage: bool):
    """Parameters one device holds for the first (or last) pipeline stage, before ZeRO-3."""
    t, p = c.tp, c.pp
    pieces = counts.layer_params(model)
    h = model.hidden
    bias = h if model.bias else 0
    replicated = pieces["norms"] + 2 * bias  # norms, and the biases of the row-parallel linears
    per_layer = (sum(pieces.values()) - replicated) / t + replicated
    params = per_layer * model.layers / p
    vocab = model.padded_vocab(t)
    emb = counts.embedding_params(model, 1)
    word = vocab * h / t
    first = word + emb["position"]
    last = counts.norm_params(model) + np.where(model.tied_embeddings & (p == 1), 0, word)
    ends = last if last_stage else first
    return params + np.where(p == 1, first + last, ends)


def memory_breakdown(model: ModelSpec, system: System, c: Columns, last_stage: bool) -> dict:
    """Bytes by kind on one device of the first (or last) stage."""
    b, t, dp, p = c.mbs, c.tp, c.dp, c.pp
    s, h = model.seq, model.hidden
    fw = system.framework
    params = stage_params(model, c, last_stage)
    weights = BF16 * params / np.where(c.zero >= 3, dp, 1)
    grads = fw.grad_bytes_per_param * params / np.where(c.zero >= 2, dp, 1)
    optimizer = OPTIMIZER_BYTES_PER_PARAM * params / np.where(c.zero >= 1, dp, 1)

    per_layer = layer_activation_bytes(model, b, t, c.sp, c.recompute)
    layers = model.layers / p
    in_flight = microbatches_in_flight(c, last_stage)
    region = np.where(c.sp, t, 1)
    activations = layers * in_flight * per_layer
    # Full recomputation rebuilds one layer's activations at a time during backward.
    activations = activations + np.where(c.recompute == FULL,
                                         layer_activation_bytes(model, b, t, c.sp, 0), 0)
    first = (p == 1) | (not last_stage)
    last = (p == 1) | last_stage
    if model.dropout:  # embedding dropout mask
        activations = activations + np.where(first, in_flight * s * b * h / region, 0)
    vocab = model.padded_vocab(t)
    # final norm input, the logits GEMM input, bf16 logits and their fp32 softmax for the loss
    head = BF16 * s * b * h / region + BF16 * s * b * h + (BF16 + FP32) * s * b * vocab / t
    activations = activations + np.where(last, head, 0)

    buffers = np.where(p > 1, 2 * BF16 * s * b * h / t, 0)  # pipeline receive buffers
    buffers = buffers + np.where(c.sp & (t > 1), BF16 * s * b * h, 0)  # sequence-parallel all-gather
    layer_weights = BF16 * (sum(counts.layer_params(model).values())) / t
    buffers = buffers + np.where(c.zero >= 3, 2 * layer_weights, 0)  # ZeRO-3: gathered + prefetched layer
    live = weights + grads + optimizer + activations + buffers
    buffers = buffers + fw.reserved_memory_bytes + fw.allocator_overhead_fraction * live
    total = weights + grads + optimizer + activations + buffers
    return {"weights": weights, "gradients": grads, "optimizer": optimizer,
            "activations": activations, "buffers": buffers, "total": total}


def peak_memory(model: ModelSpec, system: System, c: Columns) -> dict:
    """The stage (first or last) with the larger total; `stage` says which."""
    first = memory_breakdown(model, system, c, last_stage=False)
    last = memory_breakdown(model, system, c, last_stage=True)
    use_last = last["total"] > first["total"]
    peak = {k: np.where(use_last, last[k], first[k]) for k in first}
    peak["stage"] = np.where(use_last, "last", "first")
    return peak
