"""The ops of one micro-batch on one device: FLOPs, bytes and roofline time (docs/equations.md, section 3).

Shapes follow 1D tensor parallelism of size t: column-parallel QKV and FC1, row-parallel output
projection and FC2, heads split t ways; with sequence parallelism (sp) the norm/dropout/residual
region holds 1/t of the tokens. Every function takes numbers or numpy arrays for b, t and sp.

Backward of every op costs twice its forward: each GEMM becomes two GEMMs of the same size (data
and weight gradient) and each element-wise op reads the saved input and the incoming gradient and
writes the outgoing gradient. The GEMM efficiency model is symmetric in (m, n, k), so the two
backward GEMMs run at the forward's efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


def layer_gemms(model: ModelSpec, b, t) -> list[Gemm]:
    s, h, d = model.seq, model.hidden, model.head_dim
    tokens = b * s
    fc1_out = 2 * model.ffn_size if model.gated_mlp else model.ffn_size
    return [
        Gemm("qkv", 1, tokens, (h + 2 * model.kv_hidden) / t, h),
        Gemm("scores", b * model.heads / t, s, s, d),
        Gemm("context", b * model.heads / t, s, d, s),
        Gemm("proj", 1, tokens, h, h / t),
        Gemm("fc1", 1, tokens, fc1_out / t, h),
        Gemm("fc2", 1, tokens, h, model.ffn_size / t),
    ]


def layer_memory_ops(model: ModelSpec, b, t, sp) -> list[MemoryOp]:
    s, h, f = model.seq, model.hidden, model.ffn_size
    region = b * s * h / np.where(sp, t, 1)  # elements of the norm/dropout/residual region
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


CORE_MEMORY_OPS = ("softmax", "attn_dropout")


def layer_work(model: ModelSpec, device: Device, peak_flops: float, b, t, sp) -> Work:
    work = Work()
    for g in layer_gemms(model, b, t):
        flops, time = 2.0 * g.count * g.m * g.n * g.k, gemm_time(device, peak_flops, g)
        work.flops, work.time_s = work.flops + flops, work.time_s + time
        if g.name in ("scores", "context"):
            work.core_flops, work.core_time_s = work.core_flops + flops, work.core_time_s + time
    for op in layer_memory_ops(model, b, t, sp):
        time = memory_time(device, op)
        work.time_s = work.time_s + time
        if op.name in CORE_MEMORY_OPS:
            work.core_time_s = work.core_time_s + time
    return work


def embedding_work(model: ModelSpec, device: Device, b) -> Work:
    """First stage: word-embedding gather (write [b, s, h]), position add, dropout."""
    full = b * model.seq * model.hidden
    nbytes = 2 * BF16 * full  # gather: read rows, write output
    if model.learned_positions:
        nbytes = nbytes + 3 * BF16 * full
    if model.dropout:
        nbytes = nbytes + (2 * BF16 + 1) * full
    return Work(time_s=memory_time(device, MemoryOp("embedding", nbytes)))


def head_work(model: ModelSpec, device: Device, peak_flops: float, b, t, sp, vocab) -> Work:
    """Last stage: final norm, vocabulary-parallel logits GEMM over the padded `vocab`,
    cross-entropy in fp32 (read bf16 logits, write an fp32 copy, two fp32 reductions, keep the
    fp32 softmax for backward)."""
    s, h = model.seq, model.hidden
    region = b * s * h / np.where(sp, t, 1)
    logits = Gemm("logits", 1, b * s, vocab / t, h)
    entropy = MemoryOp("cross_entropy", (BF16 + 4 * FP32) * b * s * vocab / t)
    time = memory_time(device, MemoryOp("final_norm", 2 * BF16 * region)) + gemm_time(device, peak_flops, logits) \
        + memory_time(device, entropy)
    return Work(flops=2.0 * b * s * h * vocab / t, time_s=time)
