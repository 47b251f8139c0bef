"""The ops of one micro-batch on one device: FLOPs, bytes and roofline time (docs/equations.md, section 3).

GEMM shapes come from the tensor-parallel layout (cost/tensor_parallel.py). Element-wise ops are
described by two divisors: `split`, the share of the linear outputs, attention scores and MLP
internals a device holds (1/t in 1d, 1/P in every mode), and `region`, the share of the
norm/dropout/residual tensors (1 in 1d, t with sequence parallelism, P in 2d/2.5d/3d).
Every function takes numbers or numpy arrays.

Backward: each GEMM becomes two GEMMs of the same size (data and weight gradient), twice the
forward time where the efficiency model is symmetric in (m, n, k) (no gemm_half_dim_k, no
measured table; otherwise each at its own shape, gemm_pass_times). Each element-wise op reads
its saved input and the incoming gradient and writes the outgoing gradient: three tensor passes
where its forward made two (read, write), so 1.5 times the forward bytes.

Element-wise ops have a kind (layernorm, softmax, gelu, add, dropout, cross_entropy; "" for the
embedding and rotary, priced generically). A profile's optional
[device.operation_memory_efficiency] prices a kind's forward or backward kernel with its own
efficiency; without an entry a kind runs at memory_efficiency and its backward takes
MEMORY_BACKWARD x its forward time, as before the table existed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from perfsim.cost import measured
from perfsim.cost.counts import ATTENTION_CORE, mean_attention_keys
from perfsim.spec.model import ModelSpec
from perfsim.spec.system import BACKWARD, Device

BF16 = 2  # bytes per element of activations and weights
FP32 = 4
MEMORY_BACKWARD = 1.5  # three tensor passes against two (the bytes of an element-wise backward)
# Forward bytes per element of each element-wise kind: (tensor passes, extra bytes), i.e. passes x
# the element size + extra: reads + writes, a dropout's one-byte mask, and the cross-entropy's bf16
# logits read once plus four fp32 passes (head_memory_ops). The calibration harness
# (validate/microbench.py) counts its measurements with the same table.
KIND_TRAFFIC = {"layernorm": (2, 0), "softmax": (2, 0), "gelu": (2, 0), "add": (3, 0), "dropout": (2, 1),
                "cross_entropy": (1, 4 * FP32)}
# perfsim's element-wise ops and their kinds (the embedding and rotary have none: generic).
OP_KINDS = {"norm1": "layernorm", "norm2": "layernorm", "final_norm": "layernorm", "softmax": "softmax",
            "activation": "gelu", "residual1": "add", "residual2": "add", "attn_dropout": "dropout",
            "proj_dropout": "dropout", "mlp_dropout": "dropout", "cross_entropy": "cross_entropy"}


def kind_bytes(kind: str, element: int = BF16) -> int:
    """Forward bytes per element of an element-wise kind with `element`-byte tensors."""
    passes, extra = KIND_TRAFFIC[kind]
    return passes * element + extra


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
    nbytes: object  # forward bytes; the backward moves MEMORY_BACKWARD x as many
    kind: str = ""  # one of perfsim.spec.system.MEMORY_KINDS, or "" (generic)
    dtype: str = ""  # the dtype its kernel runs in where not the step's (an autocast op's fp32): its tables'


# FlashAttention-style kernels (Dao et al. 2022; Shah et al. 2024, FlashAttention-3): a causal mask
# lets the kernel skip the key blocks above the diagonal, about half of the s x s products; the
# backward recomputes the scores and runs four more products (dP, dV, dQ, dK): 5 against the
# forward's 2 (docs/equations.md 3.9).
CAUSAL_WORK = 0.5
FLASH_BACKWARD = 2.5


@dataclass
class Work:
    """Forward work of a piece of the model on one device for one micro-batch."""

    flops: object = 0.0  # matmul FLOPs
    time_s: object = 0.0
    core_flops: object = 0.0  # the attention core (recomputed by selective recomputation)
    core_time_s: object = 0.0
    core_backward_s: object = 0.0  # the attention core's part of backward_s
    backward_s: object = 0.0  # the backward pass of the same ops
    weight_grad_s: object = 0.0  # the weight-gradient GEMMs inside backward_s (backward_gemms' second)
    curve_s: object = 0.0  # of time_s + backward_s, what rests on the parametric curves alone (cost/measured.py)


def gemm_efficiency(device: Device, m, n, k):
    """Fraction of peak: the best case, reduced by each dimension d as d / (d + half_dim); the
    reduction dimension k by its own gemm_half_dim_k where the profile has one (docs/equations.md
    3.1: an output tile's k-loop amortises its prologue and epilogue, which m and n do not)."""
    half = device.gemm_half_dim
    # `is None`, not `or`: under draws of a profile's ranges these numbers are arrays
    half_k = half if device.gemm_half_dim_k is None else device.gemm_half_dim_k
    return device.gemm_efficiency * (m / (m + half)) * (n / (n + half)) * (k / (k + half_k))


def gemm_curve_time(device: Device, peak_flops: float, count, m, n, k):
    """The parametric GEMM model: roofline of the efficiency model and the streaming bytes."""
    flops = 2.0 * count * m * n * k
    nbytes = BF16 * count * (m * k + k * n + m * n)
    compute = flops / (peak_flops * gemm_efficiency(device, m, n, k))
    memory = nbytes / (device.memory_bandwidth_Bps * device.memory_efficiency)
    return np.maximum(compute, memory) + device.kernel_overhead_s


def _at_peak_of(device: Device, peak_flops, dtype: str) -> bool:
    """Whether a kernel timed at `peak_flops` runs in `dtype` (a measured table's): at that dtype's
    peak, in every draw where the peaks are arrays over a profile's ranges."""
    peak = getattr(device, f"peak_flops_{dtype}", None)
    return peak is not None and bool(np.all(np.asarray(peak_flops) == np.asarray(peak)))


def gemm_time_and_share(device: Device, peak_flops: float, g: Gemm) -> tuple:
    """(seconds, share of them resting on the curve alone): the parametric model, corrected by
    the profile's measured GEMMs of the prediction's dtype near this shape (perfsim.cost.measured;
    share 1 without them)."""
    time = gemm_curve_time(device, peak_flops, g.count, g.m, g.n, g.k)
    table = measured.find_table(device.measured, measured.GEMM, device.kernel_dtype)
    if table is None or not _at_peak_of(device, peak_flops, table.dtype):
        return time, 1.0  # no table, or a GEMM in another dtype than the table's (an fp8 step's weight GEMMs)
    factor, share = measured.correction(table, [g.count, g.m, g.n, g.k],
                                        gemm_curve_time(device, peak_flops, *table.coordinates_across()))
    return time * factor, share


def gemm_time(device: Device, peak_flops: float, g: Gemm):
    return gemm_time_and_share(device, peak_flops, g)[0]


def backward_gemms(g: Gemm) -> tuple:
    """The two products of C[m, n] = A[m, k] B[k, n]'s backward, each at its own shape: A's
    gradient dC B^T (m, k, n) and B's gradient (k, n, m); a weight's gradient (a linear layer's
    W[n, k]) as torch computes it, dC^T A (n, k, m). Same FLOPs as the forward, other shapes: a
    logits head's data gradient (tokens x hidden, summed over the vocabulary) runs at another
    efficiency than its forward (tokens x vocabulary over hidden)."""
    first = replace(g, n=g.k, k=g.n)
    second = replace(g, m=g.k, n=g.n, k=g.m) if g.name in ATTENTION_CORE else replace(g, m=g.n, n=g.k, k=g.m)
    return first, second


def gemm_pass_times(device: Device, peak_flops: float, g: Gemm, fp8=0) -> tuple:
    """(forward seconds, its curve share, seconds of the first and of the second backward product
    (backward_gemms), their curve share), at gemm_rate's device and peak. The parametric curve is
    symmetric in m, n and k without gemm_half_dim_k, so without it and without a measured table
    each backward product takes the forward's time; otherwise each is timed at its own shape."""
    rate = gemm_rate(device, peak_flops, g, fp8)
    forward, share = gemm_time_and_share(*rate, g)
    if (measured.find_table(device.measured, measured.GEMM, device.kernel_dtype) is None
            and device.gemm_half_dim_k is None):
        return forward, share, forward, forward, share
    (first, first_share), (second, second_share) = (gemm_time_and_share(*rate, b) for b in backward_gemms(g))
    return forward, share, first, second, (first * first_share + second * second_share) / (first + second)


def _streaming_time(device: Device, nbytes, efficiency):
    return nbytes / (device.memory_bandwidth_Bps * efficiency) + device.kernel_overhead_s


def _measured(device: Device, kernel: str, nbytes, curve_of, dtype: str = "") -> tuple:
    """(seconds, curve share) of an element-wise kernel of `nbytes`: `curve_of(bytes)`, corrected
    by the profile's table of that kernel in `dtype` (default: the prediction's) where it has one
    (its points priced by the same curve)."""
    curve = curve_of(nbytes)
    table = measured.find_table(device.measured, kernel, dtype or device.kernel_dtype) if kernel else None
    if table is None:
        return curve, 1.0
    factor, share = measured.correction(table, [nbytes], curve_of(table.coordinates_across()[0]))
    return curve * factor, share


def memory_times_and_shares(device: Device, op: MemoryOp) -> tuple:
    """(forward, backward, forward curve share, backward curve share): memory_times, each kernel
    corrected by its measured table (perfsim.cost.measured) where the profile has one."""
    efficiency = device.memory_efficiency_of(op.kind)
    efficiency = device.memory_efficiency if efficiency is None else efficiency
    forward_curve = lambda nbytes: _streaming_time(device, nbytes, efficiency)  # noqa: E731
    backward_efficiency = device.memory_efficiency_of(op.kind, backward=True)
    if backward_efficiency is None:  # MEMORY_BACKWARD x the forward time of 1 / MEMORY_BACKWARD of the bytes
        backward_curve = lambda nbytes: MEMORY_BACKWARD * forward_curve(nbytes / MEMORY_BACKWARD)  # noqa: E731
    else:
        backward_curve = lambda nbytes: _streaming_time(device, nbytes, backward_efficiency)  # noqa: E731
    forward, forward_share = _measured(device, op.kind, op.nbytes, forward_curve, op.dtype)
    backward, backward_share = _measured(device, op.kind + BACKWARD if op.kind else "", MEMORY_BACKWARD * op.nbytes,
                                         backward_curve, op.dtype)
    return forward, backward, forward_share, backward_share


def memory_times(device: Device, op: MemoryOp) -> tuple:
    """(forward, backward) seconds of an element-wise op: bytes / (bandwidth x efficiency) + one
    kernel overhead each, the efficiency of the op's kind and direction where the profile has one
    (the backward moving MEMORY_BACKWARD x the forward bytes); otherwise memory_efficiency forward
    and MEMORY_BACKWARD x the forward time backward. Measured tables correct either near the
    sizes they hold."""
    return memory_times_and_shares(device, op)[:2]


def memory_time(device: Device, op: MemoryOp, backward: bool = False):
    """Seconds of an element-wise op's forward kernel, or of its backward (memory_times)."""
    return memory_times(device, op)[1 if backward else 0]


def measured_memory_op(name: str, nbytes) -> tuple:
    """(MemoryOp, backward?) of a measured element-wise kernel named as the profile's table names
    them ("layernorm", "softmax_backward"; any other name, copy or triad, is generic), from the
    bytes recorded with it by perfsim's convention (a backward kernel's: MEMORY_BACKWARD x its
    forward's)."""
    kind = name[:-len(BACKWARD)] if name.endswith(BACKWARD) else name
    if kind not in KIND_TRAFFIC:
        return MemoryOp(name, nbytes), False
    if kind == name:
        return MemoryOp(name, nbytes, kind), False
    return MemoryOp(name, nbytes / MEMORY_BACKWARD, kind), True


def _op(name: str, nbytes) -> MemoryOp:
    return MemoryOp(name, nbytes, OP_KINDS.get(name, ""))


def autocast_ops(name: str, elements, element=BF16) -> list[MemoryOp]:
    """The two casts torch.autocast puts around an op it runs in fp32 (LayerNorm, softmax): its
    `element`-byte input to an fp32 copy, and its fp32 output back to `element` bytes where the
    next GEMM takes it; each reads one and writes the other (docs/equations.md 3.5)."""
    nbytes = (element + FP32) * elements
    return [MemoryOp(f"{name}_to_fp32", nbytes), MemoryOp(f"{name}_from_fp32", nbytes)]


def _fp32_under_autocast(name: str, kind: str, elements, element, autocast) -> list[MemoryOp]:
    """An element-wise op of `elements` elements as a step runs it: in `element`-byte tensors, or
    under autocast in fp32 (priced by the profile's fp32 tables of its kind where it has them: a GPU
    campaign measures them) between its two casts."""
    if not autocast:
        return [_op(name, kind_bytes(kind, element) * elements)]
    return [MemoryOp(name, kind_bytes(kind, FP32) * elements, kind, "fp32")] + autocast_ops(name, elements, element)


def layer_memory_ops(model: ModelSpec, b, split, region_split, element=BF16, autocast=0) -> list[MemoryOp]:
    """The element-wise ops of one layer, their tensors of `element` bytes (4 when training in
    fp32); with `autocast` (framework.autocast) the norms and the softmax run in fp32 between casts."""
    s, h, f, t, e = model.seq, model.hidden, model.ffn_size, split, element
    region = b * s * h / region_split  # elements of the norm/dropout/residual region
    scores = b * model.heads * s * mean_attention_keys(model) / t
    ops = [
        *_fp32_under_autocast("norm1", "layernorm", region, e, autocast),
        *_fp32_under_autocast("softmax", "softmax", scores, e, autocast),
        _op("residual1", kind_bytes("add", e) * region),
        *_fp32_under_autocast("norm2", "layernorm", region, e, autocast),
        # GeLU reads and writes the FC1 output; SwiGLU reads two halves and writes one (priced as
        # the gelu kind too).
        _op("activation", (3 * e if model.gated_mlp else kind_bytes("gelu", e)) * b * s * f / t),
        _op("residual2", kind_bytes("add", e) * region),
    ]
    if model.dropout:  # read, write, and a one-byte mask
        ops += [_op("attn_dropout", kind_bytes("dropout", e) * scores),
                _op("proj_dropout", kind_bytes("dropout", e) * region),
                _op("mlp_dropout", kind_bytes("dropout", e) * region)]
    if model.mla:  # the latents' RMSNorms on the rank's tokens; rotary rewrites the queries' and the key's rope part
        latents = b * s * (model.q_lora_rank + model.kv_lora_rank) / region_split
        ops += [*_fp32_under_autocast("latent_norm", "layernorm", latents, e, autocast),
                _op("rotary", 2 * e * b * s * (model.heads * model.qk_rope_dim / t + model.qk_rope_dim))]
        return ops
    if model.qk_norm:  # a norm of each query and key head
        ops += _fp32_under_autocast("qk_norm", "layernorm", b * s * (model.q_width + model.kv_hidden) / t, e, autocast)
    if not model.learned_positions:  # rotary embedding rewrites Q and K
        ops.append(_op("rotary", 2 * e * b * s * (model.q_width + model.kv_hidden) / t))
    return ops


CORE_MEMORY_OPS = ("softmax", "softmax_to_fp32", "softmax_from_fp32", "attn_dropout")


def causal_share(m, n):
    """Share of an m x n block of scores a causal kernel computes: CAUSAL_WORK of a square; of a
    sliding window's m queries x n (< m) keys all but the n x n / 2 triangle the first queries lack."""
    return 1 - CAUSAL_WORK * np.minimum(n, m) / m


def flash_curve_times(device: Device, peak_flops: float, count, m, n, k) -> tuple:
    """(forward, backward) seconds of the fused causal attention kernel for `count` sequence-heads
    of scores s x s x d (m = n = s, k = d) and the matching context product: the FLOPs the kernel
    executes (CAUSAL_WORK of the full square; FLASH_BACKWARD x as many backward) at the profile's
    flash efficiencies, or, where it names none, at the GEMM model's efficiency for the scores
    shape; plus the softmax's own time per executed score (device.flash_score_s, where the profile
    has it: the exponentials and rescaling run beside the tensor cores, not on them, so a kernel of
    small head dimension reaches less of peak), the backward's in the same proportion to its
    products as the forward's (docs/equations.md 3.9); one kernel launch each way."""
    scores = causal_share(m, n) * count * m * n
    executed = 2 * 2.0 * scores * k
    # `is None`, not `or`: under draws of a profile's ranges these numbers are arrays
    forward_eff = device.flash_forward_efficiency
    forward_eff = gemm_efficiency(device, m, n, k) if forward_eff is None else forward_eff
    backward_eff = forward_eff if device.flash_backward_efficiency is None else device.flash_backward_efficiency
    softmax = 0.0 if device.flash_score_s is None else device.flash_score_s * scores
    return (executed / (peak_flops * forward_eff) + softmax + device.kernel_overhead_s,
            FLASH_BACKWARD * (executed / (peak_flops * backward_eff) + softmax * forward_eff / backward_eff)
            + device.kernel_overhead_s)


def flash_attention_times(device: Device, peak_flops: float, scores: Gemm) -> tuple:
    """(forward, backward, forward's share on the curve, backward's) of the attention core as one
    fused causal kernel for the `scores` GEMM's shape: flash_curve_times, corrected by the
    profile's measured flash kernels of the prediction's dtype near that shape (share 1 without)."""
    shape = [scores.count, scores.m, scores.n, scores.k]
    curves = flash_curve_times(device, peak_flops, *shape)
    out = []
    for direction, (kernel, curve) in enumerate(zip(measured.FLASH_KERNELS, curves)):
        table = measured.find_table(device.measured, kernel, device.kernel_dtype)
        if table is None or not _at_peak_of(device, peak_flops, table.dtype):
            out.append((curve, 1.0))
            continue
        at_points = flash_curve_times(device, peak_flops, *table.coordinates_across())[direction]
        factor, share = measured.correction(table, shape, at_points)
        out.append((curve * factor, share))
    (forward, forward_share), (backward, backward_share) = out
    return forward, backward, forward_share, backward_share


# FP8 training (--dtype fp8, Transformer Engine's recipe; docs/equations.md 3.11): a layer's weight
# GEMMs run on FP8 copies of their operands. Each cast reads the bf16 tensor and writes its FP8
# copy and the copy's transpose (Hopper's FP8 GEMMs take one layout only, so the backward's
# products need the transposes): BF16 + 2 x FP8 bytes per element.
FP8 = 1
FP8_CAST_BYTES = BF16 + 2 * FP8


def gemm_rate(device: Device, peak_flops: float, g: Gemm, fp8=0) -> tuple:
    """(device, peak) a GEMM is timed with: a weight GEMM in FP8 (fp8 = 1) at the FP8 peak, its
    efficiency model's best case fp8_gemm_efficiency where the profile gives one (else the bf16
    GEMM's); the attention core, and every GEMM in other dtypes, as given."""
    if not fp8 or g.name in ATTENTION_CORE:
        return device, peak_flops
    best = device.gemm_efficiency if device.fp8_gemm_efficiency is None else device.fp8_gemm_efficiency
    return replace(device, gemm_efficiency=best), device.peak_flops_fp8


def fp8_cast_times(device: Device, gemms: list) -> tuple:
    """(forward, backward) seconds of the FP8 casts around `gemms`' weight GEMMs: forward each
    one's input [m, k], backward its output gradient [m, n]; one streaming kernel each."""
    weight_gemms = [g for g in gemms if g.name not in ATTENTION_CORE]
    cast = lambda elements: _streaming_time(device, FP8_CAST_BYTES * elements, device.memory_efficiency)  # noqa: E731
    return (sum(cast(g.count * g.m * g.k) for g in weight_gemms), sum(cast(g.count * g.m * g.n) for g in weight_gemms))


def work(device: Device, peak_flops: float, gemms: list, memory_ops: list, flash=0, fp8=0) -> Work:
    """Forward time and FLOPs of a list of ops; the attention core is also summed on its own.
    `flash` (0 or 1, or an array of them): the attention core runs as one fused kernel in place
    of its two GEMMs, softmax and dropout (their FLOPs still count: the convention counts the
    products, not how they are run). `fp8` (0 or 1): the weight GEMMs run in FP8, with their
    casts (gemm_rate, fp8_cast_times)."""
    total = Work()
    unfused = 1 - flash
    for g in gemms:
        flops = 2.0 * g.count * g.m * g.n * g.k
        time, share, first, second, backward_share = gemm_pass_times(device, peak_flops, g, fp8)
        total.flops = total.flops + flops
        if g.name in ATTENTION_CORE:  # no weights: both backward GEMMs are data gradients
            time, first, second = unfused * time, unfused * first, unfused * second
            total.core_flops, total.core_time_s = total.core_flops + flops, total.core_time_s + time
            total.core_backward_s = total.core_backward_s + first + second
        else:
            total.weight_grad_s = total.weight_grad_s + second
        total.time_s = total.time_s + time
        total.backward_s = total.backward_s + first + second
        total.curve_s = total.curve_s + share * time + backward_share * (first + second)
        if g.name == ATTENTION_CORE[0] and np.any(flash):  # no table lookups for batches without a flash plan
            forward, backward, forward_share, backward_share = flash_attention_times(device, peak_flops, g)
            total.time_s = total.time_s + flash * forward
            total.core_time_s = total.core_time_s + flash * forward
            total.backward_s = total.backward_s + flash * backward
            total.core_backward_s = total.core_backward_s + flash * backward
            total.curve_s = total.curve_s + flash * (forward_share * forward + backward_share * backward)
    if fp8:
        forward, backward = fp8_cast_times(device, gemms)
        total.time_s, total.backward_s = total.time_s + forward, total.backward_s + backward
        total.curve_s = total.curve_s + forward + backward  # streaming passes, no measured table of casts
    for op in memory_ops:
        time, backward, forward_share, backward_share = memory_times_and_shares(device, op)
        if op.name in CORE_MEMORY_OPS:  # inside the fused kernel, in on-chip memory
            time, backward = unfused * time, unfused * backward
            total.core_time_s = total.core_time_s + time
            total.core_backward_s = total.core_backward_s + backward
        total.time_s = total.time_s + time
        total.backward_s = total.backward_s + backward
        total.curve_s = total.curve_s + forward_share * time + backward_share * backward
    return total


def embedding_work(model: ModelSpec, device: Device, b, region_split, element=BF16) -> Work:
    """First stage: word-embedding gather (read rows, write [b, s, h]), position add, dropout,
    on the device's share of the output, in `element`-byte tensors."""
    full = b * model.seq * model.hidden / region_split
    nbytes = 2 * element * full
    if model.learned_positions:
        nbytes = nbytes + 3 * element * full
    if model.dropout:
        nbytes = nbytes + (2 * element + 1) * full
    time, backward = memory_times(device, MemoryOp("embedding", nbytes))
    return Work(time_s=time, backward_s=backward, curve_s=time + backward)


def head_memory_ops(model: ModelSpec, b, split, region_split, vocab, element=BF16, autocast=0) -> list[MemoryOp]:
    """Last stage around the logits GEMM: final norm (in fp32 between casts under autocast), and the
    cross-entropy in fp32 (read the `element`-byte logits, write an fp32 copy, two fp32
    reductions, keep the fp32 softmax for backward)."""
    tokens = b * model.seq
    return [*_fp32_under_autocast("final_norm", "layernorm", tokens * model.hidden / region_split, element, autocast),
            _op("cross_entropy", kind_bytes("cross_entropy", element) * tokens * vocab / split)]
