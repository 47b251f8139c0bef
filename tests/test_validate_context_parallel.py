"""Context-parallel training steps of the validation GPT and of a Llama-shaped model (rotary
positions of each rank's own tokens, grouped-query attention: K and V of kv_heads travel the ring)
(validate/context_parallel.py: ring attention over gloo, causal load balancing) on CPU, 2 and 4
ranks (validate/cp_check.py; docs/real-steps.md, "Context parallelism"): loss and gradients equal
the single-process step, and per rank the FLOPs, the bytes the ring sends, the tensor-parallel and
gradient bytes and the activations saved for backward equal perfsim's numbers for the plan."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from conftest import run_rank_check  # noqa: E402
from perfsim.cost.context_parallel import kv_block_bytes  # noqa: E402
from perfsim.spec.model import load_model  # noqa: E402
from validate.cp_check import CASES, MODEL  # noqa: E402

# fp32: sums reordered by the blocks and the online softmax, measured ~2e-8 on gradients of ~0.07
LOSS_RTOL, GRAD_ATOL = 1e-6, 1e-6
# bf16 against the fp32 reference, as validate.tp_check's bf16 cases (measured: 1e-5, 0.7%)
BF16_LOSS_RTOL, BF16_GRAD_RTOL = 1e-2, 3e-2
SEQ, LAYERS, MBS = 32, 2, 2
LLAMA = ("layers=2,hidden=64,heads=8,kv_heads=2,ffn=160,activation=swiglu,norm=rmsnorm,bias=false,"
         "learned_positions=false,tied_embeddings=false,dropout=false,seq=32,vocab=128")
MODELS = {"gpt": MODEL, "llama": LLAMA}


@pytest.fixture(scope="module", params=[(m, w) for m in MODELS for w in (2, 4)],
                ids=lambda p: f"world{p[1]}" if p[0] == "gpt" else f"llama-world{p[1]}")
def results(request, tmp_path_factory):
    name, world = request.param
    data = run_rank_check(tmp_path_factory, "validate.cp_check", world, "--model", MODELS[name], "--mbs", str(MBS))
    assert [c["case"] for c in data["cases"]] == [n for n, (tp, cp, dp, *_) in CASES.items() if tp * cp * dp == world]
    return dict(data, spec=load_model(MODELS[name]))


@pytest.mark.multiprocess
def test_the_ring_blocks_run_the_fused_kernel_and_the_explicit_math_alike(results):
    """On a CPU the blocks run torch's fused flash kernel (what the model prices, docs/equations.md
    11.2), the -explicit case the block math; both equal the single-process step
    (test_loss_and_gradients_equal_single_process)."""
    blocks = {case["case"]: {r["blocks"] for r in case["ranks"]} for case in results["cases"]}
    for name, kinds in blocks.items():
        assert kinds == ({"explicit"} if name.endswith("-explicit") else {"fused"}), name


def ranks(results):
    return [(case, rank) for case in results["cases"] for rank in case["ranks"]]


@pytest.mark.multiprocess
def test_loss_and_gradients_equal_single_process(results):
    for case, rank in ranks(results):
        assert rank["grad_max_abs"] > 1e-3, case["case"]  # the gradients compared are not trivially zero
        if case["bf16"]:
            assert rank["loss"] == pytest.approx(rank["reference_loss"], rel=BF16_LOSS_RTOL), case["case"]
            assert rank["grad_max_abs_error"] <= BF16_GRAD_RTOL * rank["grad_max_abs"], case["case"]
        else:
            assert rank["loss"] == pytest.approx(rank["reference_loss"], rel=LOSS_RTOL), case["case"]
            assert rank["grad_max_abs_error"] <= GRAD_ATOL, case["case"]


@pytest.mark.multiprocess
def test_causal_load_balancing(results):
    """Rank i of cp holds chunks i and 2cp-1-i of the 2 cp chunks: s/cp tokens each, every
    position once over the cp ranks."""
    for case in results["cases"]:
        cp, tp = case["cp"], case["tp"]
        c = SEQ // (2 * cp)
        held = []
        for r, rank in enumerate(case["ranks"]):
            i = (r // tp) % cp  # Megatron's order: tensor innermost, then context
            assert rank["positions"] == list(range(i * c, (i + 1) * c)) + list(range((2 * cp - 1 - i) * c, (2 * cp - i) * c))
            if r % tp == 0 and r < tp * cp:
                held += rank["positions"]
        assert sorted(held) == list(range(SEQ)), case["case"]


@pytest.mark.multiprocess
def test_flops_are_perfsims_full_square(results):
    """The products the ring runs plus those it skips above the causal diagonal equal perfsim's
    hardware FLOPs per device; it skips 2cp-1 of each rank's 4cp (query chunk, key chunk) blocks."""
    model = results["spec"]
    for case, rank in ranks(results):
        flops, cp = rank["flops"], case["cp"]
        assert flops["counted"] + flops["skipped"] == rank["perfsim"]["flops"], case["case"]
        c, heads = SEQ // (2 * cp), model.heads // case["tp"]
        block = 2 * MBS * heads * c * c * model.head_dim  # one product of one block: the query heads
        forwards = 1 if case["recompute"] == "none" else 2  # recomputation repeats the forward ring
        assert flops["skipped_by_pass"] == {"forward": LAYERS * forwards * (2 * cp - 1) * 2 * block,
                                            "backward": LAYERS * (2 * cp - 1) * 5 * block}, case["case"]


