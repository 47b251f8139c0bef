"""Real 1D tensor-parallel training steps (validate.gpt) on CPU with gloo, world sizes 2 and 4, of
the GPT and of a Llama-shaped model (RMSNorm, rotary, grouped-query attention, SwiGLU, no biases;
also with flash attention): loss and gradients equal a single-process reference (within bf16
tolerance for the bf16 cases), and per rank the matrix FLOPs, the bytes sent per collective kind,
the parameters held and the activation bytes saved for backward equal perfsim's numbers for the
plan (validate/tp_check.py and docs/real-steps.md say how each side is counted)."""

from __future__ import annotations


import pytest

pytest.importorskip("torch")

from conftest import run_rank_check  # noqa: E402
from perfsim.spec.model import load_model  # noqa: E402
from validate.tp_check import BF16_CASES, CASES, case_name  # noqa: E402

# Loss: same reduction order up to the vocabulary split; gradients: fp32 sums reordered by the
# sharding (all-reduce of partial products), measured ~2e-8 on gradients of size ~0.1.
LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-6
# bf16 parameters against the fp32 reference: bf16 weights and activations through two layers (the
# loss is taken on fp32 logits, the logits themselves are bf16: spacing 2^-8 relative); measured
# 0.02-0.13% when the loss was bf16 too. Gradients: measured max abs error
# 0.7-0.8% of the largest gradient (8 mantissa bits through two layers, the loss and back).
BF16_LOSS_RTOL = 1e-2
BF16_GRAD_RTOL = 3e-2  # of the largest reference gradient
# Saved activations: the counted total (with what perfsim does not model: LayerNorm statistics,
# token ids and targets) within 5% of perfsim's like-for-like figure.
SAVED_RTOL = 0.05
# hidden 64, seq 32: the per-layer terms dominate the saved bytes except under full recompute
MODEL = "layers=2,hidden=64,heads=4,seq=32,vocab=128,tied_embeddings=false,dropout=false"
NAMES = [case_name(sp, rc) for sp, rc in CASES] + [case_name(sp, rc, True) for sp, rc in BF16_CASES]
# Llama-shaped, the same sizes; kv_heads (a multiple of tp) at tp 2 and 4: 4 and 2 query heads a group
LLAMA = ("layers=2,hidden=64,heads=8,kv_heads={kv},ffn=160,activation=swiglu,norm=rmsnorm,bias=false,"
         "learned_positions=false,tied_embeddings=false,dropout=false,seq=32,vocab=128")
FLASH_NAMES = [case_name(sp, rc, False, "flash") for sp, rc in CASES]  # at world 2: the time a case costs
RUNS = [("gpt", 2), ("gpt", 4), ("llama", 2), ("llama", 4)]


@pytest.fixture(scope="module", params=RUNS, ids=lambda r: f"world{r[1]}" if r[0] == "gpt" else f"llama-world{r[1]}")
def results(request, tmp_path_factory):
    kind, world = request.param
    model, names = (MODEL, NAMES) if kind == "gpt" else (LLAMA.format(kv=world), NAMES + FLASH_NAMES * (world == 2))
    data = run_rank_check(tmp_path_factory, "validate.tp_check", world, "--model", model, "--mbs", "2",
                          "--cases", "all" if kind == "gpt" else ",".join(names))
    assert [c["case"] for c in data["cases"]] == names
    return data


def test_the_harness_builds_a_llama_shaped_model():
    """A Llama-shaped spec gives validate.gpt's model RMSNorm, rotary positions (no position
    embedding), grouped-query attention, a SwiGLU MLP of ffn columns and no biases; a GPT spec its
    own layers, with the same parameter names."""
    import torch

    from validate.gpt import GPT, GPTConfig, GroupedAttention
    from validate.llama import RMSNorm

    llama = GPT(GPTConfig.from_spec(load_model(LLAMA.format(kv=2))))
    names = {n: tuple(p.shape) for n, p in llama.named_parameters()}
    assert llama.pos is None and not any("bias" in n for n in names)
    assert isinstance(llama.ln_f, RMSNorm) and isinstance(llama.blocks[0].attn, GroupedAttention)
    assert names["blocks.0.attn.qkv.weight"] == (64 + 2 * 2 * 8, 64)  # h + 2 kv_heads x head_dim
    assert names["blocks.0.mlp.fc1.weight"] == (2 * 160, 64) and names["blocks.0.mlp.fc2.weight"] == (64, 160)
    gpt = GPT(GPTConfig.from_spec(load_model(MODEL)))
    assert {n for n in names} <= {n for n, _ in gpt.named_parameters()}
    assert isinstance(gpt.ln_f, torch.nn.LayerNorm) and gpt.pos is not None


