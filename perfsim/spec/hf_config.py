"""A Hugging Face `config.json` as a perfsim model (docs/equations.md 1.5).

`--model path/config.json` reads the checkpoint's architecture fields and maps them to perfsim's
model keys for the families perfsim prices: Llama and Mistral, Qwen2 and Qwen3 (dense and MoE),
Mixtral, DeepSeek-V3 and GPT-OSS. A config holds no training sequence (max_position_embeddings is
what the positions allow, not what a run trains on): seq is DEFAULT_SEQ, the published MoE runs'
(shared/reference/published.md section 7), unless the argument adds overrides after the path,
`path/config.json,seq=8192` (any model key, as in an inline spec).

Fields that change the cost and have no perfsim key (an MoE layer every k-th layer, attention
dropout, a pattern of windows other than every k-th layer, ...) are a one-line error naming the
field; fields that do not change the cost (token ids, rotary scaling, initialisation, norms'
epsilon, routing details priced by the dispatch, the checkpoint's storage dtype) are ignored. A
field the mapping does not know is an error too, so a config never prices silently as less than
it is.
"""

from __future__ import annotations

import json
import os

from perfsim.errors import PerfsimError, one_line
from perfsim.files import read_text

DEFAULT_SEQ = 4096
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
GATED_ACTIVATIONS = ("silu", "swish")

# The fields perfsim reads: those hf_fields maps, and those that do not change what perfsim prices
# (metadata, token ids, initialisation, norm epsilon, rotary base and scaling: the rotation costs the
# same; the cache; routing's loss and scaling terms: routing is priced from experts and topk (and
# DeepSeek's n_group and topk_group as routing_nodes: _node_limit), its balance from the profile's
# moe.imbalance, its dispatch by the plan; the checkpoint's dtype and quantisation: a training run's dtype is --dtype; GPT-OSS's clamp
# of its SwiGLU; DeepSeek-V3's multi-token-prediction layers, which a plan's pp_layout places).
_KNOWN = {
    "architectures", "model_type", "_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype",
    "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "rms_norm_eps", "layer_norm_epsilon", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
    "max_position_embeddings", "initial_context_length", "pretraining_tp", "output_router_logits",
    "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "norm_topk_prob", "routed_scaling_factor",
    "scoring_func", "topk_method", "n_group", "topk_group", "ep_size", "router_jitter_noise",
    "quantization_config", "swiglu_limit", "max_window_layers", "num_nextn_predict_layers", "tie_word_embeddings",
    "head_dim", "num_key_value_heads", "intermediate_size", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "hidden_act", "attention_bias", "mlp_bias", "attention_dropout", "sliding_window",
    "use_sliding_window", "layer_types", "num_local_experts", "num_experts_per_tok", "experts_per_token",
    "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step",
    "mlp_only_layers", "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "moe_layer_freq",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "use_qk_norm",
}


def is_hf_config(text: str) -> bool:
    """Whether a --model argument names a config.json (with or without overrides after it)."""
    return text.partition(",")[0].endswith(".json")


def read_hf_config(text: str, parse_overrides) -> tuple[str, dict]:
    """(name, perfsim model fields) of `path/config.json[,key=value,...]`; `parse_overrides` parses
    the overrides as an inline model spec does."""
    path, _, rest = text.partition(",")
    where = f"config {one_line(path)}"
    try:
        config = json.loads(read_text(path, "config", ".json file"))
    except json.JSONDecodeError as exc:
        raise PerfsimError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise PerfsimError(f"{where}: expected a JSON object of model fields")
    fields = hf_fields(config, where)
    overrides = parse_overrides(rest) if rest.strip() else {}
    name = config.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf-model"
    return str(name), {**fields, **overrides}


