"""The cost layer's attention variants (docs/equations.md 3.13 and 7.2) against hand counts:
head_dim apart from hidden / heads, qk norms, sliding windows, latent attention (MLA) in 1d."""

from __future__ import annotations

import subprocess
import sys

import pytest

from perfsim.cost import counts, memory
from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.columns import NONE, columns_of
from perfsim.cost.layer import causal_share
from perfsim.errors import PerfsimError
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan

MODERN = "activation=swiglu,norm=rmsnorm,bias=false,learned_positions=false,dropout=false,tied_embeddings=false"
# Qwen3 30B-A3B's attention on a dense layer (the experts are priced apart)
WIDE = load_model(f"layers=4,hidden=2048,heads=32,kv_heads=4,head_dim=128,qk_norm=true,seq=4096,vocab=151936,"
                  f"ffn=6144,{MODERN}")
# GPT-OSS's attention: every other layer a 128-token window
WINDOWED = load_model(f"layers=4,hidden=2880,heads=64,kv_heads=8,head_dim=64,window=128,window_every=2,seq=4096,"
                      f"vocab=201088,ffn=2880,{MODERN}")
# DeepSeek-V3's latent attention
LATENT_SPEC = (f"layers=4,hidden=7168,heads=128,attention_type=mla,q_lora_rank=1536,kv_lora_rank=512,"
               f"qk_nope_dim=128,qk_rope_dim=64,v_head_dim=128,seq=4096,vocab=129280,ffn=18432,{MODERN}")
LATENT = load_model(LATENT_SPEC)


def _layout(model, **plan):
    return tpc.layout_of(model, columns_of(Plan(**plan)))


def _flops(gemms):
    return sum(2 * g.count * g.m * g.n * g.k for g in gemms)


def test_wide_attention_gemms():
    t, b, s, h = 2, 1, 4096, 2048
    gemms = {g.name: g for g in tpc.layer_gemms(_layout(WIDE, tp=t), WIDE, b)}
    assert (gemms["qkv"].m, gemms["qkv"].n, gemms["qkv"].k) == (b * s, (4096 + 2 * 512) / t, h)
    assert (gemms["proj"].m, gemms["proj"].n, gemms["proj"].k) == (b * s, h, 4096 / t)
    assert (gemms["scores"].count, gemms["scores"].n, gemms["scores"].k) == (b * 32 / t, s, 128)
    assert _flops(gemms.values()) * t == sum(counts.layer_forward_flops(WIDE, b * s).values())


@pytest.mark.parametrize("mode, tp, mbs", [("1d", 4, 1), ("2d", 4, 2), ("3d", 8, 4)])
def test_every_mode_prices_the_wide_layer_flops(mode, tp, mbs):
    gemms = tpc.layer_gemms(_layout(WIDE, tp=tp, tp_mode=mode, mbs=mbs), WIDE, mbs)
    assert _flops(gemms) * tp == pytest.approx(sum(counts.layer_forward_flops(WIDE, mbs * WIDE.seq).values()))


def test_windowed_layers_price_their_share_of_each_core():
    gemms = tpc.layer_gemms(_layout(WINDOWED, tp=1), WINDOWED, 1)
    scores = [g for g in gemms if g.name == "scores"]
    assert [(g.count, g.m, g.n) for g in scores] == [(64 * 0.5, 4096, 4096), (64 * 0.5, 4096, 128)]
    per_model = sum(layers * sum(counts.kind_forward_flops(WINDOWED, 4096, moe, windowed).values())
                    for layers, moe, windowed in counts.layer_kinds(WINDOWED))
    assert _flops(gemms) * WINDOWED.layers == per_model
    assert counts.mean_attention_keys(WINDOWED) == (4096 + 128) / 2


def test_causal_share_of_square_and_window():
    assert causal_share(4096, 4096) == 0.5
    assert causal_share(4096, 128) == 1 - 128 / (2 * 4096)


