"""Pipeline layouts (plan field pp_layout, --pp-layout; spec/layout.py, cost/pipeline.py,
docs/equations.md 9.4 and 7.3): Megatron-Core's layout strings, uneven splits with the
interleaved schedule, the embedding, the loss and MTP layers where the layout puts them, counted
by hand stage by stage and chunk by chunk, in both engines, the memory model and the search.

The models: Llama 3.1 405B (Meta's model card: 126 layers, hidden 16384, 128 heads, 8 key/value
heads, SwiGLU 53248, vocabulary 128256) and a dense stand-in for DeepSeek-V3's 61 layers
(hidden 7168, 128 heads, vocabulary 129280, its dense layers' MLP width 18432, which is also its
MoE layers' active width, 8 routed + 1 shared experts of 2048): perfsim has no mixture of experts
or MTP module, so the DeepSeek tests are about where the layers sit, not about DeepSeek's own cost.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perfsim.cost import pipeline
from perfsim.cost.columns import NONE, columns_of
from perfsim.cost.memory import layout_activation_bytes, memory_breakdown, microbatches_in_flight, stage_params
from perfsim.cost.stage import stage_costs
from perfsim.cost.tensor_parallel import layout_of
from perfsim.errors import PerfsimError
from perfsim.predict import peak_flops, predict
from perfsim.schedule.orders import stage_order
from perfsim.schedule.simulator import simulate
from perfsim.search import parse_fixes, search
from perfsim.spec.layout import layout_problems, load_layout_file, parse_layout, virtual_stages
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan, plan_problems
from perfsim.spec.system import for_dtype, load_system
from conftest import search_rows_checked

H100 = for_dtype(load_system("dgx-h100"), "bf16")  # as predict prices a bf16 step: its measured bf16 tables
LLAMA = "hidden=16384,heads=128,kv_heads=8,ffn=53248,seq=8192,vocab=128256,activation=swiglu,norm=rmsnorm," \
        "bias=false,learned_positions=false,tied_embeddings=false,dropout=false"
LLAMA31_405B = load_model("layers=126," + LLAMA)
DEEPSEEK = "hidden=7168,heads=128,ffn=18432,seq=4096,vocab=129280,activation=swiglu,norm=rmsnorm,bias=false," \
           "learned_positions=false,tied_embeddings=false,dropout=false"
DEEPSEEK_V3 = load_model("layers=61," + DEEPSEEK)
# NVIDIA's Llama 3.1 405B recipe on 1,024 H100s: TP 8, PP 8, VP 8, CP 2, the embedding and the loss
# counted as a layer each (Megatron-Core's --account-for-embedding/loss-in-pipeline-split)
LLAMA_RECIPE = Plan(tp=8, sp=True, pp=8, vpp=8, schedule="interleaved", cp=2, dp=8, mbs=1, gbs=256, zero=1,
                    recompute="none", attention="flash", pp_layout="Et|(tt|)*62,tL")
# DeepSeek-V3's layouts: Megatron-Bridge's PP 8 x VP 4 and PP 16 recipes, Megatron-Core's documented PP 16 x VPP 2
DEEPSEEK_LAYOUTS = {(8, 4): "Et|(tt|)*30mL", (16, 1): "Et*4|(t*4|)*14,tmL", (16, 2): "Et*3|(tt|)*29,m|L"}

# Parameters one device holds, by hand. Llama at TP 8: a layer's four weights are 16384 x 18432
# (QKV with 8 key/value heads of 128), 16384^2, 16384 x 106496 (gate and up), 53248 x 16384:
# 3,187,671,040, an eighth each, and two RMSNorms of 16384, whole; the vocabulary padded to a
# multiple of 128 x 8: 129,024 rows of 16384, an eighth on the first (embedding) and on the last
# (untied output layer) stage, which also holds the final norm.
LLAMA_LAYER = 3_187_671_040 // 8 + 2 * 16384  # 398,491,648
LLAMA_WORD = 129_024 * 16384 // 8  # 264,241,152
# DeepSeek stand-in at TP 2: 7168 x 21504 + 7168^2 + 7168 x 36864 + 18432 x 7168 = 601,882,624 a
# layer, half each, two norms of 7168 whole; 129,280 rows (a multiple of 256 already) of 7168, halved.
DS_LAYER = 601_882_624 // 2 + 2 * 7168  # 300,955,648
DS_WORD = 129_280 * 7168 // 2  # 463,339,520


def _deepseek_plan(pp, vpp, gbs=32, dp=1):
    return Plan(tp=2, sp=True, pp=pp, vpp=vpp, schedule="interleaved" if vpp > 1 else "1f1b", dp=dp, mbs=1, gbs=gbs,
                zero=1, recompute="selective", attention="flash", pp_layout=DEEPSEEK_LAYOUTS[(pp, vpp)])


# --- the layout string --------------------------------------------------------------------------

def test_megatron_strings_unroll_as_megatron_core_unrolls_them():
    # its parse_str_to_list docstring: "Ettt|(tt|)*29,m|L" is [E,t,t,t] + [t,t] x 29 + [m], [L]
    stages, parts = virtual_stages("Ettt|(tt|)*29,m|L")
    assert parts == ["Ettt"] + ["tt"] * 29 + ["m", "L"] and len(stages) == 32
    assert virtual_stages("Et*3|(tt|)*29,m|L")[1] == parts  # x*N repeats one symbol
    # TransformerConfig's docstring: 'E|(tt|)*2,(t|)*4,mL' holds rank 0 the embedding then a layer,
    # ranks 1-2 two layers then one, rank 3 one layer then the MTP layer and the loss (pp 4, vpp 2)
    layout = parse_layout("E|(tt|)*2,(t|)*4,mL", 4)
    assert layout.vpp == 2
    assert [[s.symbols for s in layout.rank(i)] for i in range(4)] == [["E", "t"], ["tt", "t"], ["tt", "t"],
                                                                       ["t", "mL"]]


@pytest.mark.parametrize("pp, vpp, ranks", [
    # (layers, embedding, loss, MTP layers) per rank, all chunks together
    (8, 4, [(7, 1, 0, 0)] + [(8, 0, 0, 0)] * 6 + [(6, 0, 1, 1)]),
    (16, 1, [(4, 1, 0, 0)] + [(4, 0, 0, 0)] * 14 + [(1, 0, 1, 1)]),
    (16, 2, [(5, 1, 0, 0)] + [(4, 0, 0, 0)] * 13 + [(2, 0, 0, 1), (2, 0, 1, 0)]),
])
def test_deepseek_v3_layouts_place_61_layers(pp, vpp, ranks):
    layout = parse_layout(DEEPSEEK_LAYOUTS[(pp, vpp)], pp)
    assert layout.vpp == vpp and layout.total("layers") == 61
    assert [tuple(layout.rank_total(i, k) for k in ("layers", "embedding", "loss", "mtp")) for i in range(pp)] == ranks
    assert plan_problems(_deepseek_plan(pp, vpp), DEEPSEEK_V3) == []


@pytest.mark.parametrize("text, says", [
    ("", "is empty"),
    ("Et*3|(tt|*29,m|L", "parentheses"),
    ("((tt|)*2)*3|L", "parentheses"),
    ("Et*3|(tt|)|L", "followed by *N"),
    ("Et*|L", "needs a count"),
    ("Ex|L", "'x' is not a layer"),
    ("t" * 3 + "*" + "9" * 5000, "implausibly large"),
    ("(t*1000)*100000|L", "longer than"),
    ("Ett|tL|tt", "not a multiple of pp 2"),
    ("tE|tL", "must open with the embedding"),
    ("Et|Lt", "must end with the loss"),
    ("EtL|tL", "must end with the loss"),
    ("Em|tL", "after an MTP layer"),
    ("Et|mt|t|tL", "chunk 1 of 2"),
    ("Et|t|tt|L", "the model has 3"),
])
def test_bad_layouts_are_one_line_errors(run_cli, text, says):
    r = run_cli("predict", "--model", "layers=3,hidden=64,heads=4,seq=32,vocab=128", "--system", "dgx-a100",
                "--devices", "2", "--pp", "2", "--gbs", "4", "--pp-layout", text)
    err = r.err.strip()
    assert r.code == 2 and "\n" not in err and err.startswith("perfsim: error:") and says in err, err


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet="EtmL|()*,0123456789 x", max_size=40))
def test_any_layout_text_is_a_layout_or_a_reason(text):
    problems = layout_problems(text, 2, 4)
    assert all(isinstance(p, str) and "\n" not in p for p in problems)
    if not problems:
        layout = parse_layout(text, 2)
        assert layout.total("layers") == 4 and layout.total("embedding") == layout.total("loss") == 1
    elif layout_problems(text, 2):
        with pytest.raises(PerfsimError):
            parse_layout(text, 2)


def test_the_toml_forms_are_the_string(tmp_path):
    string, listed = tmp_path / "string.toml", tmp_path / "listed.toml"
    string.write_text('layout = "Et*3|(tt|)*29,m|L"\n')
    listed.write_text("[pp_layout]\nstages = [" + ", ".join(
        ['["embedding", "decoder", "decoder", "decoder"]'] + ['["t", "t"]'] * 29 + ['["mtp"]', '["loss"]']) + "]\n")
    assert load_layout_file(str(string)) == "Et*3|(tt|)*29,m|L"
    assert virtual_stages(load_layout_file(str(listed)))[1] == virtual_stages("Et*3|(tt|)*29,m|L")[1]
    bad = tmp_path / "bad.toml"
    for text, says in (('layuot = "EtL"', "did you mean layout"), ("stages = [[\"decoder\", \"encoder\"]]", "not a layer"),
                       ('layout = "EtL"\nstages = [["E"]]', "one of")):
        bad.write_text(text)
        with pytest.raises(PerfsimError, match=says):
            load_layout_file(str(bad))


@pytest.mark.parametrize("plan, same", [
    (Plan(gbs=4, pp_layout="EtttL"), Plan(gbs=4)),
    (Plan(pp=2, gbs=4, pp_layout="Ett|tL"), Plan(pp=2, gbs=4, first_stage_layers=2, last_stage_layers=1)),
    (Plan(pp=3, gbs=6, pp_layout="Et|t|tL"), Plan(pp=3, gbs=6)),
    (Plan(pp=2, vpp=2, schedule="interleaved", gbs=4, pp_layout="Et|t|t|tL"),
     Plan(pp=2, vpp=2, schedule="interleaved", gbs=4, first_stage_layers=2, last_stage_layers=2)),
], ids=["one-stage", "pp2", "pp3-even", "pp2-vpp2"])
def test_a_layout_prices_as_the_split_it_writes(plan, same):
    model = load_model("layers=4,hidden=64,heads=4,seq=32,vocab=128" if plan.vpp > 1
                       else "layers=3,hidden=64,heads=4,seq=32,vocab=128")
    a, b = predict(model, H100, plan), predict(model, H100, same)
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
    assert a.memory_bytes["total"] == pytest.approx(b.memory_bytes["total"], rel=1e-12)
    assert simulate(model, H100, plan).prediction.step_time_s == pytest.approx(
        simulate(model, H100, same).prediction.step_time_s, rel=1e-9)


# --- Llama 3.1 405B: TP 8, PP 8, VP 8, CP 2 on 1,024 H100s ---------------------------------------

def test_llama_405b_recipe_three_ways_is_one_plan(run_cli):
    """The layout string, the first and last stage's counts, and Megatron-Core's account-for flags
    lay the 126 layers out alike: 15 + 6 x 16 + 15, the embedding and the loss one slot each."""
    model = "layers=126," + LLAMA
    base = ["predict", "--model", model, "--system", "dgx-h100", "--devices", "1024", "--tp", "8", "--sp", "--pp", "8",
            "--cp", "2", "--mbs", "1", "--gbs", "256", "--zero", "1", "--recompute", "none", "--json"]
    ways = [["--pp-layout", "Et|(tt|)*62,tL"], ["--vpp", "8", "--first-stage-layers", "15", "--last-stage-layers", "15"],
            ["--vpp", "8", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]]
    import json

    out = []
    for way in ways:
        r = run_cli(*base, *way)
        assert r.code == 0, r.err
        out.append(json.loads(r.out))
    assert out[0]["plan"]["vpp"] == 8 and out[0]["plan"]["schedule"] == "interleaved"
    for other in out[1:]:
        assert other["step_time_s"] == pytest.approx(out[0]["step_time_s"], rel=1e-12)
        assert other["memory_bytes"]["total"] == pytest.approx(out[0]["memory_bytes"]["total"], rel=1e-12)
        assert [s["chunks"] for s in other["pipeline_stages"]] == [s["chunks"] for s in out[0]["pipeline_stages"]]
    stages = out[0]["pipeline_stages"]
    assert stages[0]["chunks"] == ["Et"] + ["tt"] * 7 and stages[7]["chunks"] == ["tt"] * 7 + ["tL"]
    assert [s["layers"] for s in stages] == [15] + [16] * 6 + [15]


def test_llama_405b_recipe_by_hand():
    c = columns_of(LLAMA_RECIPE)
    assert LLAMA_RECIPE.devices == 1024 and LLAMA_RECIPE.microbatches == 32
    # parameters per stage
    held = [float(stage_params(LLAMA31_405B, c, pipeline.position_of(c, i))) for i in range(8)]
    assert held == [15 * LLAMA_LAYER + LLAMA_WORD] + [16 * LLAMA_LAYER] * 6 + [15 * LLAMA_LAYER + LLAMA_WORD + 16384]
    # micro-batches in flight per virtual stage at each stage's activation peak (docs/equations.md 7.3):
    # stage i warms up with 2 (8 - i - 1) + 7 x 8 forwards and holds one more at its first backward,
    # the forwards going through the chunks 8 micro-batches at a time. Stage 0: 71 = 8 x 8 + 7 more
    # of chunk 0, whose one layer (the embedding takes the other slot) makes that the peak, 15 + 7 x
    # 8 x 2 = 127 layer-micro-batches; stage 1: 69, all chunks of 2 layers: 138; stage 7: 57
    # forwards hold 56 x 2 + 1 at its first backward, but after one more backward-forward pair the
    # 1-layer chunk holds none and chunk 0 one more: 9 + 6 x 8 = 57 micro-batches of 2 layers, 114.
    expect = {0: (127, [15] + [8] * 7), 1: (138, [13] + [8] * 7), 7: (114, [9] + [8] * 6 + [0])}
    for i, (load, state) in expect.items():
        got = pipeline.peak_state(c, i, pipeline.chunk_layers(LLAMA31_405B, c, pipeline.position_of(c, i)))
        assert (float(got[0]), got[1]) == (load, state)
    assert float(microbatches_in_flight(c, stage=1)) == 69 / 8
    # the memory model keeps those layer-micro-batches of one layer's activations (no dropout mask,
    # no recomputation), the last stage its head too; the second stage is the peak
    per_layer = float(layout_activation_bytes(LLAMA31_405B, layout_of(LLAMA31_405B, c), 0.5, NONE, 1, 2.0,
                                              H100.framework.autocast, 0))
    first, second = (memory_breakdown(LLAMA31_405B, H100, c, position=f"stage {i}") for i in (0, 1))
    assert float(first["activations"]) == pytest.approx(127 * per_layer, rel=1e-12)
    assert float(second["activations"]) == pytest.approx(138 * per_layer, rel=1e-12)
    assert predict(LLAMA31_405B, H100, LLAMA_RECIPE).memory_peak_stage == "stage 1"


def test_llama_405b_recipe_step_time_structure():
    """A middle stage (16 layers) paces the pipeline: it costs what a middle stage of a 128-layer
    model split evenly costs, and the step is m T_mid + (p - 1)/v x mean T (docs/equations.md 9.1)."""
    c, peak = columns_of(LLAMA_RECIPE), peak_flops(H100, "bf16")
    costs = stage_costs(LLAMA31_405B, H100, c, peak)
    times = [float(costs.by_position[f"stage {i}"][0].total) for i in range(8)]
    even = stage_costs(load_model("layers=128," + LLAMA), H100,
                       columns_of(LLAMA_RECIPE.replace(pp_layout="")), peak)
    assert times[1] == pytest.approx(float(even.middle.total), rel=1e-12)
    assert max(times) == times[1] > max(times[0], times[7])
    p = predict(LLAMA31_405B, H100, LLAMA_RECIPE)
    pipe = sum(p.time_breakdown_s[k] for k in ("compute", "recompute", "tp_comm", "cp_comm", "pp_comm", "pp_bubble"))
    assert pipe == pytest.approx(32 * times[1] + 7 / 8 * sum(times) / 8, rel=1e-9)


# --- DeepSeek-V3 -----------------------------------------------------------------------------

@pytest.mark.parametrize("pp, vpp, held", [
    (8, 4, [7 * DS_LAYER + DS_WORD] + [8 * DS_LAYER] * 6 + [7 * DS_LAYER + 2 * DS_WORD + 7168]),
    (16, 1, [4 * DS_LAYER + DS_WORD] + [4 * DS_LAYER] * 14 + [2 * DS_LAYER + 2 * DS_WORD + 7168]),
    (16, 2, [5 * DS_LAYER + DS_WORD] + [4 * DS_LAYER] * 13 + [3 * DS_LAYER + 2 * DS_WORD + 7168,
                                                              2 * DS_LAYER + DS_WORD + 7168]),
])
def test_deepseek_v3_parameters_per_stage(pp, vpp, held):
    """An MTP layer is a layer, and its stage holds the head (final norm, output layer) and the word
    embedding it runs, unless it holds them already: the last stage of 'tmL' its layer, 'm' on
    rank 14 of the PP 16 x VPP 2 layout its layer, a head and an embedding of its own."""
    c = columns_of(_deepseek_plan(pp, vpp))
    assert [float(stage_params(DEEPSEEK_V3, c, f"stage {i}")) for i in range(pp)] == held


@pytest.mark.parametrize("pp, vpp, expect", [
    # p 8, v 4, 32 micro-batches: stage 0 warms up 14 + 24 = 38 forwards, holds 15|8|8|8 of its
    # 1|2|2|2-layer chunks at its first backward (63), more than 16|8|8|7 later (62); stage 7 25
    # forwards, 8|8|8|1 at its first backward (49), 9|8|8|0 later (50: the 'mL' chunk holds one layer, m)
    (8, 4, {0: (63, [15, 8, 8, 8]), 7: (50, [9, 8, 8, 0])}),
    # 1F1B on 16 stages: stage i keeps min(m, 16 - i) micro-batches
    (16, 1, {0: (4 * 16, [16]), 15: (2 * 1, [1])}),
    # p 16, v 2: stage 0 47 forwards at its first backward, 31|16 of its 3|2-layer chunks (125); one
    # backward and one forward later 32|15 (126)
    (16, 2, {0: (126, [32, 15]), 14: (2 * 19, [19, 0])}),
])
def test_deepseek_v3_in_flight_per_virtual_stage(pp, vpp, expect):
    c = columns_of(_deepseek_plan(pp, vpp, gbs=32 if pp == 8 else 64))
    for i, (load, state) in expect.items():
        pos = f"stage {i}"
        weights = [n + mtp for n, (_, _, mtp) in zip(pipeline.chunk_layers(DEEPSEEK_V3, c, pos),
                                                     pipeline.chunk_edges(c, pos))]
        got = pipeline.peak_state(c, i, weights)
        assert (float(got[0]), got[1]) == (load, state)


def test_an_mtp_layer_is_priced_as_a_layer_and_a_head():
    """The last stage of 'Et*4|(t*4|)*14,tmL' forwards what the last stage of the 62-layer
    'Et*4|(t*4|)*14,ttL' does, and one head more (the logits GEMM and the loss)."""
    peak = peak_flops(H100, "bf16")
    mtp = stage_costs(DEEPSEEK_V3, H100, columns_of(_deepseek_plan(16, 1)), peak)
    plain = stage_costs(load_model("layers=62," + DEEPSEEK), H100,
                        columns_of(_deepseek_plan(16, 1).replace(pp_layout="Et*4|(t*4|)*14,ttL")), peak)
    head = mtp.parts[2][0]  # the head's Work
    extra = float(mtp.by_position["stage 15"][0].forward_compute) - float(plain.by_position["stage 15"][0].forward_compute)
    assert extra == pytest.approx(float(head.time_s), rel=1e-9)
    assert float(mtp.by_position["stage 1"][0].total) == pytest.approx(float(plain.by_position["stage 1"][0].total),
                                                                       rel=1e-12)


# --- both engines --------------------------------------------------------------------------------

@pytest.mark.parametrize("model, plan", [
    (LLAMA31_405B, LLAMA_RECIPE.replace(gbs=128)),
    (DEEPSEEK_V3, _deepseek_plan(8, 4)),
    (DEEPSEEK_V3, _deepseek_plan(16, 1)),
    (DEEPSEEK_V3, _deepseek_plan(16, 2)),
], ids=["llama-pp8-vp8", "deepseek-pp8-vp4", "deepseek-pp16", "deepseek-pp16-vpp2"])
def test_both_engines_agree_on_uneven_layouts(model, plan):
    """As on uneven 1F1B splits (tests/test_uneven_pipeline.py): within 5%, the simulation placing
    each chunk's own layers, embedding, loss and MTP layers (docs/simulator.md)."""
    sim = simulate(model, H100, plan)
    assert sim.prediction.step_time_s == pytest.approx(sim.analytic.step_time_s, rel=0.05)
    assert sum(sim.result.time_breakdown_s.values()) == pytest.approx(sim.result.step_time_s, rel=1e-9)


