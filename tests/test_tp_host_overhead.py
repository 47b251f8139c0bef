"""framework.tp_layer_overhead_s / sp_layer_overhead_s (docs/equations.md 8.1): the host time a
DTensor-style 1d layer adds, charged per layer and micro-batch, a third in forward, again with a
fully recomputed forward; nothing in the other modes, at tp = 1, or with the default 0."""

from __future__ import annotations

import dataclasses

import pytest

from perfsim.predict import predict
from perfsim.schedule.simulator import simulate
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

MODEL = load_model("layers=4,hidden=512,heads=8,seq=256,vocab=8192,tied_embeddings=false,dropout=false")
TP, SP = 0.007, 0.011  # seconds a layer and micro-batch


def with_overhead(tp=TP, sp=SP, name="cpu-calibrated"):
    system = load_system(name)
    return dataclasses.replace(system, framework=dataclasses.replace(system.framework, tp_layer_overhead_s=tp,
                                                                     sp_layer_overhead_s=sp))


@pytest.mark.parametrize("sp, per_layer", [(False, TP), (True, SP)])
@pytest.mark.parametrize("recompute, passes", [("none", 1.0), ("selective", 1.0), ("full", 4 / 3)])
def test_each_layer_and_micro_batch_pays_the_overhead_and_a_recomputed_forward_a_third_again(sp, per_layer,
                                                                                              recompute, passes):
    plan = Plan(tp=2, sp=sp, recompute=recompute, mbs=2, gbs=6)  # 3 micro-batches, one stage
    base, more = predict(MODEL, with_overhead(0.0, 0.0), plan), predict(MODEL, with_overhead(), plan)
    added = MODEL.layers * plan.microbatches * per_layer * passes
    assert more.step_time_s - base.step_time_s == pytest.approx(added, rel=1e-9)
    assert more.time_breakdown_s["compute"] - base.time_breakdown_s["compute"] == pytest.approx(
        MODEL.layers * plan.microbatches * per_layer, rel=1e-9)
    # the event simulator charges the same host time
    sim_base, sim_more = (simulate(MODEL, s, plan).result.step_time_s for s in (with_overhead(0.0, 0.0), with_overhead()))
    assert sim_more - sim_base == pytest.approx(added, rel=1e-6)


def test_a_pipeline_stage_pays_for_its_own_layers():
    plan = Plan(tp=2, pp=2, mbs=1, gbs=8)  # 8 micro-batches, 2 layers a stage
    base, more = predict(MODEL, with_overhead(0.0, 0.0), plan), predict(MODEL, with_overhead(), plan)
    # 1F1B: the step is about (m + p - 1) stage slots, each slot one stage's micro-batch
    per_stage = MODEL.layers / 2 * TP
    assert more.step_time_s - base.step_time_s == pytest.approx((plan.microbatches + 1) * per_stage, rel=0.02)


@pytest.mark.parametrize("plan", [Plan(tp=1, dp=2, mbs=2, gbs=4), Plan(tp=4, tp_mode="2d", mbs=2, gbs=2),
                                  Plan(pp=2, mbs=2, gbs=8)])
def test_other_modes_and_tp_1_pay_nothing(plan):
    assert predict(MODEL, with_overhead(), plan).step_time_s == predict(MODEL, with_overhead(0.0, 0.0), plan).step_time_s


@pytest.mark.parametrize("name", ["smng-p2", "dgx-h100", "dgx-a100", "v100-tacc", "cpu-example"])
def test_megatron_profiles_charge_none(name):
    framework = load_system(name).framework
    assert framework.tp_layer_overhead_s == 0.0 and framework.sp_layer_overhead_s == 0.0