@pytest.mark.multiprocess
def test_loss_and_gradients_equal_single_process(results):
    for case in results["cases"]:
        if case["bf16"]:
            continue
        for rank in case["ranks"]:
            assert rank["loss"] == pytest.approx(rank["reference_loss"], rel=LOSS_RTOL), case["case"]
            assert rank["grad_max_abs_error"] <= GRAD_ATOL, case["case"]
            assert rank["grad_max_abs"] > 1e-3  # the gradients compared are not trivially zero
            assert rank["partial_grads"] == [], case["case"]  # finish_gradients reduced them all


@pytest.mark.multiprocess
def test_bf16_loss_and_gradients_near_fp32_reference(results):
    bf16 = [c for c in results["cases"] if c["bf16"]]
    assert len(bf16) == len(BF16_CASES)
    for case in bf16:
        for rank in case["ranks"]:
            assert rank["dtype"] == "bf16"
            assert rank["loss"] == pytest.approx(rank["reference_loss"], rel=BF16_LOSS_RTOL), case["case"]
            assert rank["loss"] != rank["reference_loss"]  # it did run in bf16
            assert rank["grad_max_abs_error"] <= BF16_GRAD_RTOL * rank["grad_max_abs"], case["case"]
            assert rank["partial_grads"] == [], case["case"]


@pytest.mark.multiprocess
def test_saved_activation_bytes_equal_perfsim(results):
    """What the forward saves for backward, priced as perfsim prices it, against
    layout_activation_bytes x layers + memory_breakdown's head term, like for like (a flash
    kernel under selective recomputation too: the checkpoint drops its log-sum-exp, as perfsim
    does since 2026-11; tests/test_validate_attention.py finds it in one process)."""
    model = load_model(results["model"])
    for case in results["cases"]:
        for rank in case["ranks"]:
            name, saved = case["case"], rank["saved_bytes"]
            counted, expected = saved["counted"], saved["perfsim"]
            assert counted["by_kind"]["activation"] == pytest.approx(expected["like"], rel=1e-12), name
            layers = {k: v for k, v in counted["by_region"].items() if k.startswith("layer")}
            assert len(layers) == 2, name
            for region in layers.values():
                assert region["activation"] == pytest.approx(expected["layer_like"], rel=1e-12), name
            edge = sum(counted["by_region"][r].get("activation", 0.0) for r in ("embedding", "head", "loss")
                       if r in counted["by_region"])
            assert edge == pytest.approx(expected["edge_like"], rel=1e-12), name
            assert set(counted["by_kind"]) <= {"activation", "norm_stats", "mask", "index", "scalar"}, name
            assert counted["total"] == pytest.approx(expected["like"], rel=SAVED_RTOL), name
            # no layer saves a mask: the causal mask is the scores' baddbmm input, which backward
            # does not need (the loss saves one of its own: which targets fall in this rank's columns)
            assert not any("mask" in v for k, v in counted["by_region"].items() if k != "loss"), name


@pytest.mark.multiprocess
def test_sequence_parallel_keeps_gathered_linear_inputs(results):
    """torch's SP keeps the all-gathered QKV and FC1 inputs (Megatron keeps the shard and gathers
    again in backward, as perfsim's memory assumes): the one difference from perfsim's layer term."""
    t = results["world"]
    for case in results["cases"]:
        expected = case["ranks"][0]["saved_bytes"]["perfsim"]
        extra = expected["sp_gathered_inputs_per_layer"]
        if case["sp"] and case["recompute"] != "full":
            assert extra == pytest.approx(2 * 2 * 2 * 32 * 64 * (t - 1) / t)  # 2 linears, bf16, b s h
        else:
            assert extra == 0.0