@pytest.mark.multiprocess
def test_ring_sends_what_perfsim_prices(results):
    """Per layer cp-1 key/value blocks (K and V of s/cp tokens, kv_heads/tp, head_dim) forward and
    2 (cp-1) backward (the blocks and, on the way home, their gradients), one more forward ring
    under recomputation; in bf16 as perfsim prices them. The tensor-parallel collectives and the
    gradient all-reduce over the dp x cp ranks are perfsim's too."""
    model = results["spec"]
    for case, rank in ranks(results):
        cp, tp = case["cp"], case["tp"]
        kv_block = 2 * 2 * MBS * (SEQ // cp) * model.kv_hidden // tp  # K and V of kv_heads / tp, bf16
        passes = 3 + (case["recompute"] != "none")
        sent, expected = rank["sent"], rank["perfsim"]["sent"]
        assert sent["ring"] == LAYERS * (cp - 1) * passes * kv_block == expected["cp"], case["case"]
        assert sent["ring_messages"] == LAYERS * (cp - 1) * passes, case["case"]  # K and V go as one message
        assert sent["tp"] == pytest.approx(expected["tp"], rel=1e-12), case["case"]
        assert sent["tp_other"] == {}, case["case"]
        assert sent["gradient_sync"]["all_reduce"] == pytest.approx(expected["dp"], rel=1e-12), case["case"]


@pytest.mark.multiprocess
def test_saved_activations_are_perfsims_at_s_over_cp(results):
    """Each layer saves Q, the key/value block its forward held last (in place of its own K and
    V), the output and its fp32 log-sum-exp for s/cp tokens, no score block: perfsim's flash layer
    at mbs/cp sequences' worth of tokens (selective recomputation drops the log-sum-exp too, in the
    harness as in perfsim). The GPT's ring Q is a view of its QKV output,
    keeping its own K and V too without recomputation (tp_check.perfsim_saved_bytes' named term);
    the Llama-shaped layers give Q a storage of its own, as Megatron-Core does."""
    model = results["spec"]
    for case, rank in ranks(results):
        expected, saved = rank["perfsim"]["saved"], rank["saved"]
        own_kv = kv_block_bytes(model, MBS, case["cp"], case["tp"])
        gpt = model.learned_positions and case["recompute"] == "none"
        assert expected["ring_own_kv_per_layer"] == (own_kv if gpt else 0), case["case"]
        for i in range(LAYERS):
            assert saved["by_region"][f"layer{i}"]["activation"] == expected["layer_like"], case["case"]
        assert saved["by_kind"]["activation"] == expected["like"], case["case"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(MODELS))
def test_perfsim_validate_times_a_context_parallel_plan(run_cli, tmp_path, name):
    """`perfsim validate` runs a cp plan (validate.steps -> validate.context_parallel) and compares
    it with perfsim: FLOPs (run plus skipped blocks) and every byte sent equal, the ring's sends
    being the prediction's cp bytes; step time and memory measured; the saved activations
    perfsim's (the GPT's with its ring's own K and V, test_saved_activations_are_perfsims_at_s_over_cp)."""
    model = MODELS[name].replace("vocab=128", "vocab=512")
    r = run_cli("validate", "--device", "cpu", "--nproc", "2", "--model", model, "--plans",
                "cp=2,attention=flash,mbs=2,gbs=2", "--steps", "1", "--speed-tolerance", "inf", "--ledger", str(tmp_path / "l.jsonl"), "--json")
    assert r.code == 0, r.err
    (entry,) = r.json()
    assert entry["label"].startswith("cp2 ") and entry["plan"]["cp"] == 2
    assert entry["flops"]["counted"] == entry["flops"]["predicted"]
    assert entry["comm_bytes"]["counted"] == pytest.approx(entry["comm_bytes"]["predicted"], rel=1e-12)
    assert entry["comm_bytes_counted_by_kind"]["send"] == entry["comm_bytes_predicted_by_dimension"]["cp"] > 0
    assert entry["step_time_s"]["measured"] > 0 and entry["peak_memory_bytes"]["measured"] > 0
    own_kv = LAYERS * kv_block_bytes(load_model(model), 2, 2, 1) if name == "gpt" else 0  # bf16, mbs 2, cp 2
    assert entry["activation_bytes"]["counted"] == pytest.approx(entry["activation_bytes"]["predicted"] + own_kv, rel=0.01)
