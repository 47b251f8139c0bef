"""The harness's mixture-of-experts layer and expert-parallel steps (validate/moe.py): the layer
against the textbook formula in one process, and real steps of 2 and 4 gloo ranks
(validate/moe_check.py: EP over data-parallel ranks with expert-DP, EP folded into the attention's
tensor-parallel ranks with SP, both dispatchers, top-k routing, full recomputation) against a
single-process run of the same model, against the counts written out from the shapes (FLOPs,
bytes each rank sends in the all-to-alls, gradient all-reduces, what one MoE layer keeps for
backward) and against perfsim's; a wrong all-to-all backward is caught."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")


from conftest import each_rank, run_rank_check  # noqa: E402
from perfsim.spec.model import load_model  # noqa: E402
from validate import llama  # noqa: E402
from validate.gpt import GPT, GPTConfig  # noqa: E402
from validate.moe import balanced_counts, moe_layers  # noqa: E402
from validate.moe_check import CASES, MODEL  # noqa: E402

# fp32 sums reordered by the reductions and the experts' row order: measured <= 4e-9 on
# gradients ~0.04, and 2.4e-7 on losses ~5.7
LOSS_RTOL, GRAD_ATOL = 1e-6, 1e-7


def textbook(layer, x, routing):
    """sum over a token's k experts of softmax(chosen logits) x expert(token), plus the shared
    expert, token by token."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = layer.router(tokens)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        if routing == "balanced":
            chosen = [(t * layer.topk + j) % layer.experts_total for j in range(layer.topk)]
        else:
            chosen = logits[t].topk(layer.topk).indices.tolist()
        weights = torch.softmax(logits[t, chosen], -1)
        for w, e in zip(weights, chosen):
            expert = layer.experts[e]
            out[t] += w * expert.fc2(llama.swiglu(expert.fc1(tokens[t])))
    if layer.shared is not None:
        out = out + layer.shared(tokens)
    return out.view(x.shape)


@pytest.mark.parametrize("routing", ["balanced", "topk"])
def test_one_process_layer_is_the_textbook_mixture(routing):
    torch.manual_seed(0)
    gpt = GPT(dataclasses.replace(GPTConfig.from_spec(load_model(MODEL)), routing=routing))
    layer = moe_layers(gpt)[0]
    assert not hasattr(gpt.blocks[0].mlp, "router")  # dense_layers = 1: the first layer keeps its MLP
    x = torch.randn(2, 16, 32, requires_grad=True)
    ours, theirs = layer(x), textbook(layer, x, routing)
    assert torch.allclose(ours, theirs, atol=1e-6)
    dy = torch.randn_like(ours)
    wanted = (x, layer.router.weight, layer.experts[3].fc1.weight, layer.shared.fc2.weight)
    for a, b in zip(torch.autograd.grad(ours, wanted, dy), torch.autograd.grad(theirs, wanted, dy)):
        assert torch.allclose(a, b, atol=1e-5)


def test_balanced_routing_gives_every_expert_its_share():
    assert balanced_counts(32, 2, 8) == [8] * 8
    assert balanced_counts(5, 2, 4) == [3, 3, 2, 2]  # 10 copies over 4 experts: the first ones take the rest
    assert sum(balanced_counts(7, 3, 5)) == 21


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def results(request, tmp_path_factory):
    data = run_rank_check(tmp_path_factory, "validate.moe_check", request.param)
    assert [c["case"] for c in data["cases"]] == CASES[request.param]
    return data


@pytest.mark.multiprocess
def test_loss_and_gradients_equal_single_process(results):
    for case, rank in each_rank(results):
        name = case["case"]
        assert rank["loss"] == pytest.approx(rank["reference_loss"], rel=LOSS_RTOL), name
        assert rank["grad_max_abs_error"] <= GRAD_ATOL and rank["grad_max_abs"] > 1e-2, name


