"""What a step on many GPUs adds to one GPU's kernel rates, as named terms (docs/equations.md 6.5,
8.4-8.6): SMs held by overlapped communication (cost/contention.py), the SM-bound kernels' rate in a
multi-GPU job (cost/clocks.py), dropout inside the fused attention kernel (cost/attention_dropout.py)
and Megatron-Core's passes over the gradient buffer (cost/grad_passes.py). Each is counted here by
hand against a profile without the terms, in the closed form and in the event simulator; a profile
that leaves the keys out predicts what it did before they existed."""

from __future__ import annotations

import dataclasses

import pytest

from perfsim import cli
from perfsim.calibrate.overheads import as_trained
from perfsim.cost.clocks import clocked_work
from perfsim.cost.columns import columns_of
from perfsim.cost.contention import overlap_efficiency, sm_share
from perfsim.cost.layer import Gemm, MemoryOp, flash_attention_times, gemm_pass_times, memory_times
from perfsim.cost.stage import stage_costs
from perfsim.predict import predict
from perfsim.schedule.simulator import predict_simulated
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import for_dtype, load_system

from profile_toml import AT_SCALE_KEYS, without_at_scale_terms

H100 = load_system("dgx-h100")
BARE = without_at_scale_terms(H100)
MODEL = load_model("layers=8,hidden=2048,heads=16,seq=2048,vocab=32000")
PLANS = [Plan(dp=8, zero=0, mbs=1, gbs=16, dp_overlap=True),
         Plan(pp=2, dp=4, zero=1, mbs=1, gbs=16, dp_overlap=True, attention="flash"),
         Plan(tp=4, sp=True, dp=2, mbs=1, gbs=4, tp_overlap=True),
         Plan(tp=2, cp=4, sp=True, mbs=1, gbs=2, attention="flash"),
         Plan(mbs=2, gbs=4, attention="flash")]


def with_terms(system=BARE, **values):
    """`system` with the named at-scale keys given (device or framework, by name)."""
    device = {k: v for k, v in values.items() if k in AT_SCALE_KEYS["device"]}
    framework = {k: v for k, v in values.items() if k in AT_SCALE_KEYS["framework"]}
    assert len(device) + len(framework) == len(values)
    return dataclasses.replace(system, device=dataclasses.replace(system.device, **device),
                               framework=dataclasses.replace(system.framework, **framework))


NEUTRAL = dict(sm_count=132, tp_comm_sms=0.0, dp_comm_sms=0.0, cp_comm_sms=0.0, sustained_clock_ratio=1.0,
               unattributed_at_scale_ratio=1.0, flash_dropout_forward_ratio=1.0, flash_dropout_backward_ratio=1.0,
               grad_buffer_pass_bytes_per_param=0.0)


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_neutral_values_and_left_out_keys_predict_the_same_to_the_bit(plan):
    for engine in (predict, predict_simulated):
        a, b = engine(MODEL, BARE, plan), engine(MODEL, with_terms(**NEUTRAL), plan)
        assert a.step_time_s == b.step_time_s and a.time_breakdown_s == b.time_breakdown_s


def test_the_profiles_name_every_term_with_a_source_and_the_unmeasured_ones_with_a_range():
    for name in ("dgx-h100", "dgx-h200", "dgx-b200"):
        system = load_system(name)
        for section, keys in AT_SCALE_KEYS.items():
            for key in keys:
                provenance, source = system.provenance[f"{section}.{key}"]
                assert len(source) > 40, (name, key)
                if key not in ("sm_count", "grad_buffer_pass_bytes_per_param"):  # counts read off hardware, code
                    assert f"{section}.{key}" in system.ranges, (name, key)  # how sure, stated
    h200 = load_system("dgx-h200")
    assert h200.device.peak_flops_bf16 == H100.device.peak_flops_bf16 and h200.device.sm_count == 132
    assert h200.device.memory_bandwidth_Bps == 4.8e12 and h200.device.memory_bytes == 150_109_880_320  # the ledger's
    for key in ("device.gemm_efficiency", "device.gemm_half_dim", "device.kernel_overhead_s",
                "device.memory_efficiency", "framework.step_overhead_s"):
        provenance, source = h200.provenance[key]
        assert provenance == "measured" and "h200-2026-11" in source, key


# ---- SMs held by overlapped communication (cost/contention.py, docs/equations.md 8.4)

