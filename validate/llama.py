"""The Llama-shaped layers of validate.gpt's model: RMSNorm, rotary position embeddings, grouped-query
attention and the SwiGLU and squared-ReLU MLP activations (perfsim's ModelSpec with norm = rmsnorm,
learned_positions = false, kv_heads < heads, activation = swiglu | squared-relu). validate.gpt builds
them only for a spec that asks for them (validate.gpt.GroupedAttention puts the attention pieces
together); a GPT spec runs its own layers, unchanged. Nothing here imports validate.gpt.

Each keeps for backward what Megatron-Core keeps (docs/equations.md 7.2 derives perfsim's count):

| layer | kept | Megatron-Core |
|---|---|---|
| RMSNorm | its input and the fp32 1/rms per token | Transformer Engine's RMSNorm (x, rstdevs) |
| rotary | nothing activation-sized: the cos/sin tables are constants of the step | the fused RoPE keeps its [s, d] frequencies |
| SwiGLU | its input, the FC1 output (gate and up), recomputing SiLU in backward | SwiGLUFunction (the default bias_swiglu_fusion) |
| squared ReLU | the ReLU output (the FC2 input is the square) | torch.pow(F.relu(x), 2) |
| unfused GQA core | Q and K, V expanded to every query head (repeat_interleave), the softmax | DotProductAttention |
| flash GQA core | Q, K, V (kv heads), output, log-sum-exp | TE's flash attention (contiguous Q, K, V) |

Layouts that keep a tensor-parallel rank's pieces together whatever tp (or 2d/3d grid) splits the
columns: QKV's output columns are grouped as Megatron's, [kv_heads, heads/kv_heads + 2, head_dim]
(a group's query heads, then its key head, then its value head), so a split into whole groups
keeps each query head with its key and value (kv_heads divisible by tp); FC1's output columns of
a SwiGLU interleave gate and up unit by unit (gate j, up j), so any even split keeps each gate
with its up column (Megatron lays a rank's shard out as [gate; up], the same pairing).

On GPUs with bf16 parameters the step runs under validate.gpt.autocast_for's torch.autocast(bf16),
as a GPT step does. Autocast runs in fp32: the RMSNorm (autocast's policy for rms_norm, which
RMSNorm here follows: input and weight cast to fp32, fp32 output), the softmax of the unfused
core and the loss, as for a GPT. Rotary, SwiGLU and squared ReLU run in bf16 (their ops have no
autocast policy; squared ReLU is written r * r of r = relu(x), not pow, which autocast would run
in fp32), and the GEMMs and SDPA in bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROTARY_BASE = 10000.0  # Llama 2's theta (Megatron's rotary_base default)
NORM_EPS = 1e-5


class _RMSNormFunction(torch.autograd.Function):
    """y = x / rms(x) * weight, keeping x and the fp32 1/rms per token (not the normalised x)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)  # F.rms_norm's own numerics
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd, weight = ctx.saved_tensors
        dx, dweight = rms_norm_backward(dy, x, rstd, weight)
        return dx, dweight, None


FUSED_BACKWARD_WORKS = {}  # device type -> whether torch has a fused RMSNorm backward kernel for it
FUSED_RMS_NORM_BACKWARD = torch.ops.aten._fused_rms_norm_backward


