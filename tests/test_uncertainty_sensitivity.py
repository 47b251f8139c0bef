"""`perfsim sensitivity` (issue 16 item 5, its first half): first-order variance shares, checked on
functions whose shares are known, and on the profiles."""

from __future__ import annotations

import numpy as np
import pytest

from perfsim.spec.system import load_system
from perfsim.uncertainty.sampling import draw
from perfsim.uncertainty.sensitivity import first_order_shares


def test_shares_of_a_known_function():
    rng = np.random.default_rng(0)
    a, b, c = rng.uniform(size=(3, 4096))
    y = 3 * a + b  # Var: 9/12 and 1/12 of 10/12; c does nothing
    assert first_order_shares(a, y) == pytest.approx(0.9, abs=0.03)
    assert first_order_shares(b, y) == pytest.approx(0.1, abs=0.03)
    assert first_order_shares(c, y) < 0.01
    assert first_order_shares(a, np.ones(10)) == 0.0


def test_link_and_device_numbers_are_drawn_independently():
    """Two Sobol designs paired by index track each other dimension by dimension; the draws pair
    them at random, so no device number follows a link number."""
    d = draw(load_system("smng-p2"), 512, comm_points=512)
    ranks = np.argsort(np.argsort(d.values, axis=0), axis=0)
    c = np.corrcoef(ranks.T)
    np.fill_diagonal(c, 0)
    assert np.abs(c).max() < 0.2


def test_smng_p2_step_time_is_moved_by_xe_link(run_cli):
    result = run_cli("sensitivity", "--samples", "128", "--top", "3", "--json")
    assert result.code == 0, result.err
    numbers = result.json()["numbers"]
    assert numbers[0]["number"] == "node.node_link_bandwidth_Bps" and numbers[0]["variance_share"] > 0.5
    assert numbers[0]["p10"] < numbers[0]["p90"] and len(numbers) == 3


def test_dgx_a100_step_time_is_moved_by_gemm_efficiency(run_cli):
    result = run_cli("sensitivity", "--system", "dgx-a100", "--model", "sc21-145.6b", "--devices", "1536", "--tp", "8",
                     "--pp", "8", "--gbs", "2304", "--recompute", "full", "--samples", "128")
    assert result.code == 0, result.err
    first = result.out.splitlines()[3]
    assert first.endswith("device.gemm_efficiency"), result.out


# --- which numbers decide the choice of plan (perfsim/uncertainty/plan_choice.py) ------------------

def test_the_number_that_decides_the_plan_is_not_the_one_that_moves_its_step_time():
    """Two plans; x1 alone decides which is faster (A below 0.5, B above), x2 moves both step times
    far more but the same for both, x3 does nothing."""
    from perfsim.uncertainty.plan_choice import choice_of

    rng = np.random.default_rng(1)
    x1, x2, x3 = rng.uniform(size=(3, 1024))
    steps = np.array([1 + 2 * x2 + 0.1 * x1, 1 + 2 * x2 + 0.05])
    choice = choice_of(steps, {"x1": x1, "x2": x2, "x3": x3})
    shares = {n.key: n for n in choice.numbers}
    assert shares["x1"].choice_share > 0.9 and shares["x2"].choice_share < 0.05 and shares["x3"].choice_share < 0.05
    assert shares["x2"].step_share > 0.9 and shares["x1"].step_share < 0.05
    assert choice.p_best == pytest.approx([0.5, 0.5], abs=0.05)
    assert (shares["x1"].best_low, shares["x1"].best_high) == (0, 1)
    # knowing nothing, the loss is the mean regret of the better plan on average
    assert choice.loss == pytest.approx(min(np.mean(steps[i] / steps.min(axis=0) - 1) for i in range(2)))


def test_one_plan_best_everywhere_leaves_nothing_to_decide():
    from perfsim.uncertainty.plan_choice import choice_of

    x = np.linspace(0, 1, 64)
    choice = choice_of(np.array([1 + x, 2 + x]), {"x": x})
    assert choice.loss == 0 and choice.numbers[0].choice_share == 0 and list(choice.p_best) == [1, 0]


def test_a_plan_that_does_not_fit_is_never_cheaper_than_one_that_runs():
    from perfsim.uncertainty.plan_choice import regret

    r = regret(np.array([[1.0, 1.0, np.inf], [5.0, np.inf, np.inf], [np.inf, 1.5, np.inf]]))
    assert r.shape == (3, 2)  # the draw in which nothing fits is left out
    assert r[2, 0] >= r[1, 0] and r[2, 0] >= 1 and r[1, 1] >= 1


def test_on_a_profile_only_the_network_decides_between_pipeline_and_data_parallelism():
    """dgx-a100 with two uncertain numbers: the InfiniBand bandwidth, on whose value the pipeline
    plan (PP 8) or the data-parallel one (PP 2, DP 4) wins, and a per-step overhead that every plan
    pays alike: it moves the step time most and decides nothing."""
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan
    from perfsim.uncertainty.plan_choice import plan_choice
    from perfsim.uncertainty.ranges import Range

    system = load_system("dgx-a100")
    nic = system.network.nic_bandwidth_Bps
    ranges = {"network.nic_bandwidth_Bps": Range(nic / 2, nic * 4, "loguniform"),
              "framework.step_overhead_s": Range(0.0, 2.0)}
    plans = [Plan(tp=8, pp=8, dp=1, mbs=1, gbs=16, recompute="full"),
             Plan(tp=8, pp=2, dp=4, mbs=1, gbs=16, recompute="full", zero=1)]
    choice = plan_choice(load_model("sc21-39.1b"), system, plans, samples=128, ranges=ranges)
    shares = {n.key: n for n in choice.numbers}
    network, overhead = shares["network.nic_bandwidth_Bps"], shares["framework.step_overhead_s"]
    assert network.choice_share > 0.9 and overhead.choice_share < 0.05
    assert overhead.step_share > 0.8 and network.step_share < 0.2
    assert (network.best_low, network.best_high) == (0, 1)  # slow network: the pipeline; fast: data parallelism
    assert 0.1 < choice.p_best[1] < 0.9


def test_plan_choice_of_the_default_case(run_cli):
    result = run_cli("sensitivity", "--plan-choice", "--candidates", "4", "--samples", "64", "--top", "3", "--json")
    assert result.code == 0, result.err
    out = result.json()
    assert len(out["candidates"]) == 5 and out["candidates"][-1]["given"]  # the authors' plan, appended
    assert out["candidates"][-1]["plan"]["tp"] == 8 and out["candidates"][-1]["plan"]["mbs"] == 3
    assert sum(c["p_best"] for c in out["candidates"]) == pytest.approx(1)
    assert out["expected_regret"] >= 0 and len(out["numbers"]) == 3
    for n in out["numbers"]:
        assert 0 <= n["plan_choice_share"] <= 1 and n["p10"] <= n["p90"]
    text = run_cli("sensitivity", "--plan-choice", "--candidates", "4", "--samples", "64")
    assert text.code == 0 and "<- the given plan" in text.out and "Choosing now, plan" in text.out, text.out


@pytest.mark.parametrize("args, needle", [
    (("--fix", "tp=4"), "give --plan-choice too"),
    (("--plan-choice", "--fix", "warp=9"), "warp"),
    (("--plan-choice", "--candidates", "1"), "--candidates"),
    (("--plan-choice", "--samples", "8192"), "up to 4096"),
])
def test_plan_choice_flags_are_checked(run_cli, args, needle):
    result = run_cli("sensitivity", *args)
    assert result.code == 2 and result.err.count("\n") == 1 and needle in result.err, result.err
