"""Properties that hold for every valid plan (hypothesis): faster hardware never slows a step down,
the time breakdown adds up, higher ZeRO stages never use more memory, nothing is negative."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import perfsim
from perfsim.spec.model import load_model
from perfsim.spec.plan import plan_problems
from perfsim.spec.system import load_system

PRESETS = ("sc21-1.7b", "gpt3-1.3b", "llama2-7b")
SYSTEMS = ("dgx-a100", "smng-p2")
MODELS = {name: load_model(name) for name in PRESETS}
SYS = {name: load_system(name) for name in SYSTEMS}

TIME_KEYS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "pp_bubble", "dp_comm", "optimizer", "other",
             "synchrony")
MEMORY_KEYS = ("weights", "gradients", "optimizer", "activations", "buffers", "total")

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, limit + 1) if n % d == 0]


@st.composite
def cases(draw, zero=None):
    """(model, system, plan): a random plan that is valid by construction."""
    model = MODELS[draw(st.sampled_from(PRESETS))]
    system = SYS[draw(st.sampled_from(SYSTEMS))]
    tps = [t for t in _divisors(model.heads, 8) if model.kv_head_count % t == 0 and model.ffn_size % t == 0]
    tp = draw(st.sampled_from(tps))
    pp = draw(st.sampled_from(_divisors(model.layers, 8)))
    dp = draw(st.integers(1, 8))
    mbs = draw(st.integers(1, 4))
    schedules = ["1f1b", "gpipe"]
    vpps = [v for v in (2, 3, 4) if model.layers % (pp * v) == 0]
    if pp > 1 and vpps:
        schedules.append("interleaved")
    schedule = draw(st.sampled_from(schedules))
    if schedule == "interleaved":
        vpp = draw(st.sampled_from(vpps))
        m = pp * draw(st.integers(1, 3))
    else:
        vpp = 1
        m = draw(st.integers(1, 12))
    sp = draw(st.booleans()) if tp > 1 and model.seq % tp == 0 else False
    plan = perfsim.Plan(
        tp=tp, pp=pp, dp=dp, vpp=vpp, schedule=schedule, sp=sp, mbs=mbs, gbs=mbs * dp * m,
        zero=draw(st.sampled_from((0, 1, 2, 3))) if zero is None else zero,
        recompute=draw(st.sampled_from(("none", "selective", "full"))),
        order=draw(st.sampled_from(("tp-dp-pp", "tp-pp-dp"))),
    )
    assert plan_problems(plan, model, plan.devices) == [], plan
    assert plan.microbatches == m
    return model, system, plan


def _faster(system, knob: str, factor: float):
    """`system` with one hardware rate multiplied by `factor`."""
    r = dataclasses.replace
    if knob == "peak_flops":
        d = system.device
        return r(system, device=r(d, peak_flops_bf16=d.peak_flops_bf16 * factor,
                                  peak_flops_fp16=d.peak_flops_fp16 * factor,
                                  peak_flops_fp32=d.peak_flops_fp32 * factor))
    if knob == "memory_bandwidth":
        return r(system, device=r(system.device, memory_bandwidth_Bps=system.device.memory_bandwidth_Bps * factor))
    if knob in ("card_link", "node_link"):
        field = f"{knob}_bandwidth_Bps"
        return r(system, node=r(system.node, **{field: getattr(system.node, field) * factor}))
    if knob == "nic":
        return r(system, network=r(system.network, nic_bandwidth_Bps=system.network.nic_bandwidth_Bps * factor))
    if knob == "all_links":
        n = system.node
        system = r(system, node=r(n, card_link_bandwidth_Bps=n.card_link_bandwidth_Bps * factor,
                                  node_link_bandwidth_Bps=n.node_link_bandwidth_Bps * factor))
        return r(system, network=r(system.network, nic_bandwidth_Bps=system.network.nic_bandwidth_Bps * factor))
    raise AssertionError(knob)


KNOBS = ("peak_flops", "memory_bandwidth", "card_link", "node_link", "nic", "all_links")


def test_faster_helper_changes_exactly_one_rate():
    base = SYS["smng-p2"]
    fast = _faster(base, "nic", 2.0)
    assert fast.network.nic_bandwidth_Bps == 2 * base.network.nic_bandwidth_Bps
    assert fast.device == base.device and fast.node == base.node
    assert base.network.nic_bandwidth_Bps == 25e9  # the original is untouched (frozen)


@pytest.mark.parametrize("knob", KNOBS)
@SETTINGS
@given(case=cases(), factor=st.floats(min_value=1.0, max_value=64.0, allow_nan=False))
def test_faster_hardware_never_slower(knob, case, factor):
    model, system, plan = case
    before = perfsim.predict(model, system, plan).step_time_s
    after = perfsim.predict(model, _faster(system, knob, factor), plan).step_time_s
    assert after <= before * (1 + 1e-12), (knob, factor, plan, before, after)


def test_faster_compute_is_strictly_faster_somewhere():
    """Not vacuous: doubling the peak does shorten a compute-bound step."""
    plan = perfsim.Plan(tp=1, pp=1, dp=1, mbs=4, gbs=32, recompute="full")
    base = SYS["dgx-a100"]
    before = perfsim.predict(MODELS["gpt3-1.3b"], base, plan).step_time_s
    after = perfsim.predict(MODELS["gpt3-1.3b"], _faster(base, "peak_flops", 2.0), plan).step_time_s
    assert after < 0.9 * before


@SETTINGS
@given(case=cases())
def test_breakdown_adds_up_and_is_nonnegative(case):
    model, system, plan = case
    pred = perfsim.predict(model, system, plan)
    assert set(pred.time_breakdown_s) == set(TIME_KEYS)
    # >= 0 up to rounding: a pp = 1 bubble comes out as (m-1)T + T - mT, e.g. -8.9e-16 s
    # (exact zero is test_no_pipeline_no_bubble_exactly).
    tiny = 1e-12 * pred.step_time_s
    assert all(math.isfinite(v) and v >= -tiny for v in pred.time_breakdown_s.values()), pred.time_breakdown_s
    assert sum(pred.time_breakdown_s.values()) == pytest.approx(pred.step_time_s, rel=1e-9)
    assert pred.step_time_s > 0
    assert set(pred.memory_bytes) == set(MEMORY_KEYS)
    assert all(math.isfinite(v) and v >= 0 for v in pred.memory_bytes.values()), pred.memory_bytes
    parts = sum(pred.memory_bytes[k] for k in MEMORY_KEYS if k != "total")
    assert pred.memory_bytes["total"] == pytest.approx(parts, rel=1e-9)
    assert pred.fits == (pred.memory_bytes["total"] <= system.device.memory_bytes)
    assert pred.devices == plan.tp * plan.pp * plan.dp
    # nothing to pipeline without pipeline parallelism, nothing to reduce without data parallelism
    if plan.pp == 1:
        assert abs(pred.time_breakdown_s["pp_bubble"]) <= tiny and pred.time_breakdown_s["pp_comm"] == 0
    if plan.tp == 1:
        assert pred.time_breakdown_s["tp_comm"] == 0
    if plan.dp == 1:
        assert pred.time_breakdown_s["dp_comm"] == 0
    if plan.recompute == "none":
        assert pred.time_breakdown_s["recompute"] == 0


def _zero_totals(model, system, plan, stages):
    return [perfsim.predict(model, system, plan.replace(zero=z)).memory_bytes["total"] for z in stages]


def _non_increasing(totals, plan):
    for lower, higher in zip(totals, totals[1:]):
        assert higher <= lower * (1 + 1e-12), (plan, totals)


@SETTINGS
@given(case=cases(zero=0))
def test_zero_0_1_2_never_uses_more_memory(case):
    """Sharding optimizer states (ZeRO-1) and gradients (ZeRO-2) only ever removes bytes."""
    model, system, plan = case
    _non_increasing(_zero_totals(model, system, plan, (0, 1, 2)), plan)


@SETTINGS
@given(case=cases(zero=0))
def test_zero_0_to_3_never_uses_more_memory_when_weights_are_sharded(case):
    """ZeRO-3 also shards the bf16 weights, but gathers a layer at a time and prefetches the next:
    two gathered layers of bf16 weights are extra. Once the dp-way sharding saves at least that
    (dp >= 2 and at least 4 layers on the stage: (1 - 1/dp) x 4 layers >= 2 layers), ZeRO-3 must not
    use more memory than ZeRO-2. (With dp = 1 it shards nothing and the buffers are pure cost, so
    0 -> 3 may rise there; see test_zero3_with_one_replica_shards_nothing.)"""
    model, system, plan = case
    assume(plan.dp >= 2 and model.layers // plan.pp >= 4)
    _non_increasing(_zero_totals(model, system, plan, (0, 1, 2, 3)), plan)


def test_zero3_with_one_replica_shards_nothing():
    model, system = MODELS["gpt3-1.3b"], SYS["dgx-a100"]
    plan = perfsim.Plan(tp=2, pp=2, dp=1, mbs=1, gbs=4)
    mem = {z: perfsim.predict(model, system, plan.replace(zero=z)).memory_bytes for z in (0, 3)}
    for key in ("weights", "gradients", "optimizer", "activations"):
        assert mem[3][key] == pytest.approx(mem[0][key], rel=1e-12)


@SETTINGS
@given(case=cases(zero=0))
def test_zero_shards_model_states_by_dp(case):
    """ZeRO-1 divides optimizer states by dp, ZeRO-2 also gradients, ZeRO-3 also weights.
    (Compared on the same pipeline stage: the peak may move between first and last stage.)"""
    model, system, plan = case
    preds = {z: perfsim.predict(model, system, plan.replace(zero=z)) for z in (0, 1, 2, 3)}
    base, dp = preds[0].memory_bytes, plan.dp
    # mixed-precision Adam: 12 bytes of optimizer state per 2 bytes of bf16 weight
    assert base["optimizer"] == pytest.approx(6 * base["weights"], rel=1e-9)
    sharded = {1: {"optimizer"}, 2: {"optimizer", "gradients"}, 3: {"optimizer", "gradients", "weights"}}
    for z in (1, 2, 3):
        if preds[z].memory_peak_stage != preds[0].memory_peak_stage:
            continue
        mem = preds[z].memory_bytes
        for key in ("weights", "gradients", "optimizer"):
            expected = base[key] / dp if key in sharded[z] else base[key]
            assert mem[key] == pytest.approx(expected, rel=1e-9), (z, key, plan)
        assert mem["activations"] == pytest.approx(base["activations"], rel=1e-9)


def test_zero_sharding_fixed_example():
    """A deterministic instance of the above (pp = 1, so there is one stage)."""
    model, system = MODELS["gpt3-1.3b"], SYS["smng-p2"]
    plan = perfsim.Plan(tp=2, pp=1, dp=4, mbs=2, gbs=16, recompute="full")
    mem = {z: perfsim.predict(model, system, plan.replace(zero=z)).memory_bytes for z in (0, 1, 2, 3)}
    assert mem[1]["optimizer"] == pytest.approx(mem[0]["optimizer"] / 4, rel=1e-12)
    assert mem[2]["gradients"] == pytest.approx(mem[0]["gradients"] / 4, rel=1e-12)
    assert mem[3]["weights"] == pytest.approx(mem[0]["weights"] / 4, rel=1e-12)
    assert mem[0]["total"] > mem[1]["total"] > mem[2]["total"] > mem[3]["total"]


def _pp1_grid():
    out = []
    for name in ("sc21-1.7b", "gpt3-1.3b"):
        for tp in (1, 2, 4):
            for mbs in (1, 2, 4):
                for m in (1, 3, 7):
                    for recompute in ("none", "full"):
                        out.append((name, perfsim.Plan(tp=tp, dp=2, mbs=mbs, gbs=2 * mbs * m, recompute=recompute)))
    return out


def test_no_pipeline_no_bubble_exactly():
    system = SYS["dgx-a100"]
    bubbles = [perfsim.predict(MODELS[name], system, plan).time_breakdown_s["pp_bubble"] for name, plan in _pp1_grid()]
    assert all(b == 0.0 for b in bubbles), sorted(bubbles)[:3]