def test_each_kind_hides_its_eta_less_its_sm_share():
    system = with_terms(sm_count=132, tp_comm_sms=8.0, dp_comm_sms=16.0, cp_comm_sms=33.0)
    assert overlap_efficiency(system, "tp") == pytest.approx(1 - 8 / 132)
    assert sm_share(system, "cp") == pytest.approx(0.25)
    eta = dataclasses.replace(system, collectives=dataclasses.replace(system.collectives, overlap_efficiency=0.9))
    assert overlap_efficiency(eta, "dp") == pytest.approx(0.9 * (1 - 16 / 132))
    assert overlap_efficiency(BARE, "dp") == 1.0  # no SM keys: the profile's eta as it is


def test_tensor_parallel_chunks_pay_the_sm_share_of_what_they_hide():
    """An SM share f is eta = 1 - f for the tensor-parallel chunks alone: compute slowed by f for
    the time the chunks run beside it (docs/equations.md 6.1, 8.4)."""
    plan = PLANS[2]
    f = 8 / 132
    contended = stage_costs(MODEL, with_terms(sm_count=132, tp_comm_sms=8.0), columns_of(plan), 989e12).middle
    eta = dataclasses.replace(BARE, collectives=dataclasses.replace(BARE.collectives, overlap_efficiency=1 - f))
    by_eta = stage_costs(MODEL, eta, columns_of(plan), 989e12).middle
    bare = stage_costs(MODEL, BARE, columns_of(plan), 989e12).middle
    assert float(contended.tp_comm) == pytest.approx(float(by_eta.tp_comm), rel=1e-12)
    plain = stage_costs(MODEL, BARE, columns_of(plan.replace(tp_overlap=False)), 989e12).middle
    hidden = float(plain.tp_comm - bare.tp_comm)
    assert float(contended.tp_comm - bare.tp_comm) == pytest.approx(f * hidden, rel=1e-9)


def test_data_parallel_buckets_pay_the_sm_share_in_both_engines():
    """One stage, ZeRO-0 with dp_overlap: the reduction's and gather's hidden parts come back f
    times; the simulator charges each bucket over its own pass's window, within a few per cent."""
    plan, f = PLANS[0], 16 / 132
    system = with_terms(sm_count=132, dp_comm_sms=16.0)
    base = predict(MODEL, BARE, plan)
    hidden = predict(MODEL, BARE, plan.replace(dp_overlap=False)).time_breakdown_s["dp_comm"] \
        - base.time_breakdown_s["dp_comm"]
    closed = predict(MODEL, system, plan)
    assert closed.step_time_s - base.step_time_s == pytest.approx(f * hidden, rel=1e-9)
    simulated = predict_simulated(MODEL, system, plan).step_time_s - predict_simulated(MODEL, BARE, plan).step_time_s
    assert simulated == pytest.approx(f * hidden, rel=0.05)


def test_the_ring_pays_the_context_parallel_sm_share():
    plan = PLANS[3]
    system = with_terms(sm_count=132, cp_comm_sms=16.0)
    eta = dataclasses.replace(BARE, collectives=dataclasses.replace(BARE.collectives, overlap_efficiency=1 - 16 / 132))
    assert predict(MODEL, system, plan).time_breakdown_s["cp_comm"] == pytest.approx(
        predict(MODEL, eta, plan).time_breakdown_s["cp_comm"], rel=1e-12)
    assert predict_simulated(MODEL, system, plan).step_time_s == pytest.approx(
        predict(MODEL, system, plan).step_time_s, rel=1e-9)


# ---- the SM-bound kernels' rate in a multi-GPU job (cost/clocks.py, 8.5)

def test_the_clock_stretches_gemms_and_fused_attention_not_element_wise_kernels():
    device = for_dtype(BARE, "bf16").device
    gemm, norm = Gemm("fc1", 1, 4096, 8192, 2048), MemoryOp("norm1", 4 * 4096 * 2048, "layernorm")
    scores = Gemm("scores", 32, 2048, 2048, 128)
    ratio = 0.75
    got = clocked_work(ratio, device, 989e12, [gemm, Gemm("context", 32, 2048, 128, 2048), scores], [norm], flash=1)
    flash_forward, flash_backward, _, _ = flash_attention_times(device, 989e12, scores)
    norm_forward, norm_backward = memory_times(device, norm)
    g, _, first, second, _ = (float(x) for x in gemm_pass_times(device, 989e12, gemm))  # the table's shapes
    assert float(got.time_s) == pytest.approx((g + float(flash_forward)) / ratio + float(norm_forward), rel=1e-12)
    assert float(got.backward_s) == pytest.approx((first + second + float(flash_backward)) / ratio
                                                  + float(norm_backward), rel=1e-12)
    assert float(got.core_time_s) == pytest.approx(float(flash_forward) / ratio, rel=1e-12)


