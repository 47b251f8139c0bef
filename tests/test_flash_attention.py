"""Fused (flash) attention, plan field `attention` (docs/equations.md 3.9 and 7.2), against hand counts.

What a fused causal kernel changes, derived here from the algorithm (Dao et al. 2022; Shah et al.
2024), not from perfsim's code:
- time: the kernel executes half of the s x s products (causal blocks above the diagonal are
  skipped): forward 1/2 x 4 b a s^2 d / t FLOPs; backward recomputes the scores and runs four more
  products, 5/2 x the forward's; the softmax and the attention dropout never reach device memory;
- memory: no s x s tensor is kept for backward, one fp32 log-sum-exp per query row and head instead;
- FLOPs: model FLOPs unchanged (the convention counts the full square); hardware FLOPs gain one
  scores product per layer (the backward's recomputation).
"""

from __future__ import annotations

import dataclasses

import pytest

from perfsim.cost.columns import columns_of
from perfsim.cost.layer import gemm_efficiency, kind_bytes, memory_times, MemoryOp
from perfsim.cost.memory import layer_activation_bytes
from perfsim.cost.stage import stage_costs
from perfsim.predict import predict
from perfsim.schedule.simulator import predict_simulated
from perfsim.spec.model import ModelSpec, load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

from profile_toml import without_at_scale_terms

NONE, SELECTIVE, FULL = 0, 1, 2
GPT = ModelSpec(name="gpt", layers=8, hidden=2048, heads=16, seq=4096, vocab=50257)


def with_flash(system, forward=None, backward=None):
    return dataclasses.replace(system, device=dataclasses.replace(
        system.device, flash_forward_efficiency=forward, flash_backward_efficiency=backward))


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (4, True), (8, True)])
@pytest.mark.parametrize("b", [1, 3])
def test_activations_keep_no_score_matrix_only_the_log_sum_exp(t, sp, b):
    """Korthikanti's per-layer bytes without the 5as/h score terms, plus 4 a s b / t (fp32 LSE):
    sbh(10 + 24/t) + 4asb/t without SP, 34 sbh/t + 4asb/t with SP; selective recomputation
    checkpoints the whole kernel and drops the LSE too (Korthikanti's selective figure); full
    recomputation keeps the layer input as before."""
    s, h, a = GPT.seq, GPT.hidden, GPT.heads
    sbh = s * b * h
    unfused_selective = 34 * sbh / t if sp else sbh * (10 + 24 / t)
    lse = 4 * a * s * b / t
    assert float(layer_activation_bytes_flash(b, t, sp, NONE)) == pytest.approx(unfused_selective + lse, rel=1e-12)
    assert float(layer_activation_bytes_flash(b, t, sp, SELECTIVE)) == pytest.approx(unfused_selective, rel=1e-12)
    assert float(layer_activation_bytes_flash(b, t, sp, FULL)) == pytest.approx(2 * sbh / (t if sp else 1))


def layer_activation_bytes_flash(b, t, sp, recompute):
    from perfsim.cost.memory import activation_bytes

    return activation_bytes(GPT, b, t, t if sp else 1, recompute, flash=1)


@pytest.mark.parametrize("efficiencies", [(0.6, 0.5), (0.3, None), (None, None)])
@pytest.mark.parametrize("t", [1, 4])
def test_layer_time_swaps_the_core_for_the_fused_kernel(efficiencies, t):
    """Flash minus unfused layer time, forward and backward, equals the fused kernel's hand-counted
    time less the two core GEMMs, the softmax and the attention dropout."""
    fwd_eff, bwd_eff = efficiencies
    # the kernels alone: dgx-h100's at-scale terms (dropout inside the kernel, the clock of a
    # multi-GPU plan; docs/equations.md 8.5-8.6) are counted in tests/test_at_scale_terms.py
    system = with_flash(without_at_scale_terms(load_system("dgx-h100")), fwd_eff, bwd_eff)
    dev, peak = system.device, system.device.peak_flops_bf16
    b, s, a, d = 2, GPT.seq, GPT.heads, GPT.head_dim
    plan = Plan(tp=t, dp=1, mbs=b, gbs=b)
    unfused = stage_costs(GPT, system, columns_of(plan), peak).middle
    flash = stage_costs(GPT, system, columns_of(plan.replace(attention="flash")), peak).middle

    heads = b * a / t
    executed = 0.5 * 4 * heads * s * s * d  # causal half of scores + context
    shape = gemm_efficiency(dev, s, s, d)
    f_eff = fwd_eff or shape
    b_eff = bwd_eff or f_eff
    kernel_fwd = executed / (peak * f_eff) + dev.kernel_overhead_s
    kernel_bwd = 2.5 * executed / (peak * b_eff) + dev.kernel_overhead_s

    def gemm(m, n, k):  # the roofline of perfsim's GEMM model, written out
        compute = 2 * heads * m * n * k / (peak * gemm_efficiency(dev, m, n, k))
        memory = 2 * heads * (m * k + k * n + m * n) / (dev.memory_bandwidth_Bps * dev.memory_efficiency)
        return max(compute, memory) + dev.kernel_overhead_s
    core_gemms = gemm(s, s, d) + gemm(s, d, s)
    scores = b * a * s * s / t
    softmax = memory_times(dev, MemoryOp("softmax", kind_bytes("softmax") * scores, "softmax"))
    dropout = memory_times(dev, MemoryOp("attn_dropout", kind_bytes("dropout") * scores, "dropout"))
    core_fwd = core_gemms + softmax[0] + dropout[0]
    core_bwd = 2 * core_gemms + softmax[1] + dropout[1]
    layers = GPT.layers
    assert float(flash.forward_compute - unfused.forward_compute) == pytest.approx(
        layers * (kernel_fwd - core_fwd), rel=1e-9)
    backward_change = float((flash.compute - flash.forward_compute) - (unfused.compute - unfused.forward_compute))
    assert backward_change == pytest.approx(layers * (kernel_bwd - core_bwd), rel=1e-9)
    assert float(flash.weight_grad) == pytest.approx(float(unfused.weight_grad), rel=1e-12)


