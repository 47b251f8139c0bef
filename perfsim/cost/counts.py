"""Parameter and FLOP counts of the whole model (docs/equations.md, sections 1 and 2).

Only matrix multiplications count as FLOPs (the convention of SC21 and of MFU); element-wise work
is timed from its bytes instead. Attention scores count the full s x s square, without causal
halving, as SC21 and Megatron-DeepSpeed do.
"""

from __future__ import annotations

from perfsim.spec.model import ModelSpec


def norm_params(model: ModelSpec) -> int:
    return 2 * model.hidden if model.norm == "layernorm" else model.hidden


def layer_params(model: ModelSpec) -> dict:
    """Parameters of one transformer layer by piece (weights and biases, unsharded)."""
    h, f, kv = model.hidden, model.ffn_size, model.kv_hidden
    bias = 1 if model.bias else 0
    fc1_out = 2 * f if model.gated_mlp else f
    return {
        "qkv": h * (h + 2 * kv) + bias * (h + 2 * kv),
        "proj": h * h + bias * h,
        "fc1": h * fc1_out + bias * fc1_out,
        "fc2": f * h + bias * h,
        "norms": 2 * norm_params(model),
    }


def linear_weight_params(model: ModelSpec) -> int:
    """Elements of one layer's four weight matrices (QKV, projection, FC1, FC2; no biases): what
    FP8 training casts and keeps FP8 copies of (perfsim.cost.fp8)."""
    h, f, kv = model.hidden, model.ffn_size, model.kv_hidden
    return h * (h + 2 * kv) + h * h + h * (2 * f if model.gated_mlp else f) + f * h


def embedding_params(model: ModelSpec, vocab: int) -> dict:
    return {
        "word": vocab * model.hidden,
        "position": model.seq * model.hidden if model.learned_positions else 0,
        "final_norm": norm_params(model),
        "output": 0 if model.tied_embeddings else vocab * model.hidden,
    }


def total_params(model: ModelSpec, tp: int = 1) -> int:
    """All parameters, counted once (a tied output layer shares the word embedding)."""
    vocab = model.padded_vocab(tp)
    return model.layers * sum(layer_params(model).values()) + sum(embedding_params(model, vocab).values())


def layer_forward_flops(model: ModelSpec, tokens) -> dict:
    """Forward matmul FLOPs of one layer on `tokens` = micro-batch x seq tokens, by piece."""
    h, s, kv = model.hidden, model.seq, model.kv_hidden
    fc1_out = 2 * model.ffn_size if model.gated_mlp else model.ffn_size
    return {
        "qkv": 2 * tokens * h * (h + 2 * kv),
        "scores": 2 * tokens * s * h,
        "context": 2 * tokens * s * h,
        "proj": 2 * tokens * h * h,
        "fc1": 2 * tokens * h * fc1_out,
        "fc2": 2 * tokens * model.ffn_size * h,
    }


ATTENTION_CORE = ("scores", "context")


def logits_forward_flops(model: ModelSpec, tokens, vocab) -> float:
    return 2 * tokens * model.hidden * vocab


def model_flops_per_sample(model: ModelSpec, tp: int = 1) -> float:
    """Forward + backward (x3) matmul FLOPs of one sequence: no recomputation."""
    s = model.seq
    layer = sum(layer_forward_flops(model, s).values())
    return 3 * (model.layers * layer + logits_forward_flops(model, s, model.padded_vocab(tp)))


def recompute_flops_per_sample(model: ModelSpec, recompute: str) -> float:
    """Matmul FLOPs spent again in the backward pass: a whole forward of every layer (full)
    or the attention core only (selective); logits are never recomputed."""
    per_layer = layer_forward_flops(model, model.seq)
    if recompute == "full":
        return model.layers * sum(per_layer.values())
    if recompute == "selective":
        return model.layers * sum(per_layer[k] for k in ATTENTION_CORE)
    return 0.0


def flash_recompute_flops_per_sample(model: ModelSpec) -> float:
    """Matmul FLOPs a fused (flash) attention backward spends again: it recomputes the scores
    (one s x s x d product per head) instead of reading them back, in every layer."""
    return model.layers * layer_forward_flops(model, model.seq)["scores"]


def megatron_ds_flops_per_sample(model: ModelSpec, tp: int, full_recompute: bool) -> float:
    """The count behind Megatron-DeepSpeed's `TFLOPs:` log line (shared/reference/published.md):
    forward MACs L(4 h^2 s + 2 s^2 h + 2 ffn h s) + V h s, x3 (x4 with activation checkpointing), x2."""
    h, s, f = model.hidden, model.seq, model.ffn_size
    macs = model.layers * (4 * h * h * s + 2 * s * s * h + 2 * f * h * s) + model.padded_vocab(tp) * h * s
    return 2 * macs * (4 if full_recompute else 3)


def sc21_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """SC21 eq. 2: P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))."""
    l, h = layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))


def sc21_flops_per_iteration(batch: int, layers: int, hidden: int, vocab: int, seq: int) -> float:
    """SC21 eq. 3 (full recomputation): F = 96 B s l h^2 (1 + s/(6 h) + V/(16 l h))."""
    l, h, s = layers, hidden, seq
    return 96 * batch * s * l * h * h * (1 + s / (6 * h) + vocab / (16 * l * h))
