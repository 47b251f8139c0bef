"""Uneven pipeline splits (plan fields first_stage_layers, last_stage_layers; docs/equations.md
9.4): the first and last stage hold counts of their own, the other layers spread evenly over the
other stages; the slowest stage, first, middle or last, paces the pipeline."""

from __future__ import annotations

import pytest

from perfsim import cli
from perfsim.cost.columns import columns_of
from perfsim.cost.memory import layer_activation_bytes
from perfsim.cost.stage import StageCosts, StagePhase, StageTime, stage_costs
from perfsim.errors import PerfsimError
from perfsim.predict import peak_flops, predict
from perfsim.schedule.analytic import step_time
from perfsim.schedule.simulator import run_step, step_costs
from perfsim.search import parse_fixes, search
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan, plan_problems, stage_layers
from perfsim.spec.system import load_system
from conftest import search_rows_checked

A100 = load_system("dgx-a100")
SPEC = "hidden=1024,heads=16,seq=2048,vocab=32000"
# Llama 3 405B (Meta's model card and paper): 126 layers, trained on 16 pipeline stages
LLAMA3_405B = load_model("layers=126,hidden=16384,heads=128,kv_heads=8,ffn=53248,seq=8192,vocab=128256,"
                         "activation=swiglu")


def test_stage_layers_resolve_the_split():
    assert [float(x) for x in stage_layers(126, 16, 7, 7)] == [7, 8, 7]  # 7 + 14 x 8 + 7
    assert [float(x) for x in stage_layers(10, 4, 1, 0)] == [1, 3, 3]  # the rest over the other three
    assert [float(x) for x in stage_layers(10, 4, 0, 4)] == [2, 2, 4]
    assert [float(x) for x in stage_layers(12, 4, 0, 0)] == [3, 3, 3]
    assert [float(x) for x in stage_layers(12, 1, 0, 0)] == [12, 12, 12]  # one stage holds all
    assert [float(x) for x in stage_layers(10, 2, 4, 6)] == [4, 5, 6]  # no middle stage: its count unused, not 0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("pp, first, last", [(2, 4, 6), (2, 3, 0), (4, 1, 3)])
def test_every_zero_stage_prices_uneven_splits(zero, pp, first, last):
    """Finite, warning-free and equal in both engines to within the simulator's modelling (ZeRO-3 on
    2 stages divided by a middle stage's 0 layers before)."""
    import warnings

    from perfsim.schedule.simulator import simulate

    model, plan = load_model("layers=10," + SPEC), Plan(pp=pp, dp=2, zero=zero, gbs=8, first_stage_layers=first,
                                                       last_stage_layers=last)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sim = simulate(model, "dgx-h100", plan)
    assert 0 < sim.analytic.step_time_s < float("inf")
    assert sim.prediction.step_time_s == pytest.approx(sim.analytic.step_time_s, rel=0.05)


def test_an_explicit_even_split_is_the_even_split():
    model = load_model("layers=8," + SPEC)
    even, explicit = Plan(pp=4, gbs=8), Plan(pp=4, gbs=8, first_stage_layers=2, last_stage_layers=2)
    a, b = predict(model, A100, even), predict(model, A100, explicit)
    assert a.step_time_s == b.step_time_s and a.memory_bytes == b.memory_bytes
    assert a.time_breakdown_s == b.time_breakdown_s


def test_a_heavier_middle_stage_paces_the_pipeline():
    """10 layers on 4 stages as 1 + 4 + 4 + 1: stage times from one layer's, counted by hand."""
    model = load_model("layers=10," + SPEC)
    plan = Plan(pp=4, gbs=8, first_stage_layers=1, last_stage_layers=1)
    m = plan.microbatches
    one = stage_costs(load_model("layers=4," + SPEC), A100, columns_of(Plan(pp=4, gbs=8)), peak_flops(A100, "bf16"))
    hop = one.middle.pp_comm  # a stage's sends, whatever its layers
    layer = one.middle.total - hop  # the 4-layer model on 4 stages: one layer a stage
    edges = (one.first.total - one.middle.total, one.last.total - one.middle.total)  # embedding, head
    t_first, t_middle, t_last = layer + hop + edges[0], 4 * layer + hop, layer + hop + edges[1]
    assert t_middle > max(t_first, t_last)
    costs = stage_costs(model, A100, columns_of(plan), peak_flops(A100, "bf16"))
    for got, want in ((costs.first.total, t_first), (costs.middle.total, t_middle), (costs.last.total, t_last)):
        assert float(got) == pytest.approx(want, rel=1e-12)
    p = predict(model, A100, plan)
    pipeline = sum(p.time_breakdown_s[k] for k in ("compute", "recompute", "tp_comm", "pp_comm", "pp_bubble"))
    pipeline -= p.time_breakdown_s["pp_comm"] - m * float(costs.middle.pp_comm)  # less the tied-embedding sync
    assert pipeline == pytest.approx((m - 1) * t_middle + t_first + 2 * t_middle + t_last, rel=1e-9)
    assert p.time_breakdown_s["compute"] == pytest.approx(m * float(costs.middle.compute), rel=1e-12)


