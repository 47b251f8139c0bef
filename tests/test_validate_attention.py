"""The validation GPT's fused attention (torch's scaled_dot_product_attention, perfsim's
attention = "flash") against its unfused core, in one process (validate/attention_check.py;
docs/real-steps.md, "Fused attention"): same loss and gradients, the FLOPs perfsim counts, no
s x s tensor kept, and the saved bytes perfsim's flash formula gives; for the GPT and for a
Llama-shaped model (grouped-query attention: the unfused core keeps K and V expanded to the query
heads, the fused kernel reads them unexpanded)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from perfsim.spec.model import load_model  # noqa: E402
from validate.attention_check import compare  # noqa: E402

MODELS = {"gpt": load_model("layers=2,hidden=64,heads=4,seq=32,vocab=128,tied_embeddings=false,dropout=false"),
          "llama": load_model("layers=2,hidden=64,heads=8,kv_heads=2,ffn=160,activation=swiglu,norm=rmsnorm,bias=false,"
                              "learned_positions=false,tied_embeddings=false,dropout=false,seq=32,vocab=128")}
MBS = 2
# fp32: the fused kernel sums in another order (blocks, online softmax): measured 1e-8 on
# gradients of ~0.07, the loss equal to the last bit
FP32_LOSS_RTOL, FP32_GRAD_ATOL = 1e-6, 1e-6
# bf16 step against the fp32 reference, as validate.tp_check's bf16 cases: measured loss 1e-4
# relative, gradients 0.7% of the largest
BF16_LOSS_RTOL, BF16_GRAD_RTOL = 1e-2, 3e-2


@pytest.fixture(scope="module", params=[(m, rc, dt) for m in MODELS for rc in ("none", "selective", "full")
                                        for dt in ("fp32", "bf16")],
                ids=lambda p: f"{p[1]}-{p[2]}" if p[0] == "gpt" else f"{p[0]}-{p[1]}-{p[2]}")
def result(request):
    name, recompute, dtype = request.param
    return dict(compare(MODELS[name], MBS, recompute, dtype), model=MODELS[name])


def test_fused_step_equals_unfused_step(result):
    flash, unfused = result["flash"], result["unfused"]
    if result["dtype"] == "fp32":
        assert flash["loss"] == pytest.approx(result["reference_loss"], rel=FP32_LOSS_RTOL)
        assert flash["grad_max_abs_error"] <= FP32_GRAD_ATOL
        assert result["flash_vs_unfused_grad_max_abs_error"] <= FP32_GRAD_ATOL
    else:
        for step in (flash, unfused):
            assert step["loss"] == pytest.approx(result["reference_loss"], rel=BF16_LOSS_RTOL)
            assert step["loss"] != result["reference_loss"]  # it did run in bf16
            assert step["grad_max_abs_error"] <= BF16_GRAD_RTOL * result["grad_max_abs"]
    assert result["grad_max_abs"] > 1e-3  # the gradients compared are not trivially zero


def test_fused_step_runs_one_kernel_and_its_flops_are_perfsims(result):
    """The flash step runs no batched GEMM (the scores never leave the kernel); its counted FLOPs,
    the fused kernel at perfsim's count (forward 2, backward 5 products of 2 b a s^2 d), equal
    perfsim's hardware FLOPs for the plan, as the unfused step's counted products do for its plan."""
    flash, unfused, model = result["flash"], result["unfused"], result["model"]
    assert not any(op in flash["flops_by_op"] for op in ("aten.bmm", "aten.baddbmm"))
    b, a, s, d = MBS, model.heads, model.seq, model.head_dim
    product = 2 * b * a * s * s * d
    forwards = {"none": 1, "selective": 2, "full": 2}[result["recompute"]]  # recomputation repeats the kernel
    assert flash["flops_by_op"]["fused_attention_forward"] == model.layers * forwards * 2 * product
    assert flash["flops_by_op"]["fused_attention_backward"] == model.layers * 5 * product
    for step in (flash, unfused):
        assert step["flops"] == step["perfsim"]["flops"]
    # the only difference: the backward's recomputation of the scores, one product a layer
    assert flash["flops"] - unfused["flops"] == model.layers * product


def test_fused_step_keeps_no_score_matrix(result):
    """Nothing of s x s per head is saved; what is saved, priced as perfsim prices it (the
    log-sum-exp at fp32), is perfsim's flash figure, layer by layer; under selective
    recomputation the checkpoint drops the log-sum-exp too, as perfsim does."""
    flash, unfused, model = result["flash"], result["unfused"], result["model"]
    def squares(step):
        return [i for i in step["saved_items"] if i["shape"][-2:] == [model.seq, model.seq]]
    assert squares(flash) == []
    if result["recompute"] == "none":  # the unfused core keeps its softmax output: the check can fail
        assert len(squares(unfused)) == model.layers
    for step in (flash, unfused):
        expected = step["perfsim"]["saved"]
        assert step["saved"]["by_kind"]["activation"] == expected["like"]
        for i in range(model.layers):
            assert step["saved"]["by_region"][f"layer{i}"]["activation"] == expected["layer_like"]


@pytest.mark.parametrize("name", list(MODELS))
def test_fused_step_peak_memory_is_lower_by_the_scores(name):
    """The allocator's peak (the profiler's running total on CPU): the unfused fp32 step peaks
    higher by what it saves more, the softmax outputs (b a s^2 fp32 a layer) and, with
    grouped-query attention, K and V expanded to the query heads (2 b s (h - h_kv)), less the
    fused kernel's log-sum-exp (b a s fp32 a layer)."""
    model = MODELS[name]
    result = compare(model, MBS, "none", "fp32")
    b, a, s = MBS, model.heads, model.seq
    kept_more = model.layers * 4 * (b * a * s * s - b * a * s + 2 * b * s * (model.hidden - model.kv_hidden))
    saved = result["unfused"]["saved"]["as_run"] - result["flash"]["saved"]["as_run"]
    assert saved == kept_more
    difference = result["unfused"]["peak_bytes"] - result["flash"]["peak_bytes"]
    # measured 4 to 132 bytes more (small allocations of the step, scalars, land differently)
    assert difference == pytest.approx(kept_more, rel=0.01)
