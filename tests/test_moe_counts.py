"""Counts of today's models (docs/equations.md 1.4-1.5, 2.8-2.9) against published totals and hand counts.

Published totals: Qwen3 technical report (arXiv 2505.09388, Table 2: 30.5B / 3.3B activated,
235B / 22B), the gpt-oss model card (Table 1: 116.83B total, 5.13B active), DeepSeek-V3 (arXiv
2412.19437: 671B / 37B, without its 14B MTP module), Mixtral (arXiv 2401.04088: 46.7B / 12.9B).
The hand counts below are written out from the shapes (shared/reference/published.md section 7
and the checkpoints' config.json), not from perfsim.cost.counts. The FLOPs per token of the
Megatron-Bridge rows of published.md section 7 (model TFLOP/s/GPU over tokens/s/GPU) are
reproduced from Megatron-Bridge's own convention, and perfsim's count is related to it term by term.
"""

from __future__ import annotations

import math

import pytest

from perfsim.cost import counts
from perfsim.spec.model import load_model

B = 1e9


def truncated(x: float, digits: int) -> float:
    """x cut (not rounded) to `digits` decimals: how the model cards state 3.3B for 3.35B."""
    return math.floor(x * 10**digits) / 10**digits


@pytest.mark.parametrize("preset, total, active, digits", [
    ("qwen3-30b-a3b", 30.5, 3.3, 1),
    ("qwen3-235b-a22b", 235, 22, 0),
    ("deepseek-v3", 671, 37, 0),
    ("mixtral-8x7b", 46.7, 12.8, 1),
])
def test_published_totals(preset, total, active, digits):
    model = load_model(preset)
    assert truncated(counts.total_params(model) / B, digits) == total
    assert truncated(counts.active_params(model) / B, digits) == active


def test_mixtral_rounds_to_its_published_12_9b():
    model = load_model("mixtral-8x7b")
    assert round(counts.total_params(model) / B, 1) == 46.7 and round(counts.active_params(model) / B, 1) == 12.9


def test_gpt_oss_model_card_to_the_ten_millions():
    """The model card counts active parameters without the input embedding (a lookup, no compute)."""
    model = load_model("gpt-oss-120b")
    word = counts.embedding_params(model, model.padded_vocab())["word"]
    assert abs(counts.total_params(model) / B - 116.83) < 0.005
    assert abs((counts.active_params(model) - word) / B - 5.13) < 0.005
    small = load_model("gpt-oss-20b")  # the card's 20.91B / 3.61B
    assert abs(counts.total_params(small) / B - 20.91) < 0.005
    assert abs((counts.active_params(small) - counts.embedding_params(small, small.padded_vocab())["word"]) / B
               - 3.61) < 0.005


def test_qwen3_30b_by_hand():
    L, h, a, k, d, E, K, fe, V = 48, 2048, 32, 4, 128, 128, 8, 768, 151936
    attention = h * (a * d + 2 * k * d) + a * d * h + 2 * d  # QKV, projection, q and k norms
    expert = 3 * h * fe  # gate, up, down
    layer = attention + 2 * h + h * E + E * expert
    total = L * layer + 2 * V * h + h  # untied embeddings, final norm
    model = load_model("qwen3-30b-a3b")
    assert counts.total_params(model) == total
    assert counts.active_params(model) == total - L * (E - K) * expert
    assert counts.moe_layer_params(model) == {"qkv": h * (a * d + 2 * k * d), "proj": a * d * h, "qk_norm": 2 * d,
                                              "norms": 2 * h, "router": h * E, "experts": E * expert, "shared": 0}


def test_gpt_oss_by_hand():
    L, h, a, k, d, E, K, fe, V = 36, 2880, 64, 8, 64, 128, 4, 2880, 201088
    attention = h * (a * d + 2 * k * d) + (a * d + 2 * k * d) + a * d * h + h + a  # with biases and sinks
    expert = h * 2 * fe + 2 * fe + fe * h + h
    layer = attention + 2 * h + (h * E + E) + E * expert
    model = load_model("gpt-oss-120b")
    assert counts.total_params(model) == L * layer + 2 * V * h + h


def test_deepseek_v3_by_hand():
    L, dense, h, a, E, K, fe, f, V = 61, 3, 7168, 128, 256, 8, 2048, 18432, 129280
    qr, kvr, nope, rope, v = 1536, 512, 128, 64, 128
    attention = h * qr + qr + qr * a * (nope + rope) + h * (kvr + rope) + kvr + kvr * a * (nope + v) + a * v * h
    dense_layer = attention + 2 * h + 3 * h * f
    moe_layer = attention + 2 * h + h * E + (E + 1) * 3 * h * fe  # routed experts and one shared
    model = load_model("deepseek-v3")
    total = dense * dense_layer + (L - dense) * moe_layer + 2 * V * h + h
    assert counts.total_params(model) == total
    assert counts.active_params(model) == total - (L - dense) * (E - K) * 3 * h * fe
    assert sum(counts.attention_params(model).values()) == attention


