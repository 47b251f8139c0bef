"""perfsim.spec.model: presets, inline `key=value` specs and TOML files give the same ModelSpec."""

from __future__ import annotations

import pytest

from perfsim.errors import PerfsimError
from perfsim.spec.model import ModelSpec, load_model


def test_inline_spec_fields_and_defaults():
    m = load_model("layers=96,hidden=12288,heads=96,seq=2048,vocab=51200")
    assert (m.layers, m.hidden, m.heads, m.seq, m.vocab) == (96, 12288, 96, 2048, 51200)
    assert m.ffn_size == 4 * 12288 and m.kv_head_count == 96 and m.head_dim == 128
    assert m.name == "custom"


def test_inline_optional_fields_and_spaces():
    m = load_model(" layers = 4 , hidden=256,heads=8,seq=64,vocab=1000,ffn=700,kv_heads=2,gated_mlp=true,norm=rmsnorm")
    assert (m.ffn_size, m.kv_head_count, m.kv_hidden, m.gated_mlp, m.norm) == (700, 2, 64, True, "rmsnorm")


def test_toml_file_equals_inline(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("[model]\nlayers = 4\nhidden = 256\nheads = 8\nseq = 64\nvocab = 1000\nffn = 700\n")
    from_file = load_model(str(path))
    inline = load_model("layers=4,hidden=256,heads=8,seq=64,vocab=1000,ffn=700")
    assert from_file.name == "mine"
    assert from_file.as_dict() | {"name": ""} == inline.as_dict() | {"name": ""}


def test_toml_file_without_model_table(tmp_path):
    path = tmp_path / "flat.toml"
    path.write_text('name = "flat-one"\nlayers = 2\nhidden = 64\nheads = 4\nseq = 8\nvocab = 10\n')
    m = load_model(str(path))
    assert m.name == "flat-one" and m.layers == 2


def test_preset_equals_its_inline_spec():
    preset = load_model("gpt3-175b")
    inline = load_model("layers=96,hidden=12288,heads=96,seq=2048,vocab=50257")
    assert preset.as_dict() | {"name": ""} == inline.as_dict() | {"name": ""}


@pytest.mark.parametrize("vocab,tp,expected", [(50257, 1, 50304), (50257, 2, 50432), (50257, 8, 51200),
                                                (51200, 8, 51200), (32000, 1, 32000), (32000, 8, 32768)])
def test_padded_vocab(vocab, tp, expected):
    m = ModelSpec(name="v", layers=1, hidden=64, heads=1, seq=8, vocab=vocab)
    assert m.padded_vocab(tp) == expected


def test_llama2_70b_is_grouped_query():
    m = load_model("llama2-70b")
    assert (m.heads, m.kv_head_count, m.ffn_size, m.gated_mlp, m.tied_embeddings) == (64, 8, 28672, True, False)


@pytest.mark.parametrize("text", ["", "nope", "layers", "layers=1,,hidden=2", "layers=1.5,hidden=64,heads=4,seq=8,vocab=10",
                                  "layers=2,hidden=64,heads=4,seq=8,vocab=10,dropout=maybe",
                                  "layers=2,hidden=64,heads=4,seq=8,vocab=0", "layers=2,hidden=64,heads=4,seq=8,vocab=10,vocab_divisor=0"])
def test_bad_specs_raise_perfsim_error(text):
    with pytest.raises(PerfsimError):
        load_model(text)