def test_latent_gemms_and_flops_with_sp():
    t, s, h = 8, 4096, 7168
    gemms = {g.name: g for g in tpc.layer_gemms(_layout(LATENT, tp=t, sp=True), LATENT, 1)}
    assert (gemms["q_down"].m, gemms["q_down"].n, gemms["q_down"].k) == (s / t, 1536, h)  # duplicated, own tokens
    assert (gemms["kv_down"].m, gemms["kv_down"].n) == (s / t, 512 + 64)
    assert (gemms["q_up"].n, gemms["kv_up"].n, gemms["proj"].k) == (128 * 192 / t, 128 * 256 / t, 128 * 128 / t)
    assert (gemms["scores"].k, gemms["context"].n) == (192, 128)
    assert _flops(gemms.values()) * t == sum(counts.layer_forward_flops(LATENT, s).values())
    # without SP every rank runs the down projections on all tokens
    no_sp = {g.name: g for g in tpc.layer_gemms(_layout(LATENT, tp=t), LATENT, 1)}
    assert no_sp["q_down"].m == s


def test_latent_collectives():
    e, T, h = 2, 4096, 7168

    def volumes(collectives, kind):
        return sorted(x.nbytes for x in collectives if x.kind == kind and x.count)

    fwd, bwd = tpc.layer_collectives(_layout(LATENT, tp=8, sp=True), LATENT, 1)
    assert volumes(fwd, tpc.ALL_GATHER) == sorted([e * T * 1536, e * T * 512, e * T * 64, e * T * h])
    assert volumes(fwd, tpc.REDUCE_SCATTER) == [e * T * h] * 2
    assert volumes(bwd, tpc.REDUCE_SCATTER) == sorted([e * T * 1536, e * T * 512, e * T * 64, e * T * h])
    fwd, bwd = tpc.layer_collectives(_layout(LATENT, tp=8), LATENT, 1)
    assert volumes(fwd, tpc.ALL_REDUCE) == [e * T * h] * 2
    assert volumes(bwd, tpc.ALL_REDUCE) == sorted([e * T * 1536, e * T * 512, e * T * h])


def test_wide_activations_by_hand():
    """Unfused, no recomputation, one device: 7.2's table with q_w = a d where Q, K and V (expanded),
    the context are, and the qk norms' inputs."""
    e, s, b, h, q, kv, f, a = 2, 4096, 1, 2048, 4096, 512, 6144, 32
    expected = (2 * e * s * b * h + 2 * e * s * b * h  # norm inputs, QKV and FC1 inputs
                + e * s * b * q + 2 * e * s * b * q + e * s * b * q  # Q, K and V expanded, the context
                + e * s * b * (q + kv)  # qk norms' inputs
                + 2 * e * s * b * f + e * s * b * f  # SwiGLU's halves, FC2's input
                + e * a * s * s * b)  # softmax output
    assert memory.activation_bytes(WIDE, b, 1, 1, NONE) == expected


def test_latent_activations_by_hand():
    """Fused attention, no recomputation, TP 8 with SP (split u = r = 8)."""
    e, s, b, h, f, t, a = 2, 4096, 1, 7168, 18432, 8, 128
    sb = s * b
    expected = ((2 * e * sb * h + 2 * e * sb * h) / t  # norm inputs, the down projections' and FC1's inputs
                + e * sb * (1536 + 512 + 64) / t + e * sb * (1536 + 512) / t  # latent norms' and up projections' inputs
                + e * sb * a * (2 * 192 + 128) / t + e * sb * a * 128 / t  # Q, K, V; the context
                + (2 * e * sb * f + e * sb * f) / t  # MLP
                + 4 * a * s * b / t)  # the kernel's log-sum-exp
    assert memory.activation_bytes(LATENT, b, t, t, NONE, flash=1) == pytest.approx(expected)


def test_latent_duplicated_weights_are_whole_on_every_rank():
    c = columns_of(Plan(tp=8, sp=True))
    pieces = counts.layer_params(LATENT)
    whole = pieces["q_down"] + pieces["q_norm"] + pieces["kv_down"] + pieces["kv_norm"] + pieces["norms"]
    layer = (sum(pieces.values()) - whole) / 8 + whole
    assert memory.stage_params(LATENT, c, "middle") == pytest.approx(LATENT.layers * layer)


def test_latent_attention_refuses_other_modes():
    with pytest.raises(PerfsimError, match="1d tensor parallelism only"):
        _layout(LATENT, tp=4, tp_mode="2d", mbs=2)
    run = subprocess.run([sys.executable, "-m", "perfsim.cli", "predict", "--model", LATENT_SPEC, "--system",
                          "dgx-h100", "--devices", "8", "--tp", "8", "--tp-mode", "3d", "--mbs", "4", "--gbs", "8"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "1d tensor parallelism only" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