@pytest.mark.multiprocess
def test_flops_bytes_and_saved_activations_equal_the_count(results):
    """Balanced routing: FLOPs, the all-to-all bytes each rank sends, the gradient all-reduces and
    one MoE layer's saved bytes exactly as counted from the shapes, on every rank."""
    for case, rank in each_rank(results):
        name, hand, sent = case["case"], rank["hand"], rank["sent_bytes_by_kind"]
        if case["routing"] != "balanced":
            continue
        assert rank["flops"] == hand["flops"], name
        assert sent.get("all_to_all", 0) == hand["all_to_all_bytes"], name
        if hand["all_reduce_bytes"] is not None:  # tensor parallelism's are tests/test_validate_gpt.py's
            assert sent["all_reduce"] == pytest.approx(hand["all_reduce_bytes"], rel=1e-12), name
        assert rank["moe_layer_saved_bytes"] == hand["moe_layer_saved_bytes"], name
        if case["plan"]["ep"] > 1 and case["plan"]["moe_dispatcher"] == "alltoall":
            assert sent["all_to_all"] > 0, name
            assert "all_gather" not in sent or case["plan"]["tp"] > 1, name  # SP's gathers beside tensor parallelism


@pytest.mark.multiprocess
def test_flops_all_to_all_bytes_and_saved_activations_equal_perfsims(results):
    """Against perfsim (perfsim.predict, perfsim.cost.experts), balanced routing, every rank:
    FLOPs exactly; the all-to-all bytes and one MoE layer's saved bytes exactly up to the named
    differences (validate.moe_check.named_differences: none for the all-to-alls since perfsim prices the
    probabilities' beside the tokens, and what
    Megatron-Core 0.13 keeps for backward where perfsim prices the layer before it)."""
    for case, rank in each_rank(results):
        name, theirs, named = case["case"], rank["perfsim"], rank["named_differences"]
        if case["routing"] != "balanced":
            continue
        if theirs is None:
            pytest.skip("a perfsim without experts (perfsim.cost.experts)")
        assert rank["flops"] == theirs["flops"], name
        assert rank["sent_bytes_by_kind"].get("all_to_all", 0) == theirs["all_to_all_bytes"] + named["all_to_all_bytes"], name
        assert rank["moe_layer_saved_bytes"] == theirs["moe_layer_saved_bytes"] + named["moe_layer_saved_bytes"], name
        if case["plan"]["ep"] > 1 and case["plan"]["moe_dispatcher"] == "alltoall":
            assert theirs["all_to_all_bytes"] > 0 and named["all_to_all_bytes"] < theirs["all_to_all_bytes"] / 30, name


@pytest.mark.multiprocess
def test_top_k_routing_runs_uneven_splits(results):
    """Top-k routing: the ranks' experts get different numbers of rows (their FLOPs differ; at 2
    ranks each sends in all what the other sends, its dispatch being the other's combine), and
    the gradients still equal the single-process run's (test_loss_and_gradients_equal_single_process)."""
    for case in results["cases"]:
        if case["routing"] == "topk":
            assert len({r["flops"] for r in case["ranks"]}) > 1, case["case"]
            assert len({r["sent_bytes_by_kind"]["all_to_all"] for r in case["ranks"]}) == (1 if len(case["ranks"]) == 2 else 4)


@pytest.mark.multiprocess
def test_a_wrong_all_to_all_backward_is_caught(tmp_path_factory):
    """The all-to-all's backward handing the gradient back unsent (shapes fit under balanced
    routing): the loss is unchanged, the gradients are not."""
    data = run_rank_check(tmp_path_factory, "validate.moe_check", 2, "--cases", "ep2-dp2", "--broken-backward")
    for rank in data["cases"][0]["ranks"]:
        assert rank["loss"] == pytest.approx(rank["reference_loss"], rel=LOSS_RTOL)
        assert rank["grad_max_abs_error"] > 1e-4


MOE_PLAN_MODEL = ("layers=2,hidden=64,heads=4,kv_heads=2,ffn=160,activation=swiglu,norm=rmsnorm,bias=false,"
                  "learned_positions=false,seq=32,vocab=512,tied_embeddings=false,dropout=false,"
                  "experts=4,topk=2,expert_ffn=32,shared_expert_ffn=64")


