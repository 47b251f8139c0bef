"""Real 1D tensor-parallel training steps (validate.gpt) on CPU with gloo, world sizes 2 and 4:
loss and gradients equal a single-process reference, and per rank the matrix FLOPs, the bytes
sent per collective kind and the parameters held equal perfsim's numbers for the plan exactly
(validate/tp_check.py says how each side is counted)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from validate.campaign import launch_ranks  # noqa: E402
from validate.tp_check import CASES  # noqa: E402

# Loss: same reduction order up to the vocabulary split; gradients: fp32 sums reordered by the
# sharding (all-reduce of partial products), measured ~2e-8 on gradients of size ~0.1.
LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-6
MODEL = "layers=2,hidden=32,heads=4,seq=16,vocab=512,tied_embeddings=false,dropout=false"


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def results(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / f"world{request.param}.json"
    launch_ranks(["-m", "validate.tp_check", str(out), "--model", MODEL, "--mbs", "2"], request.param,
                 threads=1, what="tp check", resume="see the rank's error above")
    data = json.loads(out.read_text())
    assert data["world"] == request.param
    assert [c["case"] for c in data["cases"]] == [f"1d{'+sp' if sp else ''}-{rc}" for sp, rc in CASES]
    return data


@pytest.mark.multiprocess
def test_loss_and_gradients_equal_single_process(results):
    for case in results["cases"]:
        for rank in case["ranks"]:
            assert rank["loss"] == pytest.approx(rank["reference_loss"], rel=LOSS_RTOL), case["case"]
            assert rank["grad_max_abs_error"] <= GRAD_ATOL, case["case"]
            assert rank["grad_max_abs"] > 1e-3  # the gradients compared are not trivially zero
            assert rank["partial_grads"] == [], case["case"]  # finish_gradients reduced them all


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
    by_case = {c["case"]: c["ranks"][0] for c in results["cases"]}
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
