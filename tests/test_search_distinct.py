"""perfsim search lists every plan once: plans that differ only in choices that change nothing
(where size-1 dimensions sit in the rank order, the ZeRO stage without data parallelism, GPipe
against 1F1B with one stage) are one candidate, and what is left out predicts the same as what is
kept. And no input makes the search's own loops or allocations unbounded."""

import time

import numpy as np
import pytest

import perfsim
from perfsim.cli import main
from perfsim.cost.columns import GPIPE, ONE_F_ONE_B, Columns
from perfsim.errors import PerfsimError
from perfsim.predict import evaluate
from perfsim.search import (MOST_CANDIDATES, TEXT_KNOBS, candidates, divisors, order_rows, parse_fixes,
                            rejection_reasons, search)
from perfsim.spec.plan import ORDERS, canonical, canonical_order

LLAMA_8B = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,seq=8192,vocab=128256"


def _distinct(plans) -> int:
    return len({canonical(p.plan) for p in plans})


@pytest.mark.parametrize("model, system, devices, gbs, fixes", [
    (LLAMA_8B, "dgx-h100", 16, 64, []),  # was 3 distinct plans in the top 10
    ("gpt3-13b", "dgx-a100", 64, 64, []),  # rows 1-6 were one plan
    ("gpt3-175b", "smng-p2", 1024, 1536, ["tp_mode=1d", "zero=1", "recompute=full", "dp=1"]),  # each plan 3 times
])
def test_top_10_and_pareto_are_distinct_plans(model, system, devices, gbs, fixes):
    result = search(perfsim.load_model(model), perfsim.load_system(system), devices, gbs, parse_fixes(fixes), top=10)
    assert len(result.plans) == 10 and _distinct(result.plans) == 10
    assert _distinct(result.pareto) == len(result.pareto)
    assert len({p.plan for p in result.plans}) == 10


def test_the_fixed_zero_stage_is_kept_without_data_parallelism():
    result = search(perfsim.load_model("gpt3-175b"), perfsim.load_system("smng-p2"), 1024, 1536,
                    parse_fixes(["tp_mode=1d", "zero=1", "recompute=full", "dp=1"]), top=3)
    assert {p.plan.zero for p in result.plans} == {1}


def test_pareto_chart_plans_are_distinct():
    from perfsim.charts.plans import plan_set

    model, system = perfsim.load_model("gpt3-1.3b"), perfsim.load_system("dgx-a100")
    # the user's plan in a layout the search lists under its canonical order
    mine = perfsim.Plan(tp=8, pp=2, dp=1, mbs=1, gbs=32, order="pp-dp-tp")
    plans, _ = plan_set(model, system, mine, 16, 32, top=5, pareto=True)
    shown = [canonical(p.plan) for _, p in plans]
    assert len(shown) == len(set(shown))
    plans, _ = plan_set(model, system, mine.replace(order="dp-pp-tp"), 16, 32, top=0, pareto=True)
    assert [canonical(p.plan) for _, p in plans].count(canonical(mine)) == 1


def test_canonical_order_keeps_the_order_of_dimensions_that_matter():
    assert canonical_order("tp-pp-dp", 8, 1, 4) == "tp-dp-pp"  # dp = 1 sits anywhere
    assert canonical_order("pp-tp-dp", 8, 1, 4) == "dp-pp-tp"  # pp before tp is another layout
    assert canonical_order("dp-pp-tp", 1, 1, 1) == "tp-dp-pp"
    assert canonical_order("pp-dp-tp", 2, 2, 2) == "pp-dp-tp"
    assert canonical(perfsim.Plan(tp=8, pp=4, dp=1, zero=2, order="pp-tp-dp")) == \
        perfsim.Plan(tp=8, pp=4, dp=1, zero=0, order="dp-pp-tp")


def _evaluate(model, system, mode, order, cols, **changes):
    c = {**cols, **changes}
    return evaluate(model, system, Columns(tp=c["tp"], pp=c["pp"], dp=c["dp"], vpp=c["vpp"], mbs=c["mbs"],
                                           gbs=c["gbs"], sp=c["sp"], zero=c["zero"], recompute=c["recompute"],
                                           schedule=c["schedule"], tp_depth=c["tp_depth"], regather=c["regather"],
                                           tp_mode=mode, order=order))