def test_a_calibration_of_an_expert_parallel_plan_measures_its_all_to_all_and_expert_gemms():
    """perfsim calibrate asked about an EP plan measures all-to-alls over its EP groups (the plan's
    own dispatch size and the sweep) and the router's, shared and routed experts' GEMMs; a dense
    plan measures none of them."""
    from perfsim.spec.plan import Plan
    from validate import microbench as mb

    if "ep" not in Plan.__dataclass_fields__:
        pytest.skip("a perfsim without expert parallelism")
    model = load_model(MOE_PLAN_MODEL)
    sweep = mb.default_sweep("cpu", quick=True)
    points = mb.build_points("cpu", ("bf16",), model, Plan(dp=4, ep=2, mbs=2, gbs=8), 4, 4, sweep,
                             ("gemm", "collective"))
    a2a = [p for p in points if p.op == "all_to_all"]
    assert {p.group for p in a2a} == {(2, 1)}
    own = 2 * 32 * 2 * 64 * 2  # mbs x seq tokens, topk copies of hidden bf16 elements
    assert sorted(p.dims["nbytes"] for p in a2a) == sorted(set(sweep.collective_bytes) | {own})
    assert [p.dims["nbytes"] for p in a2a if p.origin == "plan"] == [own]
    gemms = {(p.dims["m"], p.dims["n"], p.dims["k"]) for p in points if p.suite == "gemm" and p.origin == "plan"}
    # the router; one expert's FC1 (SwiGLU) and FC2 on its 64 copies (128 a rank receives, 2 local experts)
    assert {(64, 4, 64), (64, 64, 64), (64, 64, 32)} <= gemms
    dense = mb.build_points("cpu", ("bf16",), load_model(MOE_PLAN_MODEL.split(",experts=")[0]),
                            Plan(dp=4, mbs=2, gbs=8), 4, 4, sweep, ("gemm", "collective"))
    assert not [p for p in dense if p.op == "all_to_all"]


def test_the_fit_prices_all_to_all_points_as_one_of_the_profiles_collective_operations():
    """Points at the link model's own price fit to all_to_all factors (1, 1): nothing moves
    (tests/test_all_to_all_profile.py recovers other factors)."""
    from perfsim.calibrate.collectives import fit_all_to_all
    from perfsim.ledger import calibration_problem
    from perfsim.spec.system import load_system

    experts = pytest.importorskip("perfsim.cost.experts")
    system = load_system("cpu-example")
    records = [{"suite": "collective", "op": "all_to_all", "dtype": "bf16", "group": [2, 1], "nbytes": n,
                "shape": {"nbytes": n}, "key": f"k{n}", "_t": float(experts.all_to_all_time(system, n, 2, 1))}
               for n in (1 << 12, 1 << 16, 1 << 20, 3 << 18)]
    values, (row, alone), _ = fit_all_to_all(records, system, "ledger")
    assert values["collectives.operation_efficiency.all_to_all"].value == pytest.approx(1.0, rel=1e-3)
    assert values["collectives.operation_latency_factor.all_to_all"].value == pytest.approx(1.0, rel=1e-3)
    assert row.fit_mape + (0 if row.held_points == 0 else row.held_mape) == pytest.approx(0.0, abs=1e-3)
    assert alone.fit_mape + (0 if alone.held_points == 0 else alone.held_mape) == pytest.approx(0.0, abs=1e-12)
    assert row.fit_points + row.held_points == 4
    assert calibration_problem(dict(records[0], stats={"min_s": 1e-3, "median_s": 1e-3, "mean_s": 1e-3},
                                    key="collective:x", timing="interleaved", schema=1)) is None


@pytest.mark.multiprocess
def test_a_moe_layer_dispatches_the_ops_perfsim_prices_its_host_time_by(results):
    """The ops one MoE layer dispatches forward and backward on each rank (validate.moe_check counts
    them, the layer alone: no checkpointing) equal perfsim.cost.host.harness_moe_ops for the
    case's plan: each dispatcher, EP 1, 2 and 4, folded into the attention's ranks or not, tensor-
    parallel experts."""
    from perfsim.cost.columns import columns_of
    from perfsim.cost.host import harness_moe_ops
    from validate.moe_check import case_plan

    model = load_model(MODEL)
    for case, rank in each_rank(results):
        expected = harness_moe_ops(model, columns_of(case_plan(case["case"])), 0)
        routing = 3 * (case["routing"] == "topk")  # the counts' all-gather, not priced
        assert rank["moe_layer_ops"] == expected + routing, case["case"]
