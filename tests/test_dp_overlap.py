"""Overlapped data-parallel communication, plan field `dp_overlap` (docs/equations.md 6.1 and 9.2).

Megatron-Core's --overlap-grad-reduce / --overlap-param-gather: the gradients are reduced bucket by
bucket (perfsim: one bucket per layer of the stage) behind the last backward pass, the weights
gathered bucket by bucket ahead of the next forward. Hand count of the exposure with n buckets of
C/n seconds released every W/n seconds, reduced one after another: the last ends at W + C/n when
C/n <= W/n, else at W/n + C.
"""

from __future__ import annotations

import dataclasses

import pytest

from perfsim.cost.columns import columns_of
from perfsim.cost.stage import stage_costs
from perfsim.cost.topology import TopologyCommModel
from perfsim.cost.data_parallel import step_reduction_time
from perfsim.errors import PerfsimError
from perfsim.predict import predict
from perfsim.schedule.simulator import predict_simulated
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan, canonical
from perfsim.spec._toml import read_toml
from perfsim.spec.system import for_dtype, load_system, parse_system

from conftest import pieces_exposed as exposed
from profile_toml import without_at_scale_terms

MODEL = load_model("layers=8,hidden=2048,heads=16,seq=2048,vocab=32000")


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("system", ["dgx-h100", "smng-p2"])
def test_closed_form_hides_the_reduction_behind_the_last_backward_and_the_gather_ahead_of_the_forward(zero, system):
    # buckets and windows alone: the SMs NCCL holds beside the compute (dgx-h100's at-scale terms,
    # docs/equations.md 8.4) are counted in tests/test_at_scale_terms.py
    # (at the dtype predict prices, so that its measured tables apply to the hand count's stages too)
    s = for_dtype(without_at_scale_terms(load_system(system)), "bf16")
    plan = Plan(tp=2, pp=2, dp=8, zero=zero, mbs=1, gbs=32)
    off, on = predict(MODEL, s, plan), predict(MODEL, s, plan.replace(dp_overlap=True))
    c = columns_of(plan)
    stages = stage_costs(MODEL, s, c, s.device.peak_flops_bf16)
    slow = stages.last if stages.last.total > stages.first.total else stages.first
    params = max(float(stages.params_first), float(stages.params_last))
    reduction, gather = (float(x) for x in step_reduction_time(s, TopologyCommModel(s), c, params))
    n = MODEL.layers // 2
    want = exposed(reduction, float(slow.backward), n) + exposed(gather, float(slow.forward_compute + slow.forward_tp), n)
    assert on.time_breakdown_s["dp_comm"] == pytest.approx(want, rel=1e-9)
    assert off.time_breakdown_s["dp_comm"] == pytest.approx(reduction + gather, rel=1e-9)
    assert on.step_time_s < off.step_time_s
    for key in ("compute", "tp_comm", "pp_bubble", "optimizer"):
        assert on.time_breakdown_s[key] == off.time_breakdown_s[key]


@pytest.mark.parametrize("plan", [Plan(pp=4, dp=4, zero=1, mbs=1, gbs=32),
                                  Plan(tp=2, pp=2, dp=4, zero=0, mbs=1, gbs=16),
                                  Plan(pp=2, dp=4, zero=2, mbs=1, gbs=16)])
def test_the_simulation_overlaps_as_the_closed_form_does(plan):
    """Both engines take the same share of the step off with dp_overlap (the simulator places the
    reduction's buckets on the data-parallel stream during the last backward): the overlapped
    steps differ between the engines by no more than the plain ones do, plus one bucket."""
    system = load_system("dgx-h100")
    steps = {}
    for overlap in (False, True):
        p = plan.replace(dp_overlap=overlap)
        steps[overlap] = (predict(MODEL, system, p).step_time_s, predict_simulated(MODEL, system, p).step_time_s)
    closed_gain = steps[False][0] - steps[True][0]
    simulated_gain = steps[False][1] - steps[True][1]
    assert closed_gain > 0 and simulated_gain > 0
    assert simulated_gain == pytest.approx(closed_gain, rel=0.25)


def test_without_data_parallelism_the_knob_changes_nothing():
    plan = Plan(tp=2, pp=4, mbs=1, gbs=8)
    assert predict(MODEL, "dgx-h100", plan).step_time_s == predict(MODEL, "dgx-h100", plan.replace(dp_overlap=True)).step_time_s
    assert canonical(plan.replace(dp_overlap=True)) == canonical(plan)


def test_a_profile_default_is_on_or_off(tmp_path):
    data = read_toml(load_system("dgx-h100").path, "profile")
    data["framework"]["dp_overlap"]["value"] = 0.5
    with pytest.raises(PerfsimError, match="framework.dp_overlap.value must be 0 or 1"):
        parse_system(data, "test profile")
    data["framework"]["dp_overlap"]["value"] = 1
    assert parse_system(data, "test profile").framework.dp_overlap == 1


def test_plan_field_must_be_a_boolean():
    from perfsim.spec.plan import plan_problems

    assert any("dp_overlap must be true or false" in r for r in plan_problems(Plan(dp_overlap="yes"), MODEL))
    assert dataclasses.asdict(Plan())["dp_overlap"] is False
