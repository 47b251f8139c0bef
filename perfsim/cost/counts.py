"""Parameter and FLOP counts of the whole model (docs/equations.md, sections 1 and 2).

Only matrix multiplications count as FLOPs (the convention of SC21 and of MFU); element-wise work
is timed from its bytes instead. Attention scores count the full s x s square, without causal
halving, as SC21 and Megatron-DeepSpeed do (s x window on a sliding-window layer).

A model's layers come in up to four kinds (`layer_kinds`): dense or mixture-of-experts FFN, full
or sliding-window attention. Dense models without windows have one kind, and every count below
is then the single-layer count times `layers`, as before.
"""

from __future__ import annotations

import dataclasses

from perfsim.spec.model import ModelSpec


def norm_params(model: ModelSpec, width: int | None = None) -> int:
    """One norm over `width` features (default hidden): gamma and beta (LayerNorm) or gamma (RMSNorm)."""
    width = model.hidden if width is None else width
    return 2 * width if model.norm == "layernorm" else width


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def attention_params(model: ModelSpec) -> dict:
    """Parameters of one layer's attention block by piece (weights, biases, the norms inside it;
    not the layer's input norm). Grouped-query or multi-head: QKV (h -> a d + 2 h_kv) and the
    output projection (a d -> h). Latent (mla): the query down/up projections (or one direct query
    projection without q_lora_rank), the joint key/value down projection with the shared rotary key,
    the key/value up projection, the latents' two RMSNorms and the output projection (a v_head -> h)."""
    h = model.hidden
    if model.mla:
        a, q_head = model.heads, model.qk_nope_dim + model.qk_rope_dim
        if model.q_lora_rank:
            query = {"q_down": _linear(h, model.q_lora_rank, model.bias), "q_norm": norm_params(model, model.q_lora_rank),
                     "q_up": _linear(model.q_lora_rank, a * q_head, model.bias)}
        else:
            query = {"q": _linear(h, a * q_head, model.bias)}
        return {**query,
                "kv_down": _linear(h, model.kv_lora_rank + model.qk_rope_dim, model.bias),
                "kv_norm": norm_params(model, model.kv_lora_rank),
                "kv_up": _linear(model.kv_lora_rank, a * (model.qk_nope_dim + model.v_head_dim), model.bias),
                "proj": _linear(a * model.v_head_dim, h, model.bias)}
    q, kv = model.q_width, model.kv_hidden
    bias = 1 if model.bias else 0
    pieces = {"qkv": h * (q + 2 * kv) + bias * (q + 2 * kv), "proj": q * h + bias * h}
    if model.qk_norm:  # one norm of head_dim on the queries, one on the keys (shared by the heads)
        pieces["qk_norm"] = 2 * norm_params(model, model.head_dim)
    if model.attention_sinks:  # one learned logit per query head (GPT-OSS)
        pieces["sinks"] = model.heads
    return pieces


def _ffn_params(model: ModelSpec, width: int) -> dict:
    """FC1 (h -> width, or 2 width for SwiGLU) and FC2 (width -> h), biases if the model has them."""
    h = model.hidden
    bias = 1 if model.bias else 0
    fc1_out = 2 * width if model.gated_mlp else width
    return {"fc1": h * fc1_out + bias * fc1_out, "fc2": width * h + bias * h}


def dense_mlp_params(model: ModelSpec) -> dict:
    """A dense layer's MLP: FC1 and FC2 of width ffn."""
    return _ffn_params(model, model.ffn_size)


def expert_params(model: ModelSpec) -> int:
    """One routed expert: an FFN of expert_ffn columns (SwiGLU: 2 expert_ffn FC1 columns)."""
    return sum(_ffn_params(model, model.expert_ffn).values())


def shared_expert_params(model: ModelSpec) -> int:
    """The always-on shared experts, one FFN of shared_expert_ffn columns in all (0: none)."""
    return sum(_ffn_params(model, model.shared_expert_ffn).values()) if model.shared_expert_ffn else 0


def router_params(model: ModelSpec) -> int:
    """The router's linear h -> experts (with a bias where the model's linears have one: GPT-OSS)."""
    return _linear(model.hidden, model.experts, model.bias) if model.moe else 0


def layer_params(model: ModelSpec) -> dict:
    """Parameters of one dense transformer layer by piece (weights and biases, unsharded)."""
    return {**attention_params(model), **dense_mlp_params(model), "norms": 2 * norm_params(model)}


def moe_layer_params(model: ModelSpec) -> dict:
    """Parameters of one mixture-of-experts layer by piece: attention, its two norms, the router,
    all routed experts and the shared experts."""
    return {**attention_params(model), "norms": 2 * norm_params(model), "router": router_params(model),
            "experts": model.experts * expert_params(model), "shared": shared_expert_params(model)}


