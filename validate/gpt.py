"""A small GPT whose transformer layers run real 1D tensor parallelism (Megatron), with or without
sequence parallelism, through torch.distributed.tensor.parallel on a 1-D DeviceMesh.

The model is written once, for one process; `parallelize` shards it in place:

| module | 1d | 1d + SP |
|---|---|---|
| word embedding (vocabulary-parallel) | RowwiseParallel: all-reduce | RowwiseParallel, output Shard(1): reduce-scatter |
| LayerNorms | replicated | SequenceParallel (sequence-split) |
| QKV, FC1 | ColwiseParallel (f: all-reduce of dX backward) | ColwiseParallel, input Shard(1): all-gather |
| attention output, FC2 | RowwiseParallel (g: all-reduce forward) | RowwiseParallel, output Shard(1): reduce-scatter |
| LM head (vocabulary-parallel) | ColwiseParallel, output Shard(-1) | same, input Shard(1): all-gather |
| loss | validate.loss (Megatron's vocabulary-parallel cross-entropy): max, sum of exponentials and target logit all-reduced | same |

QKV is one fused linear whose output columns are laid out head by head ([heads, 3, head_dim]),
so a column shard holds whole heads (q, k and v of heads/P heads). The attention core
(`attention`, perfsim's plan field) is "unfused", written with explicit batched products (baddbmm
for QK^T, bmm for AV) so that FLOP counting sees exactly those two products, or "flash", torch's
fused scaled_dot_product_attention (no s x s tensor kept; validate.instrument counts its FLOPs
as perfsim does).
The head is untied from the embedding (`tied_embeddings=False` in the perfsim spec). No dropout.

A Llama-shaped spec (RMSNorm, rotary positions, kv_heads < heads, a SwiGLU or squared-ReLU MLP of
ffn columns, no biases; GPTConfig's architecture fields) builds the same model with
validate.llama's layers in those places, under the same module and parameter names, so every
parallelization here and in validate/ shards it alike; a GPT spec builds exactly the layers above.

A spec with experts (perfsim's experts, topk, expert_ffn, shared_expert_ffn, dense_layers) runs
validate.moe.MoE in place of the MLP of every layer after the first dense_layers, under the
MLP's name (`mlp`); validate.expert_parallel spreads its experts over ranks. A dense spec builds
exactly the layers above.

Recompute (torch.utils.checkpoint, non-reentrant): "selective" checkpoints the attention core
(scores, softmax, context), "full" the whole transformer layer. Early stopping is off: torch
would otherwise stop the recomputation once every saved tensor is rebuilt, skipping the last
product (AV for selective; FC2 and its all-reduce or reduce-scatter for full), whereas Megatron's
checkpointing, and perfsim, re-run the whole checkpointed forward.

The positions of the learned position embedding are replicated; with SP each rank adds its own
sequence slice, so the position-embedding gradient is partial per rank and `finish_gradients`
all-reduces it with the LayerNorms' partial gradients, in one call (as Megatron's finalize step
does for sequence-parallel parameters).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from validate import llama
from validate.loss import cross_entropy

RECOMPUTE = ("none", "selective", "full")

_checkpoint_observers = []


@contextlib.contextmanager
def observe_checkpoint_inputs(callback):
    """Call `callback(tensor)` for every tensor input a checkpointed region keeps for its
    recomputation. torch's non-reentrant checkpoint holds those inputs in a closure, not as saved
    tensors, so torch.autograd.graph.saved_tensors_hooks never sees them (validate/tp_check.py
    counts them with this)."""
    _checkpoint_observers.append(callback)
    try:
        yield
    finally:
        _checkpoint_observers.remove(callback)


def _checkpointed(fn, *args):
    """Run `fn(*args)` under non-reentrant checkpointing with early stop off (see module doc)."""
    for observe in _checkpoint_observers:
        for a in args:
            if isinstance(a, torch.Tensor):
                observe(a)
    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False)


def autocast_for(device_type: str, dtype):
    """The numerics of a bf16 step: on GPUs (cuda, xpu) bf16 parameters run under
    torch.autocast(bf16), which keeps softmax, LayerNorm and the loss in fp32 as Megatron does
    (Llama-shaped layers: validate.llama's module doc says which of their ops run in fp32);
    elsewhere (CPU) and in fp32 the ops run in the parameters' dtype."""
    if dtype == torch.bfloat16 and device_type in ("cuda", "xpu"):
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()



@dataclass(frozen=True)
class GPTConfig:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int  # already padded (perfsim's ModelSpec.padded_vocab(tp))
    recompute: str = "none"
    attention: str = "unfused"  # perfsim's plan.attention: "unfused" (Megatron's kernels) or "flash" (SDPA)
    # The architecture, as perfsim's ModelSpec names it; the defaults are the GPT's. Anything else
    # takes validate.llama's layers for that part.
    ffn: int = 0  # 0: 4 x hidden
    kv_heads: int = 0  # 0: heads (multi-head attention); fewer: grouped-query attention
    activation: str = "gelu"  # or "swiglu", "squared-relu"
    norm: str = "layernorm"  # or "rmsnorm"
    bias: bool = True
    rotary: bool = False  # rotary position embeddings instead of learned positions
    # A mixture of experts (perfsim's ModelSpec keys; 0 experts: a dense model): every layer after
    # the first dense_layers runs validate.moe.MoE in place of the MLP (`routing`: its module doc)
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    dense_layers: int = 0
    routing: str = "balanced"

    @classmethod
    def from_spec(cls, model, tp: int = 1, recompute: str = "none", attention: str = "unfused") -> "GPTConfig":
        """From a perfsim ModelSpec: the vocabulary padded as Megatron pads it for `tp` ranks."""
        if not model.learned_positions and model.head_dim % 2:
            raise ValueError(f"rotary embeddings rotate pairs of the head dimension; head_dim {model.head_dim} is odd")
        if getattr(model, "capacity_factor", 0):
            raise ValueError("the harness's experts are dropless; leave capacity_factor out")
        moe = {k: getattr(model, k, 0) for k in ("experts", "topk", "expert_ffn", "shared_expert_ffn", "dense_layers")}
        return cls(model.layers, model.hidden, model.heads, model.seq, model.padded_vocab(tp), recompute, attention,
                   model.ffn_size, model.kv_head_count, model.activation, model.norm, model.bias,
                   not model.learned_positions, **moe)

    def __post_init__(self):  # 0 is the GPT's: 4 x hidden, as many key/value heads as heads
        object.__setattr__(self, "ffn", self.ffn or 4 * self.hidden)
        object.__setattr__(self, "kv_heads", self.kv_heads or self.heads)

    @property
    def gpt_attention(self) -> bool:
        """Multi-head attention with learned positions: Attention (else GroupedAttention)."""
        return self.kv_heads == self.heads and not self.rotary


_causal_bias = {}


def causal_bias(s: int, dtype, device):
    """[s, s] additive causal mask (0 on and below the diagonal, -inf above), built once per
    shape, dtype and device, as a constant of the step."""
    key = (s, dtype, str(device))
    if key not in _causal_bias:
        _causal_bias[key] = torch.full((s, s), float("-inf"), dtype=dtype, device=device).triu(1)
    return _causal_bias[key]


def attention_core(q, k, v):
    """Causal softmax(Q K^T / sqrt(d)) V on [b, heads, s, d] tensors, with Megatron's kernels: the
    scale and the causal mask ride on the QK^T GEMM (baddbmm: alpha = 1/sqrt(d), the mask as its
    added input, where Megatron scales in baddbmm and masks inside its fused softmax), so the
    scores see one softmax pass, as perfsim prices them; a separate division and masked_fill
    cost two more passes over [b, heads, s, s] forward and two backward."""
    b, heads, s, d = q.shape
    rows = b * heads
    scores = torch.baddbmm(causal_bias(s, q.dtype, q.device), q.reshape(rows, s, d),
                           k.reshape(rows, s, d).transpose(1, 2), alpha=1 / math.sqrt(d))
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, v.reshape(rows, s, d)).view(b, heads, s, d)


