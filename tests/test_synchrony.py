"""The wait for the slowest rank (framework.rank_jitter, perfsim/cost/synchrony.py, docs/equations.md
9.5): the expected maximum of n normals against its known values and a Monte Carlo draw, both
engines pricing the same term, the harness's spread across ranks and the fit of rank_jitter from
runs alone on every rank."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import perfsim
from perfsim.calibrate.overheads import fit_rank_jitter, rank_spread
from perfsim.cost.synchrony import expected_max_normal
from perfsim.ledger import step_problem
from perfsim.predict import predict
from perfsim.schedule.simulator import simulate


def test_expected_maximum_of_normals_against_known_values():
    # n = 2, 3: 1/sqrt(pi) and 3/(2 sqrt(pi)) in closed form; 4: 3/(2 sqrt(pi)) (1 + 2/pi asin(1/3));
    # 10, 100, 1000: Tippett's (1925) table as David & Nagaraja reproduce it
    root_pi = math.sqrt(math.pi)
    known = {1: 0.0, 2: 1 / root_pi, 3: 1.5 / root_pi, 4: 1.5 / root_pi * (1 + 2 / math.pi * math.asin(1 / 3)),
             10: 1.53875, 100: 2.50759, 1000: 3.24144}
    for n, value in known.items():
        assert expected_max_normal(n) == pytest.approx(value, abs=2e-5), n
    counts = np.array([[2.0, 1024.0], [2.0, 1.0]])
    assert np.allclose(expected_max_normal(counts), [[1 / root_pi, expected_max_normal(1024)], [1 / root_pi, 0.0]])


def test_expected_maximum_grows_like_but_below_sqrt_2_ln_n():
    rng = np.random.default_rng(0)
    draws = rng.standard_normal((4000, 1024)).max(axis=1)
    assert expected_max_normal(1024) == pytest.approx(draws.mean(), abs=4 * draws.std() / math.sqrt(4000))
    for n in (8, 1024, 2**20):
        assert expected_max_normal(n) < math.sqrt(2 * math.log(n))
    ratios = [expected_max_normal(n) / math.sqrt(2 * math.log(n)) for n in (2**4, 2**10, 2**20)]
    assert ratios == sorted(ratios) and ratios[-1] > 0.9


def _jittered(name: str, sigma):
    system = perfsim.load_system(name)
    return dataclasses.replace(system, framework=dataclasses.replace(system.framework, rank_jitter=sigma))


PLANS = [perfsim.Plan(dp=8, mbs=2, gbs=64, zero=1), perfsim.Plan(tp=2, pp=2, dp=2, mbs=1, gbs=16),
         perfsim.Plan(tp=2, pp=4, vpp=2, schedule="interleaved", mbs=1, gbs=16)]


@pytest.mark.parametrize("plan", PLANS, ids=["dp8", "tp2-pp2-dp2", "pp4-interleaved"])
def test_both_engines_wait_sigma_e_n_of_their_step_for_the_slowest_rank(plan):
    """The closed form and the simulation each wait sigma x E[max of all n ranks] of the rest of their
    step, in a breakdown term of its own that the parts still add up with; they agree as their steps do."""
    sigma, n = 0.05, plan.devices
    plain, system = perfsim.load_system("dgx-a100"), _jittered("dgx-a100", sigma)
    for engine in (lambda s: predict("gpt3-1.3b", s, plan), lambda s: simulate("gpt3-1.3b", s, plan).prediction):
        before, after = engine(plain), engine(system)
        wait = after.time_breakdown_s["synchrony"]
        assert before.time_breakdown_s["synchrony"] == 0.0
        assert wait == pytest.approx(sigma * expected_max_normal(n) * before.step_time_s, rel=1e-9)
        assert after.step_time_s == pytest.approx(before.step_time_s + wait, rel=1e-12)
        assert sum(after.time_breakdown_s.values()) == pytest.approx(after.step_time_s, rel=1e-12)
    closed, simulated = predict("gpt3-1.3b", system, plan), simulate("gpt3-1.3b", system, plan).prediction
    assert simulated.time_breakdown_s["synchrony"] == pytest.approx(closed.time_breakdown_s["synchrony"], rel=0.02)


def test_a_profile_without_rank_jitter_waits_for_no_one():
    plan = PLANS[1]
    assert predict("gpt3-1.3b", "dgx-a100", plan).step_time_s == predict("gpt3-1.3b", _jittered("dgx-a100", 0.0),
                                                                         plan).step_time_s


def test_draws_price_the_jitter_as_arrays():
    """Under uncertainty draws a framework number is an array over the draws: the term follows it."""
    from perfsim.cost.columns import columns_of
    from perfsim.predict import evaluate

    sigma = np.array([0.0, 0.05, 0.1])
    r = evaluate(perfsim.load_model("gpt3-1.3b"), _jittered("dgx-a100", sigma), columns_of(PLANS[0]))
    base = r["step_time_s"][0]
    assert np.allclose(r["step_time_s"], base * (1 + sigma * expected_max_normal(8)))


def _record(ranks: list, alone: bool = False, at_speed=None) -> dict:
    measured = {"rank_step_times_s": ranks, "step_times_s": [max(r) for r in ranks]}
    if alone:
        measured["alone"] = True
    if at_speed is not None:
        measured["at_speed"] = at_speed
    return {"measured": measured}


def test_rank_spread_pools_each_steps_variance_and_drops_the_shared_part():
    # every step's ranks 1 +- 0.1 about their mean, the mean itself moving (a machine-wide spell)
    ranks = [[0.9, 1.1], [1.8, 2.2], [0.45, 0.55]]
    x = rank_spread(_record(ranks, alone=True)["measured"])
    assert x["cv"] == pytest.approx(0.1 * math.sqrt(2)) and x["wait"] == pytest.approx(0.1)
    assert x["ranks"] == 2 and x["steps"] == 3 and x["alone"]
    # the steps off the profile's speed are left out where some ran at it
    y = rank_spread(_record(ranks + [[1.0, 3.0]], at_speed=[True, True, True, False])["measured"])
    assert y["steps"] == 3 and y["cv"] == pytest.approx(x["cv"])
    assert rank_spread({"step_times_s": [1.0]}) is None  # a record from before per-rank times
    assert rank_spread(_record([[1.0], [1.1]])["measured"]) is None  # one rank


def test_rank_jitter_is_fitted_from_the_runs_alone_and_only_from_them():
    rng = np.random.default_rng(1)
    alone = _record((1 + 0.08 * rng.standard_normal((400, 4))).tolist(), alone=True)
    together = _record([[1.0, 1.001, 0.999, 1.0]] * 3)
    values, notes = fit_rank_jitter([together, alone], "steps.jsonl")
    assert values["framework.rank_jitter"].value == pytest.approx(0.08, rel=0.1)
    assert "alone on each of 4 ranks" in values["framework.rank_jitter"].source
    assert "the synchronised runs' ranks spread 0.082% (" in notes[0]
    values, notes = fit_rank_jitter([together], "steps.jsonl")
    assert values == {} and "has no run alone on every rank" in notes[0] and "left as in the base profile" in notes[0]
    assert fit_rank_jitter([], "steps.jsonl") == ({}, [])


def test_old_ledgers_without_per_rank_times_still_load_and_bad_ones_are_named():
    from perfsim.ledger import LEDGER_SCHEMA

    record = {"schema": LEDGER_SCHEMA, "key": "step:x", "suite": "step", "op": "training_step", "dtype": "bf16", "plan": {"dp": 2},
              "measured": {"step_time_s": 1.0, "step_times_s": [1.0, 1.1], "peak_memory_bytes": 1.0, "flops": 1.0,
                           "comm_bytes": 1.0, "activation_bytes": 1.0, "comm_bytes_by_kind": {}}}
    assert step_problem(record) is None
    assert step_problem(dict(record, measured=dict(record["measured"], rank_step_times_s=[[1.0, 0.9], [1.1, 1.0]]))) is None
    for bad in ([[1.0, 0.9]], [[1.0, "x"], [1.1, 1.0]], [[], []]):
        assert "rank_step_times_s" in step_problem(dict(record, measured=dict(record["measured"],
                                                                               rank_step_times_s=bad)))
