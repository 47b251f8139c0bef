"""collectives.overlap_efficiency (eta): the share of the shorter of (overlapped communication, the
compute beside it) that running them together hides (docs/equations.md 6.1 and 11.4). eta = 1 is
perfsim's perfect overlap, to the last bit; eta < 1 exposes (1 - eta) of what was hidden, in the
closed form and in the event simulator alike."""

from __future__ import annotations

import dataclasses

import pytest

from perfsim.cost.overlap import overlapped_exposure, ring_exposure
from perfsim.errors import PerfsimError
from perfsim.predict import predict
from perfsim.schedule.simulator import predict_simulated
from perfsim.spec._toml import read_toml
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system, parse_system

from conftest import pieces_exposed

MODEL = load_model("layers=8,hidden=2048,heads=16,seq=4096,vocab=32000")
PLANS = [Plan(dp=8, zero=0, mbs=1, gbs=16, dp_overlap=True),
         Plan(pp=2, dp=4, zero=1, mbs=1, gbs=16, dp_overlap=True),
         Plan(pp=2, dp=4, zero=2, mbs=1, gbs=16, dp_overlap=True),
         Plan(tp=4, sp=True, dp=2, mbs=1, gbs=4, tp_overlap=True),
         Plan(tp=2, cp=4, sp=True, mbs=1, gbs=2)]


def with_eta(system, eta):
    return dataclasses.replace(system, collectives=dataclasses.replace(system.collectives, overlap_efficiency=eta))


def test_the_exposure_formulas_charge_the_unhidden_share_of_the_shorter_side():
    total, window, pieces = 4.0, 6.0, 4
    ideal = pieces_exposed(total, window, pieces)  # 1.0: the last piece
    assert float(overlapped_exposure(total, window, pieces, 0.25)) == pytest.approx(ideal + 0.75 * (total - ideal))
    assert float(overlapped_exposure(total, window, pieces, 0.0)) == pytest.approx(total)  # nothing hides
    # a ring step: transfer x beside block c takes max(x, c) + (1 - eta) min(x, c) in all
    for x, c in ((1.0, 0.25), (0.1, 0.25)):
        assert float(ring_exposure(x, c, 3, 0.6)) + 3 * c == pytest.approx(3 * (max(x, c) + 0.4 * min(x, c)))
        assert float(ring_exposure(x, c, 3, 0.0)) == pytest.approx(3 * x)


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_eta_one_is_todays_model_exactly_in_both_engines(plan):
    system = load_system("dgx-h100")
    assert system.collectives.overlap_efficiency is None  # left out of the profile: perfect overlap
    assert system.collectives.overlap_or_perfect() == 1.0
    one = with_eta(system, 1.0)
    for engine in (predict, predict_simulated):
        a, b = engine(MODEL, system, plan), engine(MODEL, one, plan)
        assert a.step_time_s == b.step_time_s and a.time_breakdown_s == b.time_breakdown_s


def test_eta_below_one_exposes_the_predicted_extra_of_the_data_parallel_buckets_in_both_engines():
    """One stage, ZeRO-0 with dp_overlap: the reduction's hidden part (total - exposed) behind the
    last backward and the gather's behind the next forward each come back (1 - eta) times."""
    system, eta = load_system("dgx-h100"), 0.4
    plan = PLANS[0]
    base = predict(MODEL, system, plan)
    raw = predict(MODEL, system, plan.replace(dp_overlap=False)).time_breakdown_s["dp_comm"]
    hidden = raw - base.time_breakdown_s["dp_comm"]
    assert hidden > 0
    want = (1 - eta) * hidden
    closed = predict(MODEL, with_eta(system, eta), plan)
    assert closed.time_breakdown_s["dp_comm"] - base.time_breakdown_s["dp_comm"] == pytest.approx(want, rel=1e-9)
    assert closed.step_time_s - base.step_time_s == pytest.approx(want, rel=1e-9)
    simulated = predict_simulated(MODEL, with_eta(system, eta), plan).step_time_s
    simulated_base = predict_simulated(MODEL, system, plan).step_time_s
    # the simulator hides each bucket behind its own pass's compute (its window is that pass's, the
    # closed form's the stage's backward): the two charges agree within a few per cent
    assert simulated - simulated_base == pytest.approx(want, rel=0.05)


@pytest.mark.parametrize("plan", PLANS[1:], ids=str)
def test_eta_below_one_slows_both_engines_alike(plan):
    """Buckets across a pipeline, ZeRO-2's per-micro-batch buckets, tensor-parallel chunks and the
    ring: each engine's step grows with 1 - eta. Tensor-parallel chunks and the ring are stage
    costs both engines share: about the same growth. Gradient buckets across a pipeline: the
    simulator slows every stage's last backward, and in the cool-down each delays the stages before
    it, where the closed form charges the slowest stage's alone: between one and p times as much."""
    system = load_system("dgx-h100")
    steps = {eta: (predict(MODEL, with_eta(system, eta), plan).step_time_s,
                   predict_simulated(MODEL, with_eta(system, eta), plan).step_time_s) for eta in (1.0, 0.5, 0.0)}
    closed = [steps[eta][0] for eta in (1.0, 0.5, 0.0)]
    simulated = [steps[eta][1] for eta in (1.0, 0.5, 0.0)]
    assert closed[0] < closed[1] < closed[2] and simulated[0] < simulated[1] < simulated[2]
    if plan.dp_overlap and plan.pp > 1:
        assert closed[2] - closed[0] <= simulated[2] - simulated[0] <= 1.05 * plan.pp * (closed[2] - closed[0])
    else:
        assert simulated[2] - simulated[0] == pytest.approx(closed[2] - closed[0], rel=0.25)
    # linear in 1 - eta in the closed form: half the loss at eta = 0.5
    assert closed[1] - closed[0] == pytest.approx((closed[2] - closed[0]) / 2, rel=1e-9)


def test_zero3_keeps_its_own_overlap_share_in_both_engines():
    """ZeRO-3's prefetch is priced by framework.zero3_overlap, fitted on whole steps: eta leaves it."""
    system, plan = load_system("dgx-h100"), Plan(dp=8, zero=3, mbs=1, gbs=16, dp_overlap=True)
    for engine in (predict, predict_simulated):
        assert engine(MODEL, with_eta(system, 0.3), plan).step_time_s == engine(MODEL, system, plan).step_time_s


def test_the_profile_takes_it_as_an_optional_fraction_with_provenance(tmp_path):
    data = read_toml(load_system("dgx-h100").path, "profile")
    data["collectives"]["overlap_efficiency"] = {"value": 0.7, "provenance": "calibrated", "source": "a test"}
    system = parse_system(data, "test profile")
    assert system.collectives.overlap_efficiency == 0.7
    assert system.provenance["collectives.overlap_efficiency"] == ("calibrated", "a test")
    for bad in (0.0, 1.5):
        data["collectives"]["overlap_efficiency"]["value"] = bad
        with pytest.raises(PerfsimError, match="collectives.overlap_efficiency"):
            parse_system(data, "test profile")