def test_gpipe_simulation_agrees_with_the_closed_form_with_a_heavier_middle():
    """GPipe is the flow shop (m - 1) T_max + sum T_i for any stage times (docs/simulator.md):
    with no sends and no link sharing the two engines agree, the middle stage the slowest."""
    model = load_model("layers=10," + SPEC)
    plan = Plan(pp=4, gbs=6, schedule="gpipe", first_stage_layers=1, last_stage_layers=1)
    c = columns_of(plan)
    ends, middle = (StageTime(compute=f + b, backward=b) for f, b in ((0.3, 0.6), (1.0, 2.0)))
    stages = StageCosts(ends, middle, ends, 1e6, 1e6)
    phases = tuple(StagePhase(forward_compute=s.compute - s.backward) for s in (ends, middle, ends))
    costs = step_costs(model, A100, c, stages, phases)
    costs.share_links = False
    closed, breakdown = step_time(model, A100, c, stages)
    assert run_step(costs).step_time_s == pytest.approx(float(closed), rel=1e-9)
    pipeline = sum(float(breakdown[k]) for k in ("compute", "recompute", "tp_comm", "pp_bubble"))
    assert pipeline == pytest.approx((6 - 1) * 3.0 + 0.9 + 2 * 3.0 + 0.9, rel=1e-12)  # the middle's 3 s paces


def test_memory_counts_the_second_stage_when_it_holds_more():
    """1 + 3 + 3 + 3 layers under 1F1B: the second stage keeps 3 micro-batches of 3 layers, the first
    4 of 1 layer (and the embedding's mask): the second is the peak."""
    model = load_model("layers=10," + SPEC)
    plan = Plan(pp=4, gbs=8, first_stage_layers=1)
    p = predict(model, A100, plan)
    assert p.memory_peak_stage == "second"
    per_layer = float(layer_activation_bytes(model, 1, 1, 0, 0))
    assert p.memory_bytes["activations"] == pytest.approx(3 * 3 * per_layer, rel=1e-12)


def test_llama3_405b_trains_126_layers_on_16_stages():
    plan = Plan(tp=8, sp=True, pp=16, dp=8, zero=1, mbs=1, gbs=64, recompute="full", attention="flash",
                first_stage_layers=7, last_stage_layers=7)
    assert plan_problems(plan, LLAMA3_405B) == []
    assert "pp 16 must divide the 126 layers" in plan_problems(plan.replace(first_stage_layers=0, last_stage_layers=0),
                                                               LLAMA3_405B)[0]
    p = predict(LLAMA3_405B, "dgx-h100", plan)
    assert p.step_time_s > 0 and p.plan.as_dict()["first_stage_layers"] == 7


def test_search_finds_the_llama_split_and_its_rules_agree_with_plan_problems():
    fixes = parse_fixes(["tp=8", "pp=16", "sp=true", "mbs=1", "zero=1", "recompute=full", "attention=flash",
                         "order=tp-dp-pp"])
    found = search(LLAMA3_405B, load_system("dgx-h100"), 1024, 64, fixes, top=1)
    assert (found.plans[0].plan.first_stage_layers, found.plans[0].plan.last_stage_layers) == (7, 7)
    wide = parse_fixes(["tp=8", "pp=1..16", "mbs=1", "zero=1", "recompute=full", "attention=flash",
                        "first_stage_layers=0..9", "last_stage_layers=0,7"])
    assert len(search_rows_checked(LLAMA3_405B, 128, 64, wide)) > 100


@pytest.mark.parametrize("flags, says", [
    (["--pp", "1", "--first-stage-layers", "3"], "need a pipeline"),
    (["--pp", "4", "--first-stage-layers", "2"], "must spread evenly over the other 3 stages"),
    (["--pp", "2", "--first-stage-layers", "4", "--last-stage-layers", "4"], "must be 10"),
    (["--pp", "2", "--vpp", "4", "--first-stage-layers", "5", "--last-stage-layers", "5"], "do not fill its 4 chunks"),
    (["--pp", "4"], "--first-stage-layers, --last-stage-layers"),
])
def test_bad_splits_are_one_line_errors(capsys, flags, says):
    assert cli.main(["predict", "--model", "layers=10," + SPEC, "--system", "dgx-a100", "--gbs", "8", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("perfsim: error:") and says in err, err


def test_a_split_is_a_whole_number():
    with pytest.raises(PerfsimError):
        predict(load_model("layers=10," + SPEC), A100, Plan(pp=4, gbs=8, first_stage_layers=1.5))


def test_search_lists_the_split_and_refuses_a_fix_of_too_many_counts(capsys):
    model = "layers=126," + SPEC
    assert cli.main(["search", "--model", model, "--system", "dgx-h100", "--devices", "16", "--gbs", "32",
                     "--fix", "pp=16", "--top", "1", "--quiet"]) == 0
    assert "PP 16 1f1b (7 layers on the first stage, 7 on the last)" in capsys.readouterr().out
    assert cli.main(["search", "--model", "layers=2000," + SPEC, "--system", "dgx-h100", "--devices", "16",
                     "--gbs", "32", "--fix", "first_stage_layers=0..5000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "more than 1,000 layer counts" in err
