"""GPT-style decoder specifications: presets, inline specs and TOML files."""

from __future__ import annotations

import dataclasses
import os
from perfsim.spec._toml import read_toml
from dataclasses import dataclass

import numpy as np

from perfsim.errors import PerfsimError, did_you_mean
from perfsim.spec.hf_config import is_hf_config, read_hf_config
from perfsim.spec.presets import PRESETS

LARGEST_SIZE = 2**40  # sizes above this are typos, and would overflow the cost layer's integers


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. Sizes are counts; `vocab` is the tokenizer's, unpadded."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int = 0  # 0 means 4 x hidden
    kv_heads: int = 0  # 0 means heads (multi-head attention); fewer means grouped-query
    gated_mlp: bool = False  # SwiGLU-style MLP: two input projections of ffn columns (activation "swiglu")
    tied_embeddings: bool = True  # output layer shares the input embedding's weights
    bias: bool = True  # linear layers and norms carry biases (GPT) or not (Llama)
    norm: str = "layernorm"  # "layernorm" (gamma, beta) or "rmsnorm" (gamma only)
    learned_positions: bool = True  # a [seq, hidden] position embedding (GPT) or rotary (none)
    dropout: bool = True  # dropout layers present (they keep masks for backward)
    vocab_divisor: int = 128  # Megatron's make-vocab-size-divisible-by
    # The MLP's activation: "gelu" (GPT), "swiglu" (Llama; the same as gated_mlp, which build_model
    # keeps in step with it) or "squared-relu" (Primer, Nemotron: relu(x)^2, priced as gelu is)
    activation: str = "gelu"
    # Attention width: query heads x head_dim, which need not be hidden (Qwen3, GPT-OSS); 0 = hidden / heads
    head_dim: int = 0
    qk_norm: bool = False  # a norm of head_dim on each query and key head (Qwen3, OLMo 2)
    # "mha" (multi-head, or grouped-query with kv_heads < heads) or "mla" (DeepSeek-V2/V3 latent
    # attention: queries and keys/values through low-rank latents of q_lora_rank and kv_lora_rank;
    # each head's query/key is qk_nope_dim + qk_rope_dim wide, its value v_head_dim)
    attention_type: str = "mha"
    q_lora_rank: int = 0  # 0 with mla: queries projected directly (DeepSeek-V2-Lite)
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    window: int = 0  # sliding-window attention of `window` tokens (0 = full causal attention) ...
    window_every: int = 0  # ... on every window_every-th layer (1 or 0: every layer; GPT-OSS: 2)
    # (layer i, counted from 0, is windowed when i is a multiple of window_every: GPT-OSS's first is)
    attention_sinks: bool = False  # a learned logit per query head in the softmax's denominator (GPT-OSS)
    # Mixture of experts (0 experts = a dense model). Each token runs `topk` of `experts` routed
    # FFNs of expert_ffn columns, plus the always-on shared experts (shared_expert_ffn columns in
    # all); the first dense_layers layers keep a dense FFN of `ffn` columns.
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0
    dense_layers: int = 0
    capacity_factor: float = 0.0  # tokens an expert takes, over its fair share; 0 = dropless
    # node-limited routing (DeepSeek-V3): each token's routed experts lie on at most this many nodes
    # of its expert-parallel group (the router's groups laid on the group's nodes); 0 = unlimited
    routing_nodes: int = 0

    def __post_init__(self):  # a spec built directly with gated_mlp = True is a SwiGLU model
        if self.gated_mlp and self.activation == "gelu":
            object.__setattr__(self, "activation", "swiglu")
        object.__setattr__(self, "gated_mlp", self.activation == "swiglu")
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads if self.heads else 0)

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_head_count(self) -> int:
        return self.kv_heads or self.heads

    @property
    def q_width(self) -> int:
        """Width of the queries and of the attention output: heads x head_dim (hidden in GPT, Llama)."""
        return self.heads * self.head_dim

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): kv_heads x head_dim."""
        return self.kv_head_count * self.head_dim

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers whose FFN is the routed experts (every layer after the first dense_layers)."""
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def mla(self) -> bool:
        return self.attention_type == "mla"

    def padded_vocab(self, tp: int = 1) -> int:
        """Megatron pads the vocabulary to a multiple of vocab_divisor x tensor-parallel size."""
        multiple = self.vocab_divisor * tp
        if isinstance(multiple, np.ndarray):  # a search's batch: ceil of a float quotient, exact at these sizes
            return np.ceil(self.vocab / multiple) * multiple  # and far quicker than a float floor division
        return -(-self.vocab // multiple) * multiple

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ffn"] = self.ffn_size
        d["kv_heads"] = self.kv_head_count
        return d


_INT_FIELDS = ("layers", "hidden", "heads", "seq", "vocab", "ffn", "kv_heads", "vocab_divisor", "head_dim",
               "q_lora_rank", "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim", "window", "window_every",
               "experts", "topk", "expert_ffn", "shared_expert_ffn", "dense_layers", "routing_nodes")
_FLOAT_FIELDS = ("capacity_factor",)
_STR_FIELDS = ("norm", "name", "activation", "attention_type")
ACTIVATIONS = ("gelu", "swiglu", "squared-relu")
ATTENTION_TYPES = ("mha", "mla")
_MLA_FIELDS = ("kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim")
_BOOL_FIELDS = ("gated_mlp", "tied_embeddings", "bias", "learned_positions", "dropout", "qk_norm", "attention_sinks")
_REQUIRED = ("layers", "hidden", "heads", "seq", "vocab")


def build_model(name: str, fields: dict, where: str) -> ModelSpec:
    """Check raw fields (from a preset, an inline spec or a TOML file) and build the spec."""
    known = sorted(set(_INT_FIELDS) | set(_FLOAT_FIELDS) | set(_BOOL_FIELDS) | set(_STR_FIELDS))
    unknown = [key for key in fields if key not in known]
    if unknown:
        raise PerfsimError(f"{where}: unknown model field {unknown[0]!r}{did_you_mean(unknown[0], known)}; "
                           f"known: {', '.join(known)}")
    missing = [k for k in _REQUIRED if k not in fields]
    if missing:
        raise PerfsimError(f"{where}: model needs {', '.join(missing)} (e.g. layers=96,hidden=12288,heads=96,seq=2048,vocab=51200)")
    for key in _INT_FIELDS:
        if key in fields:
            value = fields[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise PerfsimError(f"{where}: model field {key} must be a whole number, got {value!r}")
            if value < 0 or (value == 0 and key in _REQUIRED + ("vocab_divisor",)):
                raise PerfsimError(f"{where}: model field {key} must be positive, got {value}")
            if value > LARGEST_SIZE:
                raise PerfsimError(f"{where}: model field {key} {value} is implausibly large (at most {LARGEST_SIZE})")
    for key in _FLOAT_FIELDS:
        value = fields.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= LARGEST_SIZE:
            raise PerfsimError(f"{where}: model field {key} must be a number >= 0 (0: none), got {value!r}")
    for key in _BOOL_FIELDS:
        if key in fields and not isinstance(fields[key], bool):
            raise PerfsimError(f"{where}: model field {key} must be true or false, got {fields[key]!r}")
    if "name" in fields and not (isinstance(fields["name"], str) and fields["name"].strip()):
        raise PerfsimError(f"{where}: model field name must be a non-empty string, got {fields['name']!r}")
    if fields.get("norm", "layernorm") not in ("layernorm", "rmsnorm"):
        raise PerfsimError(f"{where}: model field norm must be layernorm or rmsnorm, got {fields['norm']!r}")
    fields = _activation(fields, where)
    if fields.get("attention_type", "mha") not in ATTENTION_TYPES:
        raise PerfsimError(f"{where}: model field attention_type must be mha or mla, got {fields['attention_type']!r}")
    spec = ModelSpec(name=str(fields.get("name", name)), **{k: v for k, v in fields.items() if k != "name"})
    if not fields.get("head_dim") and spec.hidden % spec.heads:
        raise PerfsimError(f"{where}: hidden ({spec.hidden}) must be a multiple of heads ({spec.heads}), "
                           "or give head_dim")
    if spec.heads % spec.kv_head_count:
        raise PerfsimError(f"{where}: heads ({spec.heads}) must be a multiple of kv_heads ({spec.kv_head_count})")
    _check_attention(spec, fields, where)
    _check_experts(spec, fields, where)
    return spec


def _check_attention(spec: ModelSpec, fields: dict, where: str) -> None:
    """Latent-attention fields go with attention_type = mla only, and mla needs its four widths."""
    given = [key for key in _MLA_FIELDS + ("q_lora_rank",) if fields.get(key)]
    if not spec.mla and given:
        raise PerfsimError(f"{where}: model field {given[0]} is a latent-attention width: give attention_type = mla")
    missing = [key for key in _MLA_FIELDS if spec.mla and not fields.get(key)]
    if missing:
        raise PerfsimError(f"{where}: attention_type = mla needs {', '.join(missing)}")
    if fields.get("window_every") and not fields.get("window"):
        raise PerfsimError(f"{where}: window_every needs window (the sliding window's tokens)")


def _check_experts(spec: ModelSpec, fields: dict, where: str) -> None:
    """A mixture of experts needs its top-k and expert width; a dense model takes none of its keys."""
    keys = ("topk", "expert_ffn", "shared_expert_ffn", "dense_layers", "capacity_factor", "routing_nodes")
    if not spec.moe:
        given = [key for key in keys if fields.get(key)]
        if given:
            raise PerfsimError(f"{where}: model field {given[0]} needs experts (the number of routed experts)")
        return
    if not spec.topk or not spec.expert_ffn:
        raise PerfsimError(f"{where}: a mixture of experts needs topk and expert_ffn (experts = {spec.experts})")
    if spec.topk > spec.experts:
        raise PerfsimError(f"{where}: topk ({spec.topk}) exceeds experts ({spec.experts})")
    if spec.dense_layers >= spec.layers:
        raise PerfsimError(f"{where}: dense_layers ({spec.dense_layers}) leaves no expert layer of {spec.layers}")
    if spec.capacity_factor and spec.capacity_factor * spec.topk < 1:
        raise PerfsimError(f"{where}: capacity_factor {spec.capacity_factor} x topk {spec.topk} drops most tokens "
                           "(at least 1/topk)")


def _activation(fields: dict, where: str) -> dict:
    """`fields` with activation and gated_mlp in step: gated_mlp = true is the old spelling of
    activation = swiglu; the two may not disagree."""
    activation = fields.get("activation")
    if activation is not None and activation not in ACTIVATIONS:
        raise PerfsimError(f"{where}: model field activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    gated = fields.get("gated_mlp")
    if activation is not None and gated is not None and gated != (activation == "swiglu"):
        raise PerfsimError(f"{where}: gated_mlp = {str(gated).lower()} contradicts activation = {activation} "
                           "(gated_mlp = true is the old spelling of activation = swiglu); give one of them")
    activation = activation or ("swiglu" if gated else "gelu")
    return {**fields, "activation": activation, "gated_mlp": activation == "swiglu"}


def _quoted(text: str) -> str:
    """`text` as a message quotes it: at most 80 characters (a spec may be any length)."""
    return repr(text if len(text) <= 80 else text[:80] + "...")


def _parse_inline(text: str) -> dict:
    fields: dict = {}
    for part in text.split(","):
        key, sep, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key or not raw:
            raise PerfsimError(f"model spec {_quoted(text)}: expected key=value pairs separated by commas, "
                               f"got {_quoted(part.strip())}")
        if key in fields:
            raise PerfsimError(f"model spec {_quoted(text)}: {key} is given twice")
        if raw.lower() in ("true", "false"):
            fields[key] = raw.lower() == "true"
        elif key in _STR_FIELDS:
            fields[key] = raw
        elif key in _FLOAT_FIELDS:
            try:
                fields[key] = float(raw)
            except ValueError:
                raise PerfsimError(f"model spec {_quoted(text)}: {key} must be a number, got {_quoted(raw)}") from None
        else:
            try:
                fields[key] = int(raw)
            except ValueError:
                raise PerfsimError(f"model spec {_quoted(text)}: {key} must be a whole number, got {_quoted(raw)}") from None
    return fields


def load_model(text: str) -> ModelSpec:
    """A preset name, an inline `key=value,...` spec, a path to a TOML file, or a Hugging Face
    config.json (`path/config.json[,key=value,...]`: perfsim.spec.hf_config)."""
    if text in PRESETS:
        return build_model(text, dict(PRESETS[text]), f"preset {text}")
    if is_hf_config(text):  # a Hugging Face config.json, optionally followed by ",key=value" overrides
        name, fields = read_hf_config(text, _parse_inline)
        return build_model(name, fields, f"config {_quoted(text.partition(',')[0])}")
    if text.endswith(".toml") or os.path.sep in text:
        data = read_toml(text, "model file")
        if "model" in data:  # the fields under [model]; nothing else beside it
            beside = [key for key in data if key != "model"]
            if beside:
                raise PerfsimError(f"model file {text}: unknown key {beside[0]!r} beside [model]; put the model "
                                   f"fields under [model], or leave [model] out and give them at the top")
            data = data["model"]
        if not isinstance(data, dict):
            raise PerfsimError(f"model file {text}: [model] must be a table of model fields")
        return build_model(os.path.splitext(os.path.basename(text))[0], data, f"model file {text}")
    if "=" in text:
        return build_model("custom", _parse_inline(text), f"model spec {_quoted(text)}")
    raise PerfsimError(f"unknown model {_quoted(text)}: use a preset (see `perfsim profiles`), key=value pairs, a .toml "
                       "file or a Hugging Face config.json")