def test_selective_recomputation_repeats_the_fused_forward():
    system = with_flash(without_at_scale_terms(load_system("dgx-h100")), 0.6, 0.5)
    peak = system.device.peak_flops_bf16
    plan = Plan(tp=2, dp=1, mbs=1, gbs=1, attention="flash")
    none = stage_costs(GPT, system, columns_of(plan), peak).middle
    selective = stage_costs(GPT, system, columns_of(plan.replace(recompute="selective")), peak).middle
    executed = 0.5 * 4 * (GPT.heads / 2) * GPT.seq**2 * GPT.head_dim
    kernel_fwd = executed / (peak * 0.6) + system.device.kernel_overhead_s
    assert float(selective.recompute) == pytest.approx(GPT.layers * kernel_fwd, rel=1e-9)
    assert float(none.recompute) == 0.0


def test_hardware_flops_count_the_backward_recomputation_of_the_scores():
    """Per sample, flash adds one scores product per layer: 2 s^2 h x layers (the full square)."""
    model = load_model("gpt3-1.3b")
    plan = Plan(dp=8, mbs=1, gbs=16)
    for recompute in ("none", "selective", "full"):
        unfused = predict(model, "dgx-h100", plan.replace(recompute=recompute))
        flash = predict(model, "dgx-h100", plan.replace(recompute=recompute, attention="flash"))
        assert flash.model_flops_per_step == unfused.model_flops_per_step
        extra = 16 * model.layers * 2 * model.seq**2 * model.hidden
        assert flash.hardware_flops_per_step - unfused.hardware_flops_per_step == pytest.approx(extra, rel=1e-12)


@pytest.mark.parametrize("plan", [Plan(pp=4, mbs=1, gbs=8, dp=2, attention="flash"),
                                  Plan(tp=4, sp=True, pp=2, vpp=2, schedule="interleaved", mbs=1, gbs=8,
                                       attention="flash", recompute="selective")])
def test_both_engines_price_the_fused_kernel_alike(plan):
    """The simulator reads the same stage costs: with uniform stages and no link sharing the two
    engines agree on flash plans as on unfused ones (their gap is the same)."""
    model = load_model("layers=8,hidden=1024,heads=16,seq=2048,vocab=32000")
    gaps = []
    for attention in ("unfused", "flash"):
        p = plan.replace(attention=attention)
        closed = predict(model, "dgx-h100", p)
        simulated = predict_simulated(model, load_system("dgx-h100"), p)
        gaps.append(simulated.step_time_s / closed.step_time_s)
    assert gaps[1] == pytest.approx(gaps[0], abs=0.02)


def test_a_long_sequence_fits_only_with_the_fused_kernel():
    """At 32k tokens a 7B-class layer's s x s scores alone need a s^2 a b x 5 bytes: flash fits
    where unfused cannot."""
    model = load_model("layers=32,hidden=4096,heads=32,seq=32768,vocab=32000")
    plan = Plan(tp=8, sp=True, pp=4, mbs=1, gbs=8, dp=1, recompute="none")
    assert not predict(model, "dgx-h100", plan).fits
    assert predict(model, "dgx-h100", plan.replace(attention="flash")).fits