def linear_weight_params(model: ModelSpec) -> int:
    """Elements of one dense layer's weight matrices (QKV, projection, FC1, FC2, or the latent
    attention's projections; no biases or norms): what FP8 training casts and keeps FP8 copies of
    (perfsim.cost.fp8)."""
    h, f = model.hidden, model.ffn_size
    mlp = h * (2 * f if model.gated_mlp else f) + f * h
    if model.mla:
        weights = {key: value for key, value in attention_params(_unbiased(model)).items() if "norm" not in key}
        return sum(weights.values()) + mlp
    q, kv = model.q_width, model.kv_hidden
    return h * (q + 2 * kv) + q * h + mlp


def _unbiased(model: ModelSpec) -> ModelSpec:
    return dataclasses.replace(model, bias=False) if model.bias else model


def embedding_params(model: ModelSpec, vocab: int) -> dict:
    return {
        "word": vocab * model.hidden,
        "position": model.seq * model.hidden if model.learned_positions else 0,
        "final_norm": norm_params(model),
        "output": 0 if model.tied_embeddings else vocab * model.hidden,
    }


def windowed_layers(model: ModelSpec, first: int = 0, stop: int | None = None) -> int:
    """Sliding-window layers among layers first .. stop - 1 (0-based; default all). Layer i is
    windowed when i is a multiple of window_every (every layer when window_every is 0 or 1):
    GPT-OSS's layer_types start with a sliding layer and alternate."""
    stop = model.layers if stop is None else stop
    if not model.window or stop <= first:
        return 0
    every = max(model.window_every, 1)
    return -(-stop // every) - -(-first // every)


def layer_kinds(model: ModelSpec) -> list[tuple[int, bool, bool]]:
    """(layers, moe, windowed) of each kind of layer the model has, in that order: dense full,
    dense windowed, MoE full, MoE windowed; kinds with no layer left out."""
    dense = model.layers - model.moe_layers
    dense_windowed = windowed_layers(model, 0, dense)
    moe_windowed = windowed_layers(model, dense, model.layers)
    kinds = [(dense - dense_windowed, False, False), (dense_windowed, False, True),
             (model.moe_layers - moe_windowed, True, False), (moe_windowed, True, True)]
    return [kind for kind in kinds if kind[0]]


def attention_keys(model: ModelSpec, windowed: bool = False) -> int:
    """Keys each query's scores run over: s, or min(s, window) on a sliding-window layer."""
    return min(model.seq, model.window) if windowed and model.window else model.seq


def attention_key_mix(model: ModelSpec) -> list[tuple]:
    """(share of the layers, keys a query) of the model's attention: [(1, s)] without a window;
    full and sliding-window layers by their shares with one (a layer's cost priced as the mean)."""
    windowed = windowed_layers(model)
    if not windowed:
        return [(1, model.seq)]
    mix = [((model.layers - windowed) / model.layers, model.seq), (windowed / model.layers, attention_keys(model, True))]
    return [(share, keys) for share, keys in mix if share]


def mean_attention_keys(model: ModelSpec):
    """Keys a query attends to, averaged over the layers: s without a window."""
    mix = attention_key_mix(model)
    return model.seq if len(mix) == 1 and mix[0][0] == 1 else sum(share * keys for share, keys in mix)


def head_widths(model: ModelSpec) -> tuple:
    """(query/key width, value width) of one attention head: (d, d), or MLA's
    (qk_nope_dim + qk_rope_dim, v_head_dim)."""
    if model.mla:
        return model.qk_nope_dim + model.qk_rope_dim, model.v_head_dim
    return model.head_dim, model.head_dim


def total_params(model: ModelSpec, tp: int = 1) -> int:
    """All parameters, counted once (a tied output layer shares the word embedding)."""
    vocab = model.padded_vocab(tp)
    body = (model.layers - model.moe_layers) * sum(layer_params(model).values())
    if model.moe:
        body += model.moe_layers * sum(moe_layer_params(model).values())
    return body + sum(embedding_params(model, vocab).values())


def active_params(model: ModelSpec, tp: int = 1) -> int:
    """Parameters one token runs through: every parameter but the routed experts it is not sent to
    (topk of experts), the embeddings included, as Qwen, Mixtral and DeepSeek count "activated"
    parameters (GPT-OSS's model card leaves the input embedding out: docs/equations.md 1.4)."""
    idle = model.moe_layers * (model.experts - model.topk) * expert_params(model) if model.moe else 0
    return total_params(model, tp) - idle


def attention_forward_flops(model: ModelSpec, tokens, keys: int | None = None) -> dict:
    """Forward matmul FLOPs of one layer's attention on `tokens` = micro-batch x seq tokens, by
    piece; scores and context over `keys` keys a query (default s; attention_keys on a window)."""
    h = model.hidden
    s = model.seq if keys is None else keys
    if model.mla:
        a, q_head = model.heads, model.qk_nope_dim + model.qk_rope_dim
        if model.q_lora_rank:
            query = {"q_down": 2 * tokens * h * model.q_lora_rank, "q_up": 2 * tokens * model.q_lora_rank * a * q_head}
        else:
            query = {"q": 2 * tokens * h * a * q_head}
        return {**query,
                "kv_down": 2 * tokens * h * (model.kv_lora_rank + model.qk_rope_dim),
                "kv_up": 2 * tokens * model.kv_lora_rank * a * (model.qk_nope_dim + model.v_head_dim),
                "scores": 2 * tokens * s * a * q_head,
                "context": 2 * tokens * s * a * model.v_head_dim,
                "proj": 2 * tokens * a * model.v_head_dim * h}
    q, kv = model.q_width, model.kv_hidden
    return {
        "qkv": 2 * tokens * h * (q + 2 * kv),
        "scores": 2 * tokens * s * q,
        "context": 2 * tokens * s * q,
        "proj": 2 * tokens * q * h,
    }


def _ffn_flops(model: ModelSpec, tokens, width: int) -> tuple:
    fc1_out = 2 * width if model.gated_mlp else width
    return 2 * tokens * model.hidden * fc1_out, 2 * tokens * width * model.hidden


def layer_forward_flops(model: ModelSpec, tokens, keys: int | None = None) -> dict:
    """Forward matmul FLOPs of one dense layer on `tokens` = micro-batch x seq tokens, by piece."""
    fc1, fc2 = _ffn_flops(model, tokens, model.ffn_size)
    return {**attention_forward_flops(model, tokens, keys), "fc1": fc1, "fc2": fc2}


def routed_tokens(model: ModelSpec, tokens):
    """Token-expert pairs the routed experts compute: topk a token, dropless; a capacity factor
    below 1 drops the pairs beyond capacity_factor x the fair share (forced-balanced routing)."""
    share = min(model.capacity_factor, 1.0) if model.capacity_factor else 1.0
    return tokens * model.topk * share


def moe_layer_forward_flops(model: ModelSpec, tokens, keys: int | None = None) -> dict:
    """Forward matmul FLOPs of one mixture-of-experts layer on `tokens` tokens, by piece: the
    attention, the router (h -> experts), the shared experts on every token and the routed
    experts on topk copies of each token (routed_tokens)."""
    shared_fc1, shared_fc2 = _ffn_flops(model, tokens, model.shared_expert_ffn)
    expert_fc1, expert_fc2 = _ffn_flops(model, routed_tokens(model, tokens), model.expert_ffn)
    return {**attention_forward_flops(model, tokens, keys), "router": 2 * tokens * model.hidden * model.experts,
            "shared_fc1": shared_fc1, "shared_fc2": shared_fc2, "expert_fc1": expert_fc1, "expert_fc2": expert_fc2}


def kind_forward_flops(model: ModelSpec, tokens, moe: bool, windowed: bool) -> dict:
    """Forward FLOPs of one layer of a kind (layer_kinds) on `tokens` tokens."""
    count = moe_layer_forward_flops if moe else layer_forward_flops
    return count(model, tokens, attention_keys(model, windowed))


ATTENTION_CORE = ("scores", "context")


def logits_forward_flops(model: ModelSpec, tokens, vocab) -> float:
    return 2 * tokens * model.hidden * vocab


def _layers_flops(model: ModelSpec, pieces=None) -> float:
    """Forward FLOPs of every layer on one sequence, over `pieces` (default all) of each layer."""
    total = 0
    for layers, moe, windowed in layer_kinds(model):
        flops = kind_forward_flops(model, model.seq, moe, windowed)
        total = total + layers * sum(flops[k] for k in (pieces or flops))
    return total


def model_flops_per_sample(model: ModelSpec, tp: int = 1) -> float:
    """Forward + backward (x3) matmul FLOPs of one sequence: no recomputation."""
    s = model.seq
    return 3 * (_layers_flops(model) + logits_forward_flops(model, s, model.padded_vocab(tp)))


def recompute_flops_per_sample(model: ModelSpec, recompute: str) -> float:
    """Matmul FLOPs spent again in the backward pass: a whole forward of every layer (full)
    or the attention core only (selective); logits are never recomputed."""
    if recompute == "full":
        return _layers_flops(model)
    if recompute == "selective":
        return _layers_flops(model, ATTENTION_CORE)
    return 0.0


def flash_recompute_flops_per_sample(model: ModelSpec) -> float:
    """Matmul FLOPs a fused (flash) attention backward spends again: it recomputes the scores
    (one s x s x d product per head) instead of reading them back, in every layer."""
    return _layers_flops(model, ("scores",))


def megatron_ds_flops_per_sample(model: ModelSpec, tp: int, full_recompute: bool) -> float:
    """The count behind Megatron-DeepSpeed's `TFLOPs:` log line (docs/validation.md, "SMNG-P2"):
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
