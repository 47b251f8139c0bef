"""perfsim search: the vectorised validity rules agree with plan_problems, the ranking agrees with
predict, the authors' SMNG-P2 plan ranks in the top 10 of their space, and bad input is one line."""

import json
import random

import numpy as np
import pytest

import perfsim
from perfsim.cli import main
from perfsim.cost.columns import columns_of
from perfsim.search import candidates, parse_fixes, rejection_reasons, search

MODEL = perfsim.load_model("gpt3-1.3b")
SYSTEM = perfsim.load_system("dgx-a100")


def _plan(mode, cols, i, order="tp-dp-pp"):
    from perfsim.search import plan_at

    return plan_at(mode, order, cols, i)


def _agreement(model, devices, gbs, seed) -> tuple[int, list]:
    """Check that rejection_reasons and plan_problems agree on up to 150 sampled candidates of each mode:
    (plans checked, modes proposed)."""
    rng = random.Random(seed)
    checked, modes = 0, []
    for mode, cols in candidates(model, devices, gbs, {}):
        modes.append(mode)
        invalid = np.zeros(len(cols["tp"]), dtype=bool)
        for _, mask in rejection_reasons(model, mode, cols):
            invalid |= mask
        for i in rng.sample(range(len(invalid)), min(150, len(invalid))):
            plan = _plan(mode, cols, i)
            assert bool(invalid[i]) == bool(perfsim.plan_problems(plan, model)), (plan, perfsim.plan_problems(plan, model))
            checked += 1
    return checked, modes


def test_vectorised_rules_agree_with_plan_problems():
    assert _agreement(MODEL, 32, 64, 7)[0] > 300


def test_search_ranks_by_throughput_and_matches_predict():
    result = search(MODEL, SYSTEM, 16, 64, top=5)
    speeds = [p.tokens_per_s for p in result.plans]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) == 5
    for p in result.plans:
        again = perfsim.predict(MODEL, SYSTEM, p.plan)
        assert again.step_time_s == pytest.approx(p.step_time_s) and p.fits
    assert result.evaluated >= result.feasible > 0
    assert sum(result.rejected.values()) + result.feasible == result.candidates


def test_search_finds_the_best_plan_brute_force_would():
    """Every valid plan predicted one by one: the search's first plan is the fastest that fits."""
    fixes = parse_fixes(["zero=1", "recompute=full", "order=tp-dp-pp", "schedule=1f1b"])
    result = search(MODEL, SYSTEM, 8, 32, fixes, top=1)
    best = None
    for mode, cols in candidates(MODEL, 8, 32, fixes):
        for i in range(len(cols["tp"])):
            plan = _plan(mode, cols, i)
            if perfsim.plan_problems(plan, MODEL):
                continue
            p = perfsim.predict(MODEL, SYSTEM, plan)
            if p.fits and (best is None or p.tokens_per_s > best.tokens_per_s):
                best = p
    assert result.plans[0].tokens_per_s == pytest.approx(best.tokens_per_s)


def test_pareto_front_is_non_dominated():
    result = search(MODEL, SYSTEM, 16, 64, top=3)
    front = [(p.tokens_per_s, p.memory_bytes["total"]) for p in result.pareto]
    for speed, memory in front:
        assert not any(s > speed and m < memory for s, m in front)
    assert [m for _, m in front] == sorted(m for _, m in front)


def test_authors_plan_is_in_the_top_10_of_their_space():
    """SMNG-P2 175B on 16 nodes, global batch 300, restricted to the authors' Bayesian-search space."""
    space = ["tp=1,2,4,8", "pp=12,16,24,32,48,96", "mbs=1,2,3,4,6,8,10", "zero=1", "dp=1", "tp_mode=1d",
             "sp=false", "recompute=full", "schedule=1f1b", "order=tp-dp-pp", "attention=unfused"]
    result = search(perfsim.load_model("gpt3-175b"), perfsim.load_system("smng-p2"), 128, 300, parse_fixes(space))
    top = [(p.plan.tp, p.plan.pp, p.plan.mbs) for p in result.plans]
    assert (8, 16, 3) in top


