"""GPT-style decoder specifications: presets, inline specs and TOML files."""

from __future__ import annotations

import dataclasses
import os
from perfsim.spec._toml import read_toml
from dataclasses import dataclass

import numpy as np

from perfsim.errors import PerfsimError, did_you_mean
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

    def __post_init__(self):  # a spec built directly with gated_mlp = True is a SwiGLU model
        if self.gated_mlp and self.activation == "gelu":
            object.__setattr__(self, "activation", "swiglu")
        object.__setattr__(self, "gated_mlp", self.activation == "swiglu")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_head_count(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): kv_heads x head_dim."""
        return self.kv_head_count * self.head_dim

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


_INT_FIELDS = ("layers", "hidden", "heads", "seq", "vocab", "ffn", "kv_heads", "vocab_divisor")
ACTIVATIONS = ("gelu", "swiglu", "squared-relu")
_BOOL_FIELDS = ("gated_mlp", "tied_embeddings", "bias", "learned_positions", "dropout")
_REQUIRED = ("layers", "hidden", "heads", "seq", "vocab")


def build_model(name: str, fields: dict, where: str) -> ModelSpec:
    """Check raw fields (from a preset, an inline spec or a TOML file) and build the spec."""
    known = sorted(set(_INT_FIELDS) | set(_BOOL_FIELDS) | {"norm", "name", "activation"})
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
    for key in _BOOL_FIELDS:
        if key in fields and not isinstance(fields[key], bool):
            raise PerfsimError(f"{where}: model field {key} must be true or false, got {fields[key]!r}")
    if "name" in fields and not (isinstance(fields["name"], str) and fields["name"].strip()):
        raise PerfsimError(f"{where}: model field name must be a non-empty string, got {fields['name']!r}")
    if fields.get("norm", "layernorm") not in ("layernorm", "rmsnorm"):
        raise PerfsimError(f"{where}: model field norm must be layernorm or rmsnorm, got {fields['norm']!r}")
    fields = _activation(fields, where)
    spec = ModelSpec(name=str(fields.get("name", name)), **{k: v for k, v in fields.items() if k != "name"})
    if spec.hidden % spec.heads:
        raise PerfsimError(f"{where}: hidden ({spec.hidden}) must be a multiple of heads ({spec.heads})")
    if spec.heads % spec.kv_head_count:
        raise PerfsimError(f"{where}: heads ({spec.heads}) must be a multiple of kv_heads ({spec.kv_head_count})")
    return spec


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
        elif key in ("norm", "name", "activation"):
            fields[key] = raw
        else:
            try:
                fields[key] = int(raw)
            except ValueError:
                raise PerfsimError(f"model spec {_quoted(text)}: {key} must be a whole number, got {_quoted(raw)}") from None
    return fields


def load_model(text: str) -> ModelSpec:
    """A preset name, an inline `key=value,...` spec, or a path to a TOML file."""
    if text in PRESETS:
        return build_model(text, dict(PRESETS[text]), f"preset {text}")
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
    raise PerfsimError(f"unknown model {_quoted(text)}: use a preset (see `perfsim profiles`), key=value pairs, or a .toml file")