def _int(config: dict, key: str, where: str, default=None) -> int:
    """config[key] (default where absent or null), a whole number, or a one-line error naming it."""
    value = config.get(key)
    value = default if value is None else value
    if value is None:
        raise PerfsimError(f"{where}: needs {key}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise PerfsimError(f"{where}: {key} must be a whole number, got {value!r}")
    return value


def hf_fields(config: dict, where: str) -> dict:
    """perfsim model fields of a Hugging Face config (no seq: the caller sets it)."""
    if "text_config" in config:
        raise PerfsimError(f"{where}: a multimodal config (text_config); give the language model's config.json")
    family = config.get("model_type")
    if family not in FAMILIES:
        raise PerfsimError(f"{where}: model_type {family!r} is not one perfsim maps ({', '.join(FAMILIES)})")
    unknown = [key for key in config if key not in _KNOWN]
    if unknown:
        raise PerfsimError(f"{where}: field {unknown[0]!r} is not one perfsim knows how to price for {family}; "
                           "remove it if it does not change the cost")
    if config.get("attention_dropout"):
        raise PerfsimError(f"{where}: attention_dropout {config['attention_dropout']} cannot be priced "
                           "(perfsim's dropout covers attention, projection and MLP together)")
    activation = config.get("hidden_act", "silu")
    if activation not in GATED_ACTIVATIONS:
        raise PerfsimError(f"{where}: hidden_act {activation!r} cannot be priced: the {family} MLP is a gated "
                           "(SwiGLU) one, perfsim prices silu")
    heads = _int(config, "num_attention_heads", where)
    hidden = _int(config, "hidden_size", where)
    fields = {
        "layers": _int(config, "num_hidden_layers", where), "hidden": hidden, "heads": heads,
        "kv_heads": _int(config, "num_key_value_heads", where, heads), "vocab": _int(config, "vocab_size", where),
        "ffn": _int(config, "intermediate_size", where), "seq": DEFAULT_SEQ,
        "activation": "swiglu", "norm": "rmsnorm", "learned_positions": False, "dropout": False,
        "tied_embeddings": bool(config.get("tie_word_embeddings", False)),
        "bias": _bias(config, family, where),
    }
    if config.get("head_dim") is not None:
        fields["head_dim"] = _int(config, "head_dim", where)
    if family in ("qwen3", "qwen3_moe") or config.get("use_qk_norm"):
        fields["qk_norm"] = True
    fields.update(_window(config, family, where))
    fields.update(_experts(config, family, where, fields["layers"]))
    if family == "deepseek_v3":
        fields.update(_latent(config, where))
        fields.pop("head_dim", None)
    if family == "gpt_oss":
        fields["attention_sinks"] = True
    return fields


def _bias(config: dict, family: str, where: str) -> bool:
    """perfsim's one bias flag: biases on every linear. GPT-OSS has them on QKV, the projection,
    the router and the experts; Llama may on attention or MLP only (refused where they differ);
    Qwen2's QKV biases alone (q + 2 kv per layer, no FLOPs) are left out."""
    if family == "gpt_oss":
        return bool(config.get("attention_bias", True))
    attention, mlp = bool(config.get("attention_bias", False)), bool(config.get("mlp_bias", False))
    if attention != mlp:
        key = "attention_bias" if attention else "mlp_bias"
        raise PerfsimError(f"{where}: {key} true with {'mlp_bias' if attention else 'attention_bias'} false cannot "
                           "be priced (perfsim's bias puts biases on every linear)")
    return attention


def _window(config: dict, family: str, where: str) -> dict:
    """window and window_every: GPT-OSS's layer_types (sliding_attention on every k-th layer from
    the first); Mistral's sliding_window on every layer; Qwen2/3 only with use_sliding_window."""
    window = config.get("sliding_window")
    if window is None or (family.startswith("qwen") and not config.get("use_sliding_window", False)):
        return {}
    window = _int(config, "sliding_window", where)
    types = config.get("layer_types")
    if types is None:
        return {"window": window}
    if not isinstance(types, list) or not types:
        raise PerfsimError(f"{where}: layer_types must be a list of the layers' attention kinds")
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if not sliding:
        return {}
    every = sliding[1] - sliding[0] if len(sliding) > 1 else len(types)
    if sliding != list(range(0, len(types), every)):
        raise PerfsimError(f"{where}: layer_types puts sliding windows on layers {sliding[:4]}...; perfsim prices "
                           "a window on every k-th layer from the first")
    return {"window": window, "window_every": every}


def _experts(config: dict, family: str, where: str, layers: int) -> dict:
    """experts, topk, expert_ffn, shared_expert_ffn and dense_layers of the MoE families."""
    if family in ("mixtral", "gpt_oss"):
        topk_key = "num_experts_per_tok" if "num_experts_per_tok" in config else "experts_per_token"
        return {"experts": _int(config, "num_local_experts", where), "topk": _int(config, topk_key, where),
                "expert_ffn": _int(config, "intermediate_size", where)}
    if family in ("qwen2_moe", "qwen3_moe"):
        if config.get("decoder_sparse_step", 1) != 1:
            raise PerfsimError(f"{where}: decoder_sparse_step {config['decoder_sparse_step']} cannot be priced "
                               "(perfsim's expert layers follow the first dense_layers, every one)")
        dense = config.get("mlp_only_layers") or []
        if dense != list(range(len(dense))):
            raise PerfsimError(f"{where}: mlp_only_layers {dense} cannot be priced (perfsim's dense layers are the "
                               "first dense_layers)")
        return {"experts": _int(config, "num_experts", where), "topk": _int(config, "num_experts_per_tok", where),
                "expert_ffn": _int(config, "moe_intermediate_size", where),
                "shared_expert_ffn": _int(config, "shared_expert_intermediate_size", where, 0), "dense_layers": len(dense)}
    if family == "deepseek_v3":
        if config.get("moe_layer_freq", 1) != 1:
            raise PerfsimError(f"{where}: moe_layer_freq {config['moe_layer_freq']} cannot be priced "
                               "(perfsim's expert layers follow the first dense_layers, every one)")
        width = _int(config, "moe_intermediate_size", where)
        return {"experts": _int(config, "n_routed_experts", where), "topk": _int(config, "num_experts_per_tok", where),
                "expert_ffn": width, "shared_expert_ffn": _int(config, "n_shared_experts", where, 0) * width,
                "dense_layers": min(_int(config, "first_k_dense_replace", where, 0), layers),
                **_node_limit(config, where)}
    return {}


def _node_limit(config: dict, where: str) -> dict:
    """routing_nodes of DeepSeek's group-limited routing: the experts in n_group groups, each
    token's topk from its best topk_group groups. Megatron-Core runs it as node-limited routing
    with the groups laid on the EP group's nodes (moe_router_num_groups = its nodes, as DeepSeek-V3's
    8 groups on EP 64's 8 nodes); perfsim keeps that: at most topk_group nodes a token, whatever the
    plan's node count (docs/equations.md 12.3). None where topk_group leaves every group open."""
    groups, chosen = _int(config, "n_group", where, 1), _int(config, "topk_group", where, 0)
    if groups < 1 or not 0 <= chosen:
        raise PerfsimError(f"{where}: n_group {groups} and topk_group {chosen} must be positive")
    if not chosen or chosen >= groups:
        return {}
    experts, topk = _int(config, "n_routed_experts", where), _int(config, "num_experts_per_tok", where)
    if experts % groups or topk > chosen * (experts // groups):
        raise PerfsimError(f"{where}: n_group {groups} must divide n_routed_experts {experts}, and topk_group {chosen} "
                           f"groups hold num_experts_per_tok {topk}")
    return {"routing_nodes": chosen}


def _latent(config: dict, where: str) -> dict:
    """DeepSeek-V3's latent attention widths (q_lora_rank null: queries projected directly)."""
    return {"attention_type": "mla", "q_lora_rank": _int(config, "q_lora_rank", where, 0),
            "kv_lora_rank": _int(config, "kv_lora_rank", where),
            "qk_nope_dim": _int(config, "qk_nope_head_dim", where), "qk_rope_dim": _int(config, "qk_rope_head_dim", where),
            "v_head_dim": _int(config, "v_head_dim", where)}
