"""Parameter and FLOP counts against SC21 eq. 2 and 3 and Megatron-DeepSpeed's `TFLOPs:` count.

Expected values are derived in this file from the published formulas
(shared/reference/published.md, sections 1 and 3), not from perfsim.cost.counts.
"""

from __future__ import annotations

import math

import pytest

import perfsim
from perfsim.cost import counts
from perfsim.spec.model import load_model

from conftest import GPT2_VOCAB, SC21_SEQ, SC21_TABLE1, SC21_VOCAB, padded_vocab

ROWS = pytest.mark.parametrize("row", SC21_TABLE1, ids=[r[0] for r in SC21_TABLE1])


def sc21_eq2_exact(l: int, h: int, V: int, s: int) -> int:
    """SC21 eq. 2 multiplied out: 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) = 12lh^2 + 13lh + (V+s)h."""
    return 12 * l * h * h + 13 * l * h + (V + s) * h


def sc21_eq3(B: int, s: int, l: int, h: int, V: int) -> float:
    """SC21 eq. 3: hardware FLOPs per iteration with full recomputation."""
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def megatron_ds_flops(gbs: int, L: int, h: int, s: int, ffn: int, V: int, checkpointing: bool) -> int:
    """Megatron-DeepSpeed's count: forward MACs per sample L(4h^2 s + 2 s^2 h + 2 ffn h s) + V h s;
    backward is 2x forward, plus another forward with checkpointing; FLOPs = 2 x MACs."""
    macs = L * (4 * h * h * s + 2 * s * s * h + 2 * ffn * h * s) + V * h * s
    passes = 4 if checkpointing else 3
    return 2 * passes * gbs * macs


def test_padded_vocab_helper_matches_known_values():
    # Megatron's padding of the GPT-2 vocabulary, as printed in its logs.
    assert padded_vocab(GPT2_VOCAB, 1) == 50304
    assert padded_vocab(GPT2_VOCAB, 8) == 51200
    assert padded_vocab(SC21_VOCAB, 8) == 51200


@ROWS
def test_preset_shapes_match_table1(row):
    name, _, heads, hidden, layers, *_ = row
    m = load_model(name)
    assert (m.heads, m.hidden, m.layers, m.seq, m.vocab) == (heads, hidden, layers, SC21_SEQ, SC21_VOCAB)
    assert m.ffn_size == 4 * hidden and m.kv_head_count == heads


@ROWS
def test_total_params_is_eq2_plus_final_layernorm(row):
    name, _, _, h, l, *_ = row
    m = load_model(name)
    total = counts.total_params(m)
    assert isinstance(total, int)
    # perfsim also counts the final LayerNorm (gamma and beta: 2h), which eq. 2 leaves out.
    assert total - 2 * h == sc21_eq2_exact(l, h, SC21_VOCAB, SC21_SEQ)
    # ... and perfsim's own transcription of eq. 2 agrees with the multiplied-out form.
    assert counts.sc21_params(l, h, SC21_VOCAB, SC21_SEQ) == pytest.approx(total - 2 * h, rel=1e-12)


@ROWS
def test_total_params_match_published_billions(row):
    name, published, *_ = row
    billions = counts.total_params(load_model(name)) / 1e9
    # Table 1 rounds to 0.1 B, which alone is more than 1% for the 1.7B and 3.6B rows
    # (1.652 B and 3.562 B): accept 1% or the rounding half-unit, whichever is larger.
    assert abs(billions - published) <= max(0.01 * published, 0.05)
    assert round(billions, 1) == pytest.approx(published)


def test_sc21_params_formula_by_hand():
    # 1.7B row by hand: 12*24*2304^2 + 13*24*2304 + (51200+2048)*2304
    assert sc21_eq2_exact(24, 2304, 51200, 2048) == 1_528_823_808 + 718_848 + 122_683_392


def _sc21_prediction(row, recompute="full"):
    name, _, _, _, _, tp, pp, gpus, batch = row
    dp = gpus // (tp * pp)
    assert dp * tp * pp == gpus
    plan = perfsim.Plan(tp=tp, pp=pp, dp=dp, mbs=1, gbs=batch, recompute=recompute)
    return perfsim.predict(name, "dgx-a100", plan)


@ROWS
def test_hardware_flops_full_recompute_is_eq3(row):
    name, _, _, h, l, _, _, _, batch = row
    pred = _sc21_prediction(row, "full")
    expected = sc21_eq3(batch, SC21_SEQ, l, h, SC21_VOCAB)
    assert pred.hardware_flops_per_step == pytest.approx(expected, rel=0.01)