def test_megatron_schedule_and_the_memory_model_hold_the_same_chunks():
    """The in-flight states the memory model takes the peak over are those of the schedule the
    simulator runs (orders.py, Megatron-Core's interleaved 1F1B), every stage, m = p included."""
    for p, v, m in ((2, 2, 2), (2, 3, 6), (4, 2, 4), (4, 3, 8), (5, 2, 15)):
        for i in range(p):
            n, seen = [0] * v, set()
            for kind, _, chunk in stage_order("interleaved", i, p, m, v):
                n[chunk] += 1 if kind == "F" else -1
                if kind == "F":
                    seen.add(tuple(n))
            assert seen == set(map(tuple, pipeline.chunk_states(p, v, m, i).tolist())), (p, v, m, i)


# --- the search ------------------------------------------------------------------------------

@pytest.mark.parametrize("model, fixes, split", [
    (LLAMA31_405B, ["tp=8", "sp=true", "cp=2", "pp=8", "vpp=8"], (15, 15)),
    (DEEPSEEK_V3, ["tp=2", "sp=true", "cp=1", "pp=8", "vpp=4"], (7, 6)),
    (DEEPSEEK_V3, ["tp=2", "sp=true", "cp=1", "pp=16", "schedule=1f1b"], (3, 2)),
])
def test_search_proposes_layouts_for_layers_that_do_not_divide(model, fixes, split):
    fixes = parse_fixes(fixes + ["mbs=1", "zero=1", "recompute=full", "attention=flash", "order=tp-dp-pp"])
    found = search(model, H100, 1024, 512, fixes, top=1)
    plan = found.plans[0].plan
    assert (plan.first_stage_layers, plan.last_stage_layers) == split and plan_problems(plan, model) == []


def test_the_search_rules_agree_with_plan_problems_on_interleaved_splits():
    wide = parse_fixes(["tp=8", "pp=1..16", "mbs=1", "zero=1", "recompute=full", "attention=flash",
                        "first_stage_layers=0,3,6,7,15,31", "last_stage_layers=0,5,7,15"])
    rows = search_rows_checked(DEEPSEEK_V3, 128, 64, wide)
    assert len(rows) > 300 and sum(plan.vpp > 1 and not invalid for plan, invalid in rows) > 10