@pytest.mark.parametrize("plan", [PLANS[2], PLANS[4]], ids=str)
def test_the_clock_prices_plans_of_more_than_one_gpu_only_in_both_engines(plan):
    system = with_terms(sustained_clock_ratio=0.9, unattributed_at_scale_ratio=0.8)
    for engine in (predict, predict_simulated):
        slow, base = engine(MODEL, system, plan), engine(MODEL, BARE, plan)
        if plan.devices == 1:  # the kernel rates' own conditions
            assert slow.step_time_s == base.step_time_s
        else:
            assert slow.time_breakdown_s["compute"] > base.time_breakdown_s["compute"] / 0.9 > \
                base.time_breakdown_s["compute"]
            assert slow.time_breakdown_s["compute"] < base.time_breakdown_s["compute"] / 0.72
    assert predict_simulated(MODEL, system, plan).step_time_s == pytest.approx(
        predict(MODEL, system, plan).step_time_s, rel=1e-9)


# ---- dropout inside the fused attention kernel (cost/attention_dropout.py, 8.6)

def test_dropout_slows_the_fused_kernel_by_its_ratios_forward_and_backward():
    plan = Plan(tp=2, mbs=2, gbs=2, attention="flash")
    system = with_terms(flash_dropout_forward_ratio=0.8, flash_dropout_backward_ratio=0.5)
    c = columns_of(plan)
    layout_scores = Gemm("scores", 2 * MODEL.heads / 2, MODEL.seq, MODEL.seq, MODEL.head_dim)
    forward, backward, _, _ = flash_attention_times(system.device, 989e12, layout_scores)
    with_dropout = stage_costs(MODEL, system, c, 989e12).middle
    without = stage_costs(MODEL, BARE, c, 989e12).middle
    layers = MODEL.layers
    assert float(with_dropout.forward_compute - without.forward_compute) == pytest.approx(
        layers * float(forward) * (1 / 0.8 - 1), rel=1e-9)
    assert float(with_dropout.compute - without.compute) == pytest.approx(
        layers * (float(forward) * (1 / 0.8 - 1) + float(backward) * (1 / 0.5 - 1)), rel=1e-9)
    # selective recomputation repeats the fused forward, its dropout included
    selective = columns_of(plan.replace(recompute="selective"))
    assert float(stage_costs(MODEL, system, selective, 989e12).middle.recompute) == pytest.approx(
        layers * float(forward) / 0.8, rel=1e-9)
    # no dropout in the model, or the unfused core (its dropout an element-wise op): nothing
    quiet = load_model("layers=8,hidden=2048,heads=16,seq=2048,vocab=32000,dropout=false")
    for model, p in ((quiet, plan), (MODEL, plan.replace(attention="unfused"))):
        assert predict(model, system, p).step_time_s == predict(model, BARE, p).step_time_s


# ---- Megatron-Core's passes over the gradient buffer (cost/grad_passes.py, 6.5)

@pytest.mark.parametrize("plan", [PLANS[0], PLANS[1]], ids=str)
def test_gradient_buffer_passes_join_the_optimizer_step_in_both_engines(plan):
    system = with_terms(grad_buffer_pass_bytes_per_param=12.0)
    device = system.device
    base, passes = predict(MODEL, BARE, plan), predict(MODEL, system, plan)
    costs = stage_costs(MODEL, BARE, columns_of(plan), 989e12)
    params = max(float(costs.params_first), float(costs.params_last))  # the stage with the most
    want = params * 12 / (device.memory_bandwidth_Bps * device.memory_efficiency) + 2 * device.kernel_overhead_s
    assert passes.time_breakdown_s["optimizer"] - base.time_breakdown_s["optimizer"] == pytest.approx(want, rel=1e-9)
    simulated = predict_simulated(MODEL, system, plan).step_time_s - predict_simulated(MODEL, BARE, plan).step_time_s
    assert simulated == pytest.approx(want, rel=1e-6)
    # the harness's own optimizer does no such passes (perfsim validate prices it with as_trained)
    assert as_trained(system, "bf16", "cuda").framework.grad_buffer_pass_bytes_per_param is None


def test_draws_over_the_terms_ranges_price_without_error(capsys):
    """--uncertainty draws every term per draw (numpy arrays through contention, clocks, dropout
    and the passes): the run completes and its spread contains the point prediction."""
    import json

    assert cli.main(["predict", "--system", "dgx-h100", "--model", "gpt3-1.3b", "--devices", "16", "--tp", "2",
                     "--sp", "--gbs", "32", "--uncertainty", "--samples", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    spread = out["uncertainty"]["step_time_s"]
    assert spread["p10"] < spread["p90"]