def test_what_the_search_leaves_out_predicts_the_same():
    """Every valid candidate under every rank order, ZeRO stage (dp = 1) and GPipe (pp = 1): the
    search's own candidate for it predicts the same time and memory (GPipe: no less memory)."""
    model, system = perfsim.load_model("gpt3-1.3b"), perfsim.load_system("smng-p2")
    checked = 0
    for mode, cols in candidates(model, 32, 32, {}):
        invalid = np.zeros(len(cols["tp"]), bool)
        for _, mask in rejection_reasons(model, mode, cols):
            invalid |= mask
        rows = order_rows(cols, ORDERS)
        for order in ORDERS:
            kept = rows[order] & ~invalid
            if not kept.any():
                continue
            sub = {k: v[kept] for k, v in cols.items()}
            base = _evaluate(model, system, mode, order, sub)
            step, memory = base["step_time_s"], base["memory_bytes"]["total"]
            for other in ORDERS:  # the same rows in every order they stand for
                same = np.array([canonical_order(other, *(int(sub[d][i]) for d in ("tp", "dp", "pp"))) == order
                                 for i in range(len(sub["tp"]))], bool)
                if same.any():
                    moved = _evaluate(model, system, mode, other, {k: v[same] for k, v in sub.items()})
                    assert np.array_equal(moved["step_time_s"], np.asarray(step)[same])
                    assert np.array_equal(moved["memory_bytes"]["total"], np.asarray(memory)[same])
                    checked += int(same.sum())
            single = sub["dp"] == 1
            for zero in (1, 2, 3) if single.any() else ():
                r = _evaluate(model, system, mode, order, {k: v[single] for k, v in sub.items()},
                              zero=np.full(int(single.sum()), float(zero)))
                assert np.allclose(r["step_time_s"], np.asarray(step)[single], rtol=1e-12, atol=0)
                assert np.allclose(r["memory_bytes"]["total"], np.asarray(memory)[single], rtol=1e-12, atol=0)
            one_stage = sub["pp"] == 1
            assert (sub["schedule"][one_stage] == ONE_F_ONE_B).all()
            if not one_stage.any():
                continue
            r = _evaluate(model, system, mode, order, {k: v[one_stage] for k, v in sub.items()},
                          schedule=np.full(int(one_stage.sum()), float(GPIPE)))
            assert np.allclose(r["step_time_s"], np.asarray(step)[one_stage], rtol=1e-12, atol=0)
            assert (np.asarray(r["memory_bytes"]["total"]) >= np.asarray(memory)[one_stage]).all()
    assert checked > 1000


def test_a_fixed_gpipe_is_searched_with_one_stage():
    result = search(perfsim.load_model("gpt3-1.3b"), perfsim.load_system("dgx-a100"), 8, 32,
                    parse_fixes(["schedule=gpipe", "pp=1"]), top=1)
    assert result.plans[0].plan.schedule == "gpipe"


def test_candidates_count_every_order_a_row_stands_for():
    result = search(perfsim.load_model("gpt3-1.3b"), perfsim.load_system("dgx-a100"), 16, 64, top=1)
    assert sum(result.rejected.values()) + result.feasible == result.candidates
    fixed = search(perfsim.load_model("gpt3-1.3b"), perfsim.load_system("dgx-a100"), 16, 64,
                   parse_fixes(["order=tp-pp-dp"]), top=1)
    assert fixed.plans[0].plan.order == "tp-pp-dp"
    assert TEXT_KNOBS["order"] == ORDERS and ORDERS[0] == "tp-dp-pp"


# --- bounds ---------------------------------------------------------------------------------

def test_divisors_are_found_in_square_root_time():
    for n in range(1, 400):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    start = time.perf_counter()
    assert divisors(2**40 - 87) == [1, 2**40 - 87]  # the largest prime below 2^40
    assert time.perf_counter() - start < 5


def test_huge_fix_ranges_cost_nothing():
    start = time.perf_counter()
    top = str(2**40)  # the largest size a knob takes (spec.model.LARGEST_SIZE)
    wide = parse_fixes(["pp=1.." + top])["pp"]
    assert 1 in wide and 2**40 in wide and 2**40 + 1 not in wide and 0 not in wide
    fixes = parse_fixes(["pp=1.." + top, "pp=8,16," + top, "mbs=2.." + top])
    assert 8 in fixes["pp"] and 16 in fixes["pp"] and 17 not in fixes["pp"] and 2**40 in fixes["pp"]
    assert 1 not in fixes["mbs"] and 2**39 in fixes["mbs"]
    result = search(perfsim.load_model("gpt3-1.3b"), perfsim.load_system("dgx-a100"), 16, 64, fixes, top=1)
    assert result.plans[0].plan.pp in (8, 16) and time.perf_counter() - start < 30
    with pytest.raises(PerfsimError, match="empty"):
        parse_fixes(["pp=9..3"])
    with pytest.raises(PerfsimError, match="no value"):
        parse_fixes(["pp=1..4", "pp=5.." + top])


@pytest.mark.parametrize("fix", ["zero=7", "zero=-1", "zero=0..4", "pp=0", "mbs=1..1" + "0" * 30, "tp=0..4",
                                 "first_stage_layers=-1"])
def test_fix_values_outside_a_knobs_domain_are_named(fix):
    """zero=7 once ended in an IndexError; pp=1..10^30 was taken silently."""
    knob = fix.partition("=")[0]
    with pytest.raises(PerfsimError, match=f"{knob} takes whole numbers from"):
        parse_fixes([fix])


def test_a_huge_prime_device_count_ends_quickly(capsys):
    start = time.perf_counter()
    prime = 1_048_573  # the largest prime perfsim models as a device count (at most 2^20)
    code = main(["search", "--model", "gpt3-1.3b", "--system", "dgx-a100", "--devices", str(prime), "--gbs", "64",
                 "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no valid plan" in err[0], err
    code = main(["search", "--model", "gpt3-1.3b", "--system", "dgx-a100", "--devices", str(2**40 - 87), "--gbs", "8",
                 "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("perfsim: error: ")
    assert time.perf_counter() - start < 30


def test_a_search_space_too_large_to_hold_is_refused_before_it_is_built(capsys):
    start = time.perf_counter()
    code = main(["search", "--model", "gpt3-175b", "--system", "dgx-a100", "--devices", "720720", "--gbs", "720720",
                 "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"{MOST_CANDIDATES:,} candidate plans" in err[0] and "--fix" in err[0]
    assert time.perf_counter() - start < 30