@ROWS
def test_model_flops_exclude_recompute(row):
    """Model FLOPs are three passes (forward + backward) of eq. 3's four: 72 B s l h^2 (1 + s/6h + V/12lh)."""
    name, _, _, h, l, _, _, _, batch = row
    s, V = SC21_SEQ, SC21_VOCAB
    expected = 72 * batch * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))
    for recompute in ("none", "selective", "full"):
        pred = _sc21_prediction(row, recompute)
        assert pred.model_flops_per_step == pytest.approx(expected, rel=1e-9)


def test_hardware_flops_order_by_recompute():
    row = SC21_TABLE1[0]
    none, sel, full = (_sc21_prediction(row, r) for r in ("none", "selective", "full"))
    assert none.hardware_flops_per_step == pytest.approx(none.model_flops_per_step, rel=1e-12)
    assert none.hardware_flops_per_step < sel.hardware_flops_per_step < full.hardware_flops_per_step
    # selective recomputes the attention core only: 4 s^2 h per layer and sequence (QK^T and AV)
    _, _, _, h, l, _, _, _, batch = row
    extra = batch * l * 4 * SC21_SEQ**2 * h
    assert sel.hardware_flops_per_step - none.hardware_flops_per_step == pytest.approx(extra, rel=1e-9)


@ROWS
def test_flop_rates_are_flops_over_time(row):
    pred = _sc21_prediction(row)
    per_device_s = pred.step_time_s * pred.devices
    assert pred.hardware_tflops_per_device * 1e12 * per_device_s == pytest.approx(pred.hardware_flops_per_step, rel=1e-9)
    assert pred.model_tflops_per_device * 1e12 * per_device_s == pytest.approx(pred.model_flops_per_step, rel=1e-9)
    peak = 312e12  # A100 dense BF16
    assert pred.mfu == pytest.approx(pred.model_flops_per_step / per_device_s / peak, rel=1e-9)
    assert pred.hfu == pytest.approx(pred.hardware_flops_per_step / per_device_s / peak, rel=1e-9)
    assert pred.tokens_per_s == pytest.approx(row[8] * SC21_SEQ / pred.step_time_s, rel=1e-12)
    assert pred.samples_per_s == pytest.approx(row[8] / pred.step_time_s, rel=1e-12)


SMNG_PLANS = [
    # preset, layers, hidden, tp, pp, dp, zero, mbs, gbs (published.md section 1)
    ("smng-p2-3.6b", 30, 3072, 1, 1, 8, 2, 8, 64),
    ("smng-p2-20b", 44, 6144, 8, 4, 1, 1, 1, 8),
    ("smng-p2-175b", 96, 12288, 8, 16, 1, 1, 3, 300),
]


@pytest.mark.parametrize("row", SMNG_PLANS, ids=[r[0] for r in SMNG_PLANS])
@pytest.mark.parametrize("recompute", ["full", "none", "selective"])
def test_megatron_deepspeed_tflops(row, recompute):
    name, L, h, tp, pp, dp, zero, mbs, gbs = row
    plan = perfsim.Plan(tp=tp, pp=pp, dp=dp, zero=zero, mbs=mbs, gbs=gbs, recompute=recompute)
    pred = perfsim.predict(name, "smng-p2", plan)
    counted = pred.megatron_ds_tflops_per_device * pred.step_time_s * pred.devices * 1e12
    # Megatron-DeepSpeed's log counts the extra forward only with activation checkpointing (full).
    expected = megatron_ds_flops(gbs, L, h, 2048, 4 * h, padded_vocab(GPT2_VOCAB, tp), recompute == "full")
    assert counted == pytest.approx(expected, rel=1e-9)


def test_megatron_deepspeed_differs_from_hardware_count_by_vocab_padding_only():
    """For a GPT layer with full recompute both counts have 4 passes; they differ only in the logits
    (Megatron-DS counts them 4 times, perfsim 3) - a small, known difference."""
    name, L, h, tp, pp, dp, zero, mbs, gbs = SMNG_PLANS[2]
    pred = perfsim.predict(name, "smng-p2", perfsim.Plan(tp=tp, pp=pp, dp=dp, zero=zero, mbs=mbs, gbs=gbs, recompute="full"))
    V, s = padded_vocab(GPT2_VOCAB, tp), 2048
    ds = megatron_ds_flops(gbs, L, h, s, 4 * h, V, True)
    assert ds - pred.hardware_flops_per_step == pytest.approx(gbs * 2 * V * h * s, rel=1e-9)
    assert math.isclose(pred.megatron_ds_tflops_per_device, pred.hardware_tflops_per_device, rel_tol=0.02)