def rms_norm_backward(dy, x, rstd, weight):
    """(input gradient, weight gradient) of y = x / rms(x) * weight from x and 1/rms; the weight's,
    summed over every token, is a Partial sum under sequence parallelism. torch's fused kernel
    where the device has one (CUDA, XPU: one kernel, as Transformer Engine's), else the explicit
    math below (the CPU build has no kernel for it), in fp32 and cast back."""
    kind = x.device.type
    if FUSED_BACKWARD_WORKS.get(kind, True):
        try:
            return FUSED_RMS_NORM_BACKWARD(dy, x, [x.shape[-1]], rstd, weight, [True, True])
        except NotImplementedError:
            FUSED_BACKWARD_WORKS[kind] = False
    xhat = x.float() * rstd
    g = dy.float() * weight.float()
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dweight = (dy.float() * xhat).sum(tuple(range(x.dim() - 1)))
    return dx.to(x.dtype), dweight.to(weight.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, one gain vector (`weight`) and no bias. torch's F.rms_norm
    on a CPU is a composite of element-wise ops whose autograd keeps the normalised input beside
    the input, a tensor more than Megatron's kernels keep; this keeps the input and 1/rms alone."""

    def __init__(self, hidden: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        if torch.is_autocast_enabled(x.device.type):  # autocast's fp32 policy for rms_norm
            with torch.autocast(x.device.type, enabled=False):
                return _RMSNormFunction.apply(x.float(), self.weight.float(), self.eps)
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_half_transposed(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((second, -first), dim=-1)


class _Rotate(torch.autograd.Function):
    """x cos + rotate_half(x) sin; the tables are constants, so nothing is saved for backward."""

    @staticmethod
    def forward(ctx, x, tables):
        cos, sin = tables
        ctx.tables = tables
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.tables
        return grad * cos + _rotate_half_transposed(grad * sin), None


class Rotary:
    """Rotary position embedding of [b, s, heads, head_dim] tensors (Megatron's default: the two
    halves of head_dim rotated together, theta ROTARY_BASE). `positions` are the tokens' places in
    the sequence: None for 0 ... s-1, a context-parallel rank's own otherwise
    (validate.context_parallel). The cos/sin tables are built once per positions, dtype and device."""

    def __init__(self, head_dim: int, base: float = ROTARY_BASE):
        self.head_dim, self.base = head_dim, base
        self.positions = None
        self._tables = {}

    def at(self, positions) -> None:
        self.positions = positions
        self._tables = {}

    def tables(self, seq: int, dtype, device):
        key = (seq, dtype, str(device))
        if key not in self._tables:
            positions = torch.arange(seq) if self.positions is None else self.positions
            inverse = 1.0 / self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
            angles = positions.to(torch.float32)[:, None] * inverse[None, :]
            angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # [s, 1, head_dim]: over the heads
            self._tables[key] = (angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype))
        return self._tables[key]

    def __call__(self, x):
        return _Rotate.apply(x, self.tables(x.shape[1], x.dtype, x.device))


def grouped_qkv(qkv, group: int, head_dim: int, rotary=None):
    """Q [b, heads, s, d] and K, V [b, kv_heads, s, d] from a QKV output [b, s, width] in
    Megatron's grouped layout (module doc), rotary applied to Q and K. Each is given a storage of
    its own, as Transformer Engine's attention takes them: a view would keep the whole QKV output
    alive for backward."""
    b, s, width = qkv.shape
    groups = width // ((group + 2) * head_dim)
    qkv = qkv.view(b, s, groups, group + 2, head_dim)
    q = qkv[..., :group, :].reshape(b, s, groups * group, head_dim)
    k, v = qkv[..., group, :], qkv[..., group + 1, :]
    if rotary is not None:
        q, k = rotary(q), rotary(k)
    return tuple(t.contiguous().transpose(1, 2) for t in (q, k, v))


def expand_kv(k, v, heads: int):
    """K and V repeated to every query head of their group, as Megatron's unfused core does."""
    group = heads // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def grouped_fused_attention_core(q, k, v):
    """scaled_dot_product_attention over kv_heads < heads without expanding K and V (enable_gqa):
    the CPU flash kernel and the GPU flash kernels read each key/value head for its whole group."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up of FC1's interleaved output [..., 2 f] (module doc), keeping that input
    alone and recomputing the SiLU in backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        pairs = x.unflatten(-1, (-1, 2))
        return F.silu(pairs[..., 0]) * pairs[..., 1]

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        pairs = x.unflatten(-1, (-1, 2))
        gate, up = pairs[..., 0], pairs[..., 1]
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_gate = grad * up * (sig + silu * (1 - sig))  # d silu / d gate = sig (1 + gate (1 - sig))
        return torch.stack((d_gate, grad * silu), dim=-1).flatten(-2)


def swiglu(x):
    return _SwiGLU.apply(x)


def squared_relu(x):
    r = F.relu(x)
    return r * r


ACTIVATIONS = {"swiglu": swiglu, "squared-relu": squared_relu}

