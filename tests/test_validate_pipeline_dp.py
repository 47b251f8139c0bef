"""Real pipeline-parallel (torch.distributed.pipelining: GPipe, 1F1B, interleaved 1F1B) and
data-parallel (DDP, ZeroRedundancyOptimizer, FSDP2) training steps on CPU with gloo, world sizes
2 and 4, of the GPT and of a Llama-shaped model, checked rank by rank against a single-process
reference and against perfsim (validate/pp_dp_check.py says how each side is counted;
docs/real-steps-pipeline-dp.md has the conventions and the observed numbers)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from conftest import each_rank, run_rank_check  # noqa: E402
from validate.pp_dp_check import CASES  # noqa: E402

# Loss: the pipeline computes exactly the reference's operations (measured 2e-7 relative: the
# mean of the micro-batch means is summed in another order); gradients: DP reductions reorder fp32
# sums (measured <= 3e-9 on gradients ~0.03); parameters after one MasterAdam step (lr 1e-2,
# eps 1e-4): lr |dg| / eps bounds the change a gradient error dg makes, 1e-2 x 3e-9 / 1e-4 = 3e-7,
# plus fp32 rounding (measured <= 6e-8, against updates of 1e-2).
LOSS_RTOL, GRAD_ATOL, PARAM_ATOL = 1e-6, 1e-6, 1e-6
ACTIVATION_RTOL = 0.05


LLAMA = ("layers=4,hidden=32,heads=4,kv_heads=2,ffn=80,activation=swiglu,norm=rmsnorm,bias=false,"
         "learned_positions=false,tied_embeddings=false,dropout=false,seq=16,vocab=512")
# the Llama-shaped model: each schedule, full recomputation and each ZeRO stage once, at world 2
RUNS = {("gpt", 2): CASES[2], ("gpt", 4): CASES[4],
        ("llama", 2): ["gpipe-pp2", "interleaved-pp2-vpp2", "1f1b-pp2-full", "zero0-dp2", "zero1-dp2", "zero2-dp2",
                       "zero3-dp2"]}


@pytest.fixture(scope="module", params=list(RUNS), ids=lambda r: f"world{r[1]}" if r[0] == "gpt" else f"llama-world{r[1]}")
def results(request, tmp_path_factory):
    kind, world = request.param
    extra = () if kind == "gpt" else ("--model", LLAMA, "--cases", ",".join(RUNS[request.param]))
    data = run_rank_check(tmp_path_factory, "validate.pp_dp_check", world, *extra)
    assert [c["case"] for c in data["cases"]] == RUNS[request.param]
    return data


@pytest.mark.multiprocess
def test_loss_gradients_and_updated_parameters_equal_single_process(results):
    for case, rank in each_rank(results):
        name = case["case"]
        assert case["loss"] == pytest.approx(rank["reference_loss"], rel=LOSS_RTOL), name
        assert math.isnan(rank["loss"]) != (rank["stage"] in ("last",) or case["plan"]["pp"] == 1), name
        assert rank["grad_max_abs_error"] <= GRAD_ATOL and rank["grad_max_abs"] > 1e-3, name
        assert rank["param_max_abs_error"] <= PARAM_ATOL, name
        assert rank["param_max_abs_update"] > 1000 * PARAM_ATOL, name  # the step moved the parameters


@pytest.mark.multiprocess
def test_flops_per_rank_equal_perfsim_for_its_stage(results):
    for case, rank in each_rank(results):
        assert rank["flops"]["counted"] == rank["flops"]["perfsim"], (case["case"], rank["rank"])


@pytest.mark.multiprocess
def test_pipeline_bytes_equal_perfsim_but_the_missing_edge_hops(results):
    """perfsim prices 2 v activation hops per micro-batch on every stage; the first stage sends no
    gradient back and the last no activation forward, one hop less each (pp_dp_check)."""
    for case, rank in each_rank(results):
        pp, name = case["plan"]["pp"], case["case"]
        sent, received = rank["pp_bytes"]["sent"], rank["pp_bytes"]["received"]
        assert sent["activations"] == rank["pp_bytes"]["torch_expected"], name
        assert received["activations"] == sent["activations"], name
        hops = 2 * case["plan"]["vpp"] - (rank["stage"] in ("first", "last")) if pp > 1 else 0
        assert sent["activations"] == rank["pp_bytes"]["perfsim"] * hops / (2 * case["plan"]["vpp"]), name
        if rank["stage"] == "middle":
            assert sent["activations"] == rank["pp_bytes"]["perfsim"], name
        # the library's one-time warm-up vote: 4 bytes per neighbour and chunk, nothing else
        assert sent["control"] <= 4 * 2 * case["plan"]["vpp"], name


@pytest.mark.multiprocess
def test_data_parallel_bytes_equal_perfsim_with_torch_differences_named(results):
    for case, rank in each_rank(results):
        plan, name = case["plan"], case["case"]
        dp = rank["dp_bytes"]
        counted = dp["counted"]
        assert set(counted) == set(dp["torch_expected"]), name
        for kind, expected in dp["torch_expected"].items():
            assert counted[kind] == pytest.approx(expected, rel=1e-12), (name, kind)
        if plan["dp"] == 1:
            continue
        perfsim = dp["perfsim"]
        if plan["zero"] == 1:  # all-reduce where DeepSpeed reduce-scatters; broadcasts move the gather's bytes
            assert counted["all_reduce"] == pytest.approx(2 * perfsim["reduce_scatter"]), name
            assert counted["broadcast"] == pytest.approx(perfsim["all_gather"]), name
        else:  # ZeRO-2/3 as FSDP2 runs them (the profile's zero_implementation): twice per
            # micro-batch under full recomputation too
            assert counted == pytest.approx(perfsim, rel=1e-12), name


@pytest.mark.multiprocess
def test_model_state_bytes_equal_perfsim_memory_breakdown(results):
    for case, rank in each_rank(results):
        plan, name = case["plan"], case["case"]
        counted, perfsim = rank["memory"]["counted"], rank["memory"]["perfsim"]
        assert counted["gradients"] == perfsim["gradients"], name
        if plan["zero"] == 1:
            # ZeroRedundancyOptimizer partitions whole parameters: near 1/D each, the total exact
            total = sum(r["memory"]["counted"]["optimizer"] for r in case["ranks"])
            assert total == plan["dp"] * perfsim["optimizer"], name
            assert counted["optimizer"] == pytest.approx(perfsim["optimizer"], rel=0.01), name
        else:
            assert counted["optimizer"] == perfsim["optimizer"], name
        if plan["zero"] == 2:
            # FSDP2 holds the shard as the parameter and the gathered copy through the step, and
            # so does perfsim's ZeRO-2 with zero_implementation = "fsdp2"
            assert 2 * counted["unsharded_params_in_step"] + counted["weights"] == perfsim["weights"], name
        else:
            assert counted["weights"] == perfsim["weights"], name
        if plan["zero"] == 3:
            assert counted["unsharded_params_in_step"] == 0, name  # everything resharded after forward


@pytest.mark.multiprocess
def test_saved_activation_peak_within_5_percent_of_perfsim(results):
    """First and last stages of GPipe and 1F1B (and interleaved) without recomputation, against
    perfsim's activations as they stand (its head counts the fp32 softmax the loss keeps; the bf16
    logits, which nothing saves, are a buffer)."""
    checked = 0
    for case, rank in each_rank(results):
        plan = case["plan"]
        if plan["pp"] == 1 or plan["recompute"] != "none" or rank["stage"] == "middle":
            continue
        act = rank["activations"]
        assert act["counted"] == pytest.approx(act["perfsim"], rel=ACTIVATION_RTOL), (case["case"], rank["stage"])
        checked += 1
    assert checked >= 4


@pytest.mark.multiprocess
def test_gloo_copies_a_reduce_scatter_input_as_the_cpu_profile_says(results):
    """The CPU profiles price one copy of a reduce-scatter's input at FSDP2's peak
    (framework.reduce_scatter_input_copies, docs/equations.md 6.2): what gloo allocates in the call."""
    from perfsim.spec.system import load_system

    copies = load_system(results["system"]).framework.reduce_scatter_input_copies
    assert copies == 1
    assert results["reduce_scatter_input_copies"] == pytest.approx([copies] * results["world"], abs=0.05)