def test_search_json_contract(capsys):
    assert main(["search", "--model", "gpt3-1.3b", "--system", "dgx-a100", "--devices", "16", "--gbs", "64",
                 "--top", "3", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"evaluated", "feasible", "rejected", "plans"} <= set(out)
    assert len(out["plans"]) == 3 and "step_time_s" in out["plans"][0] and "plan" in out["plans"][0]


def test_search_csv(capsys):
    assert main(["search", "--model", "gpt3-1.3b", "--system", "dgx-a100", "--devices", "8", "--gbs", "32",
                 "--top", "2", "--csv", "--quiet"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("rank,tokens_per_s") and len(lines) == 3


@pytest.mark.parametrize("argv,message", [
    (["--fix", "tp_mode=3d", "--fix", "tp=2"], "no valid plan"),
    (["--fix", "zero=1", "--fix", "zero=2"], "no value"),
    (["--fix", "warp=3"], "unknown knob"),
    (["--fix", "tp=x"], "whole numbers"),
    (["--fix", "tp_mode=4d"], "must be one of"),
])
def test_bad_search_input(capsys, argv, message):
    code = main(["search", "--model", "gpt3-1.3b", "--system", "dgx-a100", "--devices", "8", "--gbs", "32", "--quiet",
                 *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("perfsim: error: ") and message in err[0]


def test_nothing_fits_says_why(capsys):
    code = main(["search", "--model", "gpt3-175b", "--system", "dgx-a100", "--devices", "8", "--gbs", "8", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "fits in device memory" in err[0] and "more devices" in err[0]


def test_device_count_with_no_valid_plan(capsys):
    # 11 devices: no tp divides the heads, no data-parallel size the batch, and 24 layers on 11 stages
    # have no split (7 devices do: 2 + 5 x 4 + 2, docs/equations.md 9.4)
    code = main(["search", "--model", "gpt3-1.3b", "--system", "dgx-a100", "--devices", "11", "--gbs", "8", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "perfsim: error:" in err


def test_columns_of_a_found_plan_round_trip():
    result = search(MODEL, SYSTEM, 8, 32, top=1)
    assert columns_of(result.plans[0].plan).tp == result.plans[0].plan.tp


LATENT_DENSE = perfsim.load_model("layers=4,hidden=2048,heads=16,attention_type=mla,q_lora_rank=512,kv_lora_rank=256,"
                                  "qk_nope_dim=64,qk_rope_dim=32,v_head_dim=64,ffn=8192,seq=2048,vocab=32000")


@pytest.mark.parametrize("name", ["deepseek-v3", "latent-dense"])
def test_latent_attention_is_searched_beside_1d_only(name):
    """Latent attention runs beside 1d tensor parallelism only: search proposes no 2d, 2.5d or 3d
    plan of an MLA model (a dense one as well as DeepSeek-V3), plan_problems refuses them in one line,
    and the vectorised rules still agree with plan_problems on the rows it proposes."""
    model = LATENT_DENSE if name == "latent-dense" else perfsim.load_model(name)
    checked, modes = _agreement(model, 64, 256, 3)
    assert modes == ["1d"] and checked == 150
    grid = perfsim.Plan(tp=4, tp_mode="2d", mbs=2, dp=16, gbs=256)
    assert any("1d tensor parallelism only" in r for r in perfsim.plan_problems(grid, model))


def test_search_of_a_dense_latent_attention_model():
    result = search(LATENT_DENSE, perfsim.load_system("dgx-h100"), 64, 256, top=3)
    assert result.plans and all(p.plan.tp_mode == "1d" for p in result.plans + result.pareto)
    best = result.plans[0]
    assert perfsim.predict(LATENT_DENSE, perfsim.load_system("dgx-h100"), best.plan).step_time_s == best.step_time_s