def fused_attention_core(q, k, v):
    """The same causal attention as one fused kernel, torch's scaled_dot_product_attention (perfsim's
    attention = "flash"): on CPU torch's flash kernel, on GPUs flash, cuDNN or memory-efficient
    attention. It keeps Q, K, V, its output and one fp32 log-sum-exp per query row and head for
    backward, no s x s tensor; its output is laid out [b, s, heads, d] in memory, so the
    projection's input is a view of it."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


ATTENTION_CORES = {"unfused": attention_core, "flash": fused_attention_core}


def grouped_attention_core(q, k, v):
    """attention_core (Megatron's kernels) with K and V expanded to the query heads of their group,
    as Megatron's unfused core does for grouped-query attention (validate.llama)."""
    return attention_core(q, *llama.expand_kv(k, v, q.shape[1]))


GROUPED_CORES = {"unfused": grouped_attention_core, "flash": llama.grouped_fused_attention_core}


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.selective = cfg.recompute == "selective"
        self.core = ATTENTION_CORES[cfg.attention]
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x):
        qkv = self.qkv(x)  # [b, s, 3 h / P], whole heads: works sharded or not
        b, s, width = qkv.shape
        heads = width // (3 * self.head_dim)
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        if self.selective:
            context = _checkpointed(self.core, q, k, v)
        else:
            context = self.core(q, k, v)
        return self.proj(context.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class GroupedAttention(nn.Module):
    """Attention of a spec with kv_heads < heads or rotary positions (validate.llama's QKV layout,
    rotary and grouped cores), under the module names of Attention."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h, kv = cfg.hidden, cfg.kv_heads * (cfg.hidden // cfg.heads)
        self.head_dim = cfg.hidden // cfg.heads
        self.group = cfg.heads // cfg.kv_heads  # query heads per key/value head
        self.selective = cfg.recompute == "selective"
        self.core = GROUPED_CORES[cfg.attention]
        self.rotary = llama.Rotary(self.head_dim) if cfg.rotary else None
        self.qkv = nn.Linear(h, h + 2 * kv, bias=cfg.bias)
        self.proj = nn.Linear(h, h, bias=cfg.bias)

    def forward(self, x):
        q, k, v = llama.grouped_qkv(self.qkv(x), self.group, self.head_dim, self.rotary)
        context = _checkpointed(self.core, q, k, v) if self.selective else self.core(q, k, v)
        b, heads, s, d = q.shape
        return self.proj(context.transpose(1, 2).reshape(b, s, heads * d))


def norm_layer(cfg: GPTConfig) -> nn.Module:
    """LayerNorm (GPT), or validate.llama's RMSNorm."""
    return nn.LayerNorm(cfg.hidden) if cfg.norm == "layernorm" else llama.RMSNorm(cfg.hidden)


def mlp_activation(name: str):
    """GeLU (GPT), or validate.llama's SwiGLU or squared ReLU."""
    return F.gelu if name == "gelu" else llama.ACTIVATIONS[name]


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        f = cfg.ffn
        self.activation = mlp_activation(cfg.activation)
        self.fc1 = nn.Linear(cfg.hidden, 2 * f if cfg.activation == "swiglu" else f, bias=cfg.bias)
        self.fc2 = nn.Linear(f, cfg.hidden, bias=cfg.bias)

    def forward(self, x):
        return self.fc2(self.activation(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, index: int = 0):
        super().__init__()
        self.full = cfg.recompute == "full"
        self.ln1 = norm_layer(cfg)
        self.attn = Attention(cfg) if cfg.gpt_attention else GroupedAttention(cfg)
        self.ln2 = norm_layer(cfg)
        if cfg.experts and index >= cfg.dense_layers:  # a mixture-of-experts layer, under the MLP's name
            from validate.moe import MoE

            self.mlp = MoE(cfg, lambda ffn: MLP(replace(cfg, ffn=ffn)))
        else:
            self.mlp = MLP(cfg)

    def _forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward(self, x):
        if self.full:
            return _checkpointed(self._forward, x)
        return self._forward(x)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        if cfg.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {cfg.recompute!r}")
        if cfg.attention not in ATTENTION_CORES:
            raise ValueError(f"attention must be one of {tuple(ATTENTION_CORES)}, got {cfg.attention!r}")
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        if cfg.rotary:  # positions enter each layer's attention (validate.llama.Rotary)
            self.register_parameter("pos", None)
        else:
            self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.ln_f = norm_layer(cfg)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.mesh = None
        self.sp = False
        self.positions = None  # under context parallelism: this rank's token positions (validate.context_parallel)

    def set_positions(self, positions) -> None:
        """Take the tokens at `positions` of each sequence (a context-parallel rank's own): the
        learned embedding's rows, or the rotary angles of every layer."""
        self.positions = positions
        for block in self.blocks:
            rotary = getattr(block.attn, "rotary", None)
            if rotary is not None:
                rotary.at(positions)

    def forward(self, tokens):
        x = self.embed(tokens)  # [b, s, h], or [b, s/P, h] with SP, or [b, s/cp, h] with CP
        s = x.shape[1]
        if self.pos is None:
            pass  # rotary: the attention adds the positions
        elif self.positions is not None:
            x = x + self.pos[self.positions.to(x.device)]
        else:
            start = self.mesh.get_local_rank() * s if self.sp else 0
            x = x + self.pos[start:start + s]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens, targets):
        """Mean next-token cross-entropy; vocabulary-parallel when the model is parallelized.
        In bf16 on a GPU the forward runs under autocast (`autocast_for`). The loss is taken on
        fp32 logits, as Megatron takes it (and validate.pipeline's token_loss): its statistics
        and the softmax it keeps are fp32 in every dtype, as perfsim counts them."""
        with autocast_for(tokens.device.type, self.embed.weight.dtype):
            logits = self(tokens)  # parallel: this rank's vocabulary columns, a plain tensor
            if self.mesh is None:
                return cross_entropy(logits.flatten(0, 1), targets.flatten())
            start = self.mesh.get_local_rank() * logits.shape[-1]
            return cross_entropy(logits.flatten(0, 1), targets.flatten(), start, group_reduce(self.mesh.get_group()))

    def backward(self, loss):
        loss.backward()

    def finish_gradients(self):
        """Sum the partial gradients of parameters used sequence-split in one all-reduce of them
        all, as Megatron's finalize step does for its sequence-parallel parameters: the position
        embedding, and the LayerNorms under SequenceParallel, whose DTensor gradients backward
        leaves Partial (unreduced), and the routers of MoE layers (validate.moe), plain weights
        each rank uses on its own sequence shard."""
        if not self.sp:
            return
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Replicate

        pending = [(self.pos, self.pos.grad)] if self.pos is not None and self.pos.grad is not None else []
        # the routers of MoE layers (plain, replicated weights), each rank routing its sequence shard
        pending += [(b.mlp.router.weight, b.mlp.router.weight.grad) for b in self.blocks
                    if hasattr(b.mlp, "router") and b.mlp.router.weight.grad is not None]
        for p in self.parameters():
            g = p.grad
            if g is not None and hasattr(g, "placements") and any(pl.is_partial() for pl in g.placements):
                pending.append((p, g.to_local()))
        if not pending:
            return
        flat = torch.cat([g.reshape(-1) for _, g in pending])
        dist.all_reduce(flat, group=self.mesh.get_group())
        offset = 0
        for p, g in pending:
            summed = flat[offset:offset + g.numel()].view_as(g)
            offset += g.numel()
            if hasattr(p.grad, "placements"):
                p.grad = DTensor.from_local(summed, self.mesh, [Replicate()], run_check=False)
            else:
                p.grad.copy_(summed)


def group_reduce(group):
    """validate.loss's `reduce` over a process group: all-reduce in place, MAX or SUM."""
    import torch.distributed as dist

    def reduce(tensor, op):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
        return tensor
    return reduce


def parallelize(model: GPT, mesh, sp: bool) -> GPT:
    """Shard `model` in place over the 1-D `mesh` (1d tensor parallelism, optionally with SP)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    tp = mesh.size()
    cfg = model.cfg
    if cfg.experts and not sp:
        raise ValueError("a mixture of experts under tensor parallelism needs sequence parallelism (sp), as "
                         "Megatron-Core requires")
    if cfg.heads % tp or cfg.kv_heads % tp or cfg.ffn % tp or cfg.vocab % tp or (sp and cfg.seq % tp):
        raise ValueError(f"heads ({cfg.heads}), kv_heads ({cfg.kv_heads}), ffn ({cfg.ffn}), vocab "
                         f"({cfg.vocab}){' and seq' if sp else ''} must divide by tp={tp}")
    region = Shard(1) if sp else Replicate()
    for block in model.blocks:
        parallelize_module(block, mesh, layer_plan(sp, block.mlp))
    top = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=region),
           "head": ColwiseParallel(input_layouts=region, output_layouts=Shard(-1))}
    if sp:
        top["ln_f"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    model.mesh, model.sp = mesh, sp
    return model


def layer_plan(sp: bool, mlp=None) -> dict:
    """torch.distributed.tensor.parallel's plan for one transformer layer (Block): QKV and FC1
    column-parallel, the projection and FC2 row-parallel; with SP the LayerNorms sequence-split
    and the region between them entered by an all-gather and left by a reduce-scatter. A MoE
    layer's `mlp` (validate.moe.MoE, SP only) takes the rank's sequence shard as a plain tensor
    (its router and dispatch work on the shard's tokens) and hands its output back as the
    shard; its shared expert is column- and row-parallel as a dense MLP, gathering the sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel,
                                                   SequenceParallel)

    region = Shard(1) if sp else Replicate()
    plan = {"attn.qkv": ColwiseParallel(input_layouts=region), "attn.proj": RowwiseParallel(output_layouts=region),
            "mlp.fc1": ColwiseParallel(input_layouts=region), "mlp.fc2": RowwiseParallel(output_layouts=region)}
    if sp:
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel()})
    if hasattr(mlp, "router"):
        del plan["mlp.fc1"], plan["mlp.fc2"]
        plan["mlp"] = PrepareModuleInputOutput(input_layouts=(region,), desired_input_layouts=(region,),
                                               use_local_input=True, output_layouts=(region,),
                                               desired_output_layouts=(region,), use_local_output=True)
        if mlp.shared is not None:
            plan.update({"mlp.shared.fc1": ColwiseParallel(input_layouts=region),
                         "mlp.shared.fc2": RowwiseParallel(output_layouts=region)})
    return plan


def local_parameter_elements(model: nn.Module) -> int:
    """Elements of the parameters this rank holds (its shard of each DTensor parameter)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel()
    return total
