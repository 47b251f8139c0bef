"""validate.tp_overhead: Megatron's 1d layer, written here as the reference the DTensor layer's
overhead is measured against, computes what the DTensor layer computes (so their time difference
is DTensor's alone), and the timing record has what the calibration fit reads."""

from __future__ import annotations


import pytest

pytest.importorskip("torch")

from conftest import run_rank_check  # noqa: E402
from validate.microbench import TP_OVERHEAD_LAYOUTS as LAYOUTS  # noqa: E402
from validate.tp_overhead import overhead  # noqa: E402

# fp32, one layer of hidden 64: the two differ only in the order partial sums are added
ATOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_rank_check(tmp_path_factory, "validate.tp_overhead", 2)


@pytest.mark.multiprocess
def test_megatrons_layer_computes_what_the_dtensor_layer_computes(results):
    assert [c["case"] for c in results["cases"]] == list(LAYOUTS)
    for case in results["cases"]:
        for rank in case["ranks"]:
            same = rank["same"]
            assert same["output_max"] > 0.1, case["case"]  # a real output, not zeros
            for what in ("output", "input_grad", "weight_grad"):
                assert same[what] <= ATOL, (case["case"], what, same[what])


@pytest.mark.multiprocess
def test_the_timing_record_pairs_every_round(results):
    for case in results["cases"]:
        records = [rank["record"] for rank in case["ranks"]]
        assert records[0]["times_s"] == records[1]["times_s"]  # the slowest rank's, on every rank
        times = records[0]["times_s"]
        for name in ("dtensor", "megatron"):
            forward, backward = times[name]
            assert len(forward) == len(backward) == 3 and min(forward + backward) > 0
        assert overhead(times) == {k: records[0][k] for k in ("forward_s", "backward_s")}


def test_overhead_is_the_median_of_the_rounds_differences():
    times = {"dtensor": ([5.0, 9.0, 6.0], [10.0, 10.0, 30.0]), "megatron": ([4.0, 4.0, 4.0], [8.0, 9.0, 9.0])}
    assert overhead(times) == {"forward_s": 2.0, "backward_s": 2.0}


@pytest.mark.multiprocess
def test_the_checkpoint_diagnostic_pairs_every_round(tmp_path_factory):
    """`--checkpoint-shape`: the checkpointed DTensor layer against the plain one, each round's
    extra recorded, the same on every rank."""
    results = run_rank_check(tmp_path_factory, "validate.tp_overhead", 2, "--cases", "1d", "--repeats", "3",
                             "--checkpoint-shape", "64,4,16,2")
    ranks = results["cases"][0]["ranks"]
    checkpoint = ranks[0]["checkpoint"]
    assert ranks[1]["checkpoint"] == checkpoint and len(checkpoint["rounds_s"]) == 3
    assert set(checkpoint) == {"forward_s", "backward_beyond_forward_s", "rounds_s"}