@pytest.mark.multiprocess
def test_bf16_step_saves_what_the_fp32_step_is_priced_at(results):
    """The bf16 step saves the same storages as the fp32 one, each floating one at 2 bytes: the
    re-pricing of the fp32 run is what a bf16 step holds; the loss, taken on fp32 logits as
    Megatron takes it, keeps fp32 (4 bytes), as perfsim prices it, and so does an RMSNorm its
    1/rms per token (as Transformer Engine's; perfsim counts no norm statistics)."""
    rmsnorm = load_model(results["model"]).norm == "rmsnorm"
    by_case = {c["case"]: c["ranks"][0]["saved_bytes"] for c in results["cases"]}
    for sp, rc in BF16_CASES:
        fp32, bf16 = by_case[case_name(sp, rc)], by_case[case_name(sp, rc, True)]
        shapes = [(i["region"], i["shape"]) for i in fp32["items"]]
        assert [(i["region"], i["shape"]) for i in bf16["items"]] == shapes
        for item in bf16["items"]:
            if item["dtype"] in ("int64", "bool"):
                continue
            size = 4 if item["region"] == "loss" or (rmsnorm and item["shape"][-1] == 1) else 2
            assert item["dtype"] == ("float32" if size == 4 else "bfloat16"), item
            assert item["storage_bytes"] == size * item["storage_elements"], item


@pytest.mark.multiprocess
def test_flops_collectives_and_params_equal_perfsim(results):
    for case in results["cases"]:
        for rank in case["ranks"]:
            name = case["case"]
            assert rank["flops"]["counted"] == rank["flops"]["perfsim"], name
            counted, expected = rank["sent_bytes"]["counted"], rank["sent_bytes"]["perfsim"]
            for kind in ("all_reduce", "all_gather", "reduce_scatter"):
                assert counted.get(kind, 0.0) == pytest.approx(expected[kind], rel=1e-12), (name, kind)
            assert rank["sent_bytes"]["other_in_step"] == {}, name
            assert rank["params"]["counted"] == rank["params"]["perfsim"], name


@pytest.mark.multiprocess
def test_sequence_parallel_moves_what_1d_moves(results):
    """Korthikanti: SP replaces each all-reduce by an all-gather plus a reduce-scatter, same bytes;
    the only extra is the gradient sync of the sequence-split parameters (outside perfsim)."""
    by_case = {c["case"]: c["ranks"][0] for c in results["cases"] if not c["bf16"]}
    for rc in ("none", "selective", "full"):
        plain, sp = by_case[f"1d-{rc}"]["sent_bytes"]["counted"], by_case[f"1d+sp-{rc}"]["sent_bytes"]["counted"]
        assert sum(sp.values()) == pytest.approx(sum(plain.values()))
        assert by_case[f"1d-{rc}"]["sent_bytes"]["gradient_sync"] == {}
        assert by_case[f"1d+sp-{rc}"]["sent_bytes"]["gradient_sync"]["all_reduce"] > 0


@pytest.mark.multiprocess
def test_gloo_sends_an_all_reduce_for_each_reduce_scatter(results):
    for case in results["cases"]:
        sent = case["ranks"][0]["sent_bytes"]
        asked, wire = sent["as_asked_fp32"], sent["gloo_wire_fp32"]
        assert wire.get("all_reduce", 0.0) == pytest.approx(asked.get("all_reduce", 0.0))
        assert wire.get("all_gather", 0.0) == pytest.approx(asked.get("all_gather", 0.0))
        assert wire.get("reduce_scatter", 0.0) == pytest.approx(2 * asked.get("reduce_scatter", 0.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_equals_torchs_and_keeps_one_fp32_buffer(dtype):
    """validate.loss.cross_entropy: torch's F.cross_entropy on fp32 logits, loss and gradient, and
    in backward no fp32 tensor of the logits' size besides the one it kept (Megatron's in-place
    gradient; torch's allocates two)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from validate.loss import cross_entropy

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(96, 500, generator=g)).to(dt).requires_grad_()
    targets = torch.randint(500, (96,), generator=g)
    ours = cross_entropy(logits, targets)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ours.backward()
    grad, logits.grad = logits.grad.clone(), None
    theirs = F.cross_entropy(logits.float(), targets)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as torchs:
        theirs.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-6)
    if dtype == "float32":
        assert torch.allclose(grad, logits.grad, rtol=0, atol=1e-7)
    else:
        # Both round an fp32 gradient to bf16; the fp32 exp differs in its last bits between CPU
        # kernels (AVX2 vs AVX-512), which can flip a rounding: at most one bf16 step (2^-7 relative).
        assert torch.allclose(grad.float(), logits.grad.float(), rtol=2**-7, atol=0)
    fp32_size = 4 * 96 * 500

    def large(p):
        return sum(1 for e in p.events() if e.cpu_memory_usage >= fp32_size)
    assert large(prof) == 0 and large(torchs) >= 2  # ours: in place (bf16: half the size); torch's: two
