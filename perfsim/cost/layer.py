"""The ops of one micro-batch on one device: FLOPs, bytes and roofline time (docs/equations.md, section 3).

GEMM shapes come from the tensor-parallel layout (cost/tensor_parallel.py). Element-wise ops are
described by two divisors: `split`, the share of the linear outputs, attention scores and MLP
internals a device holds (1/t in 1d, 1/P in every mode), and `region`, the share of the
norm/dropout/residual tensors (1 in 1d, t with sequence parallelism, P in 2d/2.5d/3d).
Every function takes numbers or numpy arrays.

Backward: each GEMM becomes two GEMMs of the same size (data and weight gradient), twice the
forward time, since the efficiency model is symmetric in (m, n, k). Each element-wise op reads
its saved input and the incoming gradient and writes the outgoing gradient: three tensor passes
where its forward made two (read, write), so 1.5 times the forward bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfsim.cost.counts import ATTENTION_CORE
from perfsim.spec.model import ModelSpec
from perfsim.spec.system import Device

BF16 = 2  # bytes per element of activations and weights
FP32 = 4


@dataclass(frozen=True)
class Gemm:
    name: str
    count: object  # independent products (batched attention), number or array
    m: object
    n: object
    k: object


@dataclass(frozen=True)
class MemoryOp:
    name: str
    nbytes: object


@dataclass
class Work:
    """Forward work of a piece of the model on one device for one micro-batch."""

    flops: object = 0.0  # matmul FLOPs
    time_s: object = 0.0
    core_flops: object = 0.0  # the attention core (recomputed by selective recomputation)
    core_time_s: object = 0.0
    backward_s: object = 0.0  # the backward pass of the same ops
    weight_grad_s: object = 0.0  # the weight-gradient GEMMs inside backward_s (same shapes as forward)


def gemm_efficiency(device: Device, m, n, k):
    """Fraction of peak: the best case, reduced by each dimension d as d / (d + half_dim)."""
    half = device.gemm_half_dim
    return device.gemm_efficiency * (m / (m + half)) * (n / (n + half)) * (k / (k + half))


def gemm_time(device: Device, peak_flops: float, g: Gemm):
    flops = 2.0 * g.count * g.m * g.n * g.k
    nbytes = BF16 * g.count * (g.m * g.k + g.k * g.n + g.m * g.n)
    compute = flops / (peak_flops * gemm_efficiency(device, g.m, g.n, g.k))
    memory = nbytes / (device.memory_bandwidth_Bps * device.memory_efficiency)
    return np.maximum(compute, memory) + device.kernel_overhead_s


def memory_time(device: Device, op: MemoryOp):
    return op.nbytes / (device.memory_bandwidth_Bps * device.memory_efficiency) + device.kernel_overhead_s


def layer_memory_ops(model: ModelSpec, b, split, region_split) -> list[MemoryOp]:
    s, h, f, t = model.seq, model.hidden, model.ffn_size, split
    region = b * s * h / region_split  # elements of the norm/dropout/residual region
    scores = b * model.heads * s * s / t
    ops = [
        MemoryOp("norm1", 2 * BF16 * region),
        MemoryOp("softmax", 2 * BF16 * scores),
        MemoryOp("residual1", 3 * BF16 * region),
        MemoryOp("norm2", 2 * BF16 * region),
        # GeLU reads and writes the FC1 output; SwiGLU reads two halves and writes one.
        MemoryOp("activation", (3 if model.gated_mlp else 2) * BF16 * b * s * f / t),
        MemoryOp("residual2", 3 * BF16 * region),
    ]
    if model.dropout:  # read, write, and a one-byte mask
        ops += [MemoryOp("attn_dropout", (2 * BF16 + 1) * scores),
                MemoryOp("proj_dropout", (2 * BF16 + 1) * region),
                MemoryOp("mlp_dropout", (2 * BF16 + 1) * region)]
    if not model.learned_positions:  # rotary embedding rewrites Q and K
        ops.append(MemoryOp("rotary", 2 * BF16 * b * s * (h + model.kv_hidden) / t))
    return ops


GEMM_BACKWARD = 2.0  # data and weight gradient
MEMORY_BACKWARD = 1.5  # three tensor passes against two
CORE_MEMORY_OPS = ("softmax", "attn_dropout")


def work(device: Device, peak_flops: float, gemms: list, memory_ops: list) -> Work:
    """Forward time and FLOPs of a list of ops; the attention core is also summed on its own."""
    total = Work()
    for g in gemms:
        flops, time = 2.0 * g.count * g.m * g.n * g.k, gemm_time(device, peak_flops, g)
        total.flops, total.time_s = total.flops + flops, total.time_s + time
        if g.name in ATTENTION_CORE:  # no weights: both backward GEMMs are data gradients
            total.core_flops, total.core_time_s = total.core_flops + flops, total.core_time_s + time
        else:
            total.weight_grad_s = total.weight_grad_s + time
        total.backward_s = total.backward_s + GEMM_BACKWARD * time
    for op in memory_ops:
        time = memory_time(device, op)
        total.time_s = total.time_s + time
        total.backward_s = total.backward_s + MEMORY_BACKWARD * time
        if op.name in CORE_MEMORY_OPS:
            total.core_time_s = total.core_time_s + time
    return total


def embedding_work(model: ModelSpec, device: Device, b, region_split) -> Work:
    """First stage: word-embedding gather (read rows, write [b, s, h]), position add, dropout,
    on the device's share of the output."""
    full = b * model.seq * model.hidden / region_split
    nbytes = 2 * BF16 * full
    if model.learned_positions:
        nbytes = nbytes + 3 * BF16 * full
    if model.dropout:
        nbytes = nbytes + (2 * BF16 + 1) * full
    time = memory_time(device, MemoryOp("embedding", nbytes))
    return Work(time_s=time, backward_s=MEMORY_BACKWARD * time)


def head_memory_ops(model: ModelSpec, b, split, region_split, vocab) -> list[MemoryOp]:
    """Last stage around the logits GEMM: final norm, and the cross-entropy in fp32 (read bf16
    logits, write an fp32 copy, two fp32 reductions, keep the fp32 softmax for backward)."""
    tokens = b * model.seq
    return [MemoryOp("final_norm", 2 * BF16 * tokens * model.hidden / region_split),
            MemoryOp("cross_entropy", (BF16 + 4 * FP32) * tokens * vocab / split)]