def test_moe_flops_by_hand():
    model = load_model("deepseek-v3")
    T, h, E, K, fe = 4096, 7168, 256, 8, 2048
    flops = counts.moe_layer_forward_flops(model, T)
    assert flops["router"] == 2 * T * h * E
    assert flops["shared_fc1"] + flops["shared_fc2"] == 2 * T * 3 * h * fe
    assert flops["expert_fc1"] + flops["expert_fc2"] == 2 * T * K * 3 * h * fe
    a, s = 128, model.seq
    assert flops["scores"] == 2 * T * s * a * (128 + 64) and flops["context"] == 2 * T * s * a * 128
    assert flops["kv_down"] == 2 * T * h * (512 + 64) and flops["q_up"] == 2 * T * 1536 * a * 192
    dropping = load_model("mixtral-8x7b")
    import dataclasses
    capped = dataclasses.replace(dropping, capacity_factor=0.75)
    assert counts.moe_layer_forward_flops(capped, T)["expert_fc2"] == 0.75 * 2 * T * 2 * 14336 * 4096


def test_windows_count_the_window_keys_on_every_other_layer():
    model = load_model("gpt-oss-120b")
    assert counts.layer_kinds(model) == [(18, True, False), (18, True, True)]
    s, q = model.seq, model.q_width
    full, windowed = (counts.moe_layer_forward_flops(model, s, keys) for keys in (s, 128))
    assert full["scores"] == 2 * s * s * q and windowed["scores"] == 2 * s * 128 * q
    logits = 2 * s * model.hidden * model.padded_vocab()
    assert counts.model_flops_per_sample(model) == 3 * (18 * sum(full.values()) + 18 * sum(windowed.values()) + logits)


def megatron_bridge_flops_per_token(L, h, q, kv, s, V, topk, fe, gated, window_layers=0, window=0):
    """Megatron-Bridge's count (src/megatron/bridge/training/utils/flop_utils.py, transformer_flops),
    written out: 6 x (per token) MLP h fe topk x (3 gated, 2 not), projections h (q + 2 kv) + q h,
    the core causal-halved, q s (a sliding layer: q (w - w (w - 1) / 2 s) x 2), logits h V; no router."""
    mlp = h * fe * topk * (3 if gated else 2) * L
    projections = (h * (q + 2 * kv) + q * h) * L
    context = window - window * (window - 1) / (2 * s)
    core = q * s * (L - window_layers) + 2 * q * context * window_layers
    return 6 * (mlp + projections + core + h * V)


# (model TFLOP/s/GPU, tokens/s/GPU) of published.md section 7, 26.02 and 25.11
PUBLISHED = {"qwen3-30b-a3b": [(118, 5113), (121, 5275)], "qwen3-235b-a22b": [(242, 1633), (233, 1575)],
             "gpt-oss-120b": [(163, 5993), (153, 5630)]}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_megatron_bridge_flops_per_token(preset):
    """Bridge's convention reproduces the published FLOPs per token to the rows' three digits; for
    GPT-OSS only as a non-gated MLP with every layer full (its recipe's count then), 0.1% off."""
    m = load_model(preset)
    gpt_oss = preset == "gpt-oss-120b"
    bridge = megatron_bridge_flops_per_token(m.layers, m.hidden, m.q_width, m.kv_hidden, m.seq, m.padded_vocab(),
                                             m.topk, m.expert_ffn, gated=not gpt_oss)
    for tflops, tokens in PUBLISHED[preset]:
        assert abs(tflops * 1e12 / tokens / bridge - 1) < 0.007
    # perfsim against Bridge: the full s x s square (Bridge halves it), the router GEMM, and for
    # GPT-OSS the gated MLP's third projection and the window's keys on half the layers
    ours = counts.model_flops_per_sample(m) / m.seq
    router = 6 * m.hidden * m.experts * m.layers
    core = 6 * m.q_width * m.seq * m.layers  # what halving leaves out
    if gpt_oss:
        windowed = m.layers // 2
        core = 12 * m.q_width * (m.seq * (m.layers - windowed) + 128 * windowed) - 6 * m.q_width * m.seq * m.layers
        gate = 6 * m.hidden * m.expert_ffn * m.topk * m.layers
        assert ours == pytest.approx(bridge + core + router + gate, rel=1e-12)
    else:
        assert ours == pytest.approx(bridge + core + router, rel=1e-12)


def test_ratio_of_perfsim_to_the_published_flops():
    """What docs/equations.md 2.9 states: perfsim's model FLOPs are 1.21 (Qwen3 30B-A3B), 1.13
    (235B-A22B) and 1.27 (GPT-OSS 120B) times the published rows' (26.02)."""
    ratios = {p: counts.model_flops_per_sample(load_model(p)) / load_model(p).seq / (t * 1e12 / n)
              for p, [(t, n), _] in PUBLISHED.items()}
    assert [round(ratios[p], 2) for p in PUBLISHED] == [1.21, 1.13, 1.27]
