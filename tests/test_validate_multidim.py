"""Real 2d (world 4 = 2 x 2), 2.5d (world 8 = q 2 x depth 2) and 3d (world 8 = 2 x 2 x 2) tensor-parallel
steps (validate.multidim) on CPU with gloo, every recompute mode (of the GPT; of a Llama-shaped model
every 2d one and three at world 8): loss and gradients equal a
single-process reference, and per rank the matrix FLOPs, the bytes sent per grid axis and collective
kind (embedding, layers, final norm, head), the parameters held and the bytes saved for backward agree
with perfsim (validate/multidim_check.py says how each side is counted; docs/real-steps-multidim.md has
the numbers and what perfsim leaves out)."""

from __future__ import annotations


import pytest

pytest.importorskip("torch")

from conftest import run_rank_check  # noqa: E402
from validate.multidim_check import case_names  # noqa: E402

# Loss: same sums in another order (vocabulary split, LayerNorm statistics as sum and sum of
# squares); gradients: fp32 partial products summed by reduce / reduce-scatter, measured ~2e-8 on
# gradients of size ~0.06.
LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-6
SAVED_RTOL = 0.05  # what saved_tensors_hooks sees against layout_activation_bytes


LLAMA = ("layers=2,hidden=64,heads=8,kv_heads=2,ffn=160,activation=swiglu,norm=rmsnorm,bias=false,"
         "learned_positions=false,tied_embeddings=false,dropout=false,seq=16,vocab=512")
RUNS = {("gpt", 4): case_names(4), ("gpt", 8): case_names(8), ("llama", 4): case_names(4),
        ("llama", 8): ["2.5d-selective", "3d-none", "3d-regather-none"]}


@pytest.fixture(scope="module", params=list(RUNS), ids=lambda r: f"world{r[1]}" if r[0] == "gpt" else f"llama-world{r[1]}")
def results(request, tmp_path_factory):
    kind, world = request.param
    extra = () if kind == "gpt" else ("--model", LLAMA, "--cases", ",".join(RUNS[request.param]))
    data = run_rank_check(tmp_path_factory, "validate.multidim_check", world, *extra)
    assert [c["case"] for c in data["cases"]] == RUNS[request.param]
    return data


def ranks(results):
    for case in results["cases"]:
        for rank in case["ranks"]:
            yield case["case"], rank


@pytest.mark.multiprocess
def test_loss_and_gradients_equal_single_process(results):
    for case in results["cases"]:
        first = case["ranks"][0]  # rank 0 assembled every gradient from all ranks' pieces
        assert first["uncovered_grads"] == [], case["case"]
        assert first["grad_max_abs_error"] <= GRAD_ATOL, case["case"]
        assert first["grad_max_abs"] > 1e-3  # the gradients compared are not trivially zero
        for rank in case["ranks"]:
            assert rank["loss"] == pytest.approx(rank["reference_loss"], rel=LOSS_RTOL), case["case"]


@pytest.mark.multiprocess
def test_grid_is_perfsims(results):
    for name, rank in ranks(results):
        assert rank["axes"] == rank["perfsim_axes"], name


@pytest.mark.multiprocess
def test_flops_equal_perfsim(results):
    for name, rank in ranks(results):
        assert rank["flops"]["counted"] == rank["flops"]["perfsim"], name


def _equal_per_axis_and_kind(name, counted, expected):
    assert set(counted) == set(expected), name
    for key in expected:
        assert counted[key] == pytest.approx(expected[key], rel=1e-12), (name, key)


@pytest.mark.multiprocess
def test_layer_and_head_collectives_equal_perfsim_per_axis_and_kind(results):
    """Layers, the final norm's statistics, the logits and the loss against layer_collectives and
    head_collectives."""
    for name, rank in ranks(results):
        _equal_per_axis_and_kind(name, rank["sent_bytes"]["counted"], rank["sent_bytes"]["perfsim"])
        assert rank["sent_bytes"]["other"] == {}, name  # every collective is classified


@pytest.mark.multiprocess
def test_embedding_collectives_equal_perfsim_per_axis_and_kind(results):
    """The reference's vocabulary-parallel embedding, forward and backward, weight-gradient
    reductions included (2.5d over depth, 3d over weight), against embedding_collectives."""
    for name, rank in ranks(results):
        sent = rank["sent_bytes"]
        _equal_per_axis_and_kind(name, sent["embedding"], sent["perfsim_embedding"])


@pytest.mark.multiprocess
def test_only_the_vector_gathers_are_left_out_of_perfsim(results):
    """perfsim does not model the gathers of biases, norm parameters and positions
    (docs/real-steps-multidim.md); they run only where the vectors' blocks are shared."""
    for name, rank in ranks(results):
        param = rank["sent_bytes"]["param"]
        assert param and all(k.split("/")[0] in ("col", "depth", "input+weight", "weight+output") for k in param), name


@pytest.mark.multiprocess
def test_parameters_equal_stage_params(results):
    """Every parameter the real step holds, the final norm's shard included."""
    for name, rank in ranks(results):
        assert rank["params"]["counted"] == rank["params"]["perfsim"], name


@pytest.mark.multiprocess
def test_saved_activations_within_five_percent_of_perfsim(results):
    for name, rank in ranks(results):
        saved = rank["saved_bytes"]
        for layer in saved["per_layer"]:
            assert layer == pytest.approx(saved["perfsim_per_layer"], rel=SAVED_RTOL), name


def test_3d_loss_statistics_run_on_the_axis_that_splits_the_vocabulary():
    """The logits are the output of a first linear, whose hidden (vocabulary) block lies along
    `input` in 3d (docs/equations.md 4.1); the cross-entropy all-reduces go there."""
    import perfsim
    from perfsim.cost import tensor_parallel as tpc
    from perfsim.cost.columns import columns_of
    from perfsim.spec.model import load_model

    model = load_model("layers=2,hidden=64,heads=4,seq=16,vocab=512")
    plan = perfsim.Plan(tp=8, tp_mode="3d", mbs=4, gbs=4)
    layout = tpc.layout_of(model, columns_of(plan))
    forward, _ = tpc.head_collectives(layout, model, 4, model.padded_vocab(8))
    loss = [x for x in forward if x.kind == tpc.ALL_REDUCE and x.count == 3]
    assert [x.axis for x in loss] == ["input"]
    norm = [x for x in forward if x.kind == tpc.ALL_REDUCE and x.count == 1]  # the final norm's statistics
    assert [x.axis for x in norm] == ["output"]  # the axis that splits the norm region's hidden dimension
    reduce_scatter_axis = [x.axis for x in forward if x.kind == tpc.REDUCE_SCATTER]
    assert reduce_scatter_axis == ["output"]  # the linear's partial sums: its token rows split there
