"""validate.zero_overhead: the whole layers with the work perfsim prices issued around them compute
what FSDP2's sharded layers compute, and issue that work (a gather per layer forward, again in
backward under ZeRO-3, a reduce-scatter), so that the time difference is FSDP2's own."""

from __future__ import annotations


import pytest

pytest.importorskip("torch")

from conftest import run_rank_check  # noqa: E402
from validate.zero_overhead import LAYOUTS, MODULES  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_rank_check(tmp_path_factory, "validate.zero_overhead", 2)


@pytest.mark.multiprocess
def test_the_priced_layers_compute_what_fsdp2_computes_and_issue_the_priced_work(results):
    assert [c["case"] for c in results["cases"]] == list(LAYOUTS)
    for case in results["cases"]:
        for rank in case["ranks"]:
            same = rank["same"]
            assert same["output_scale"] > 0.1, case["case"]  # a real output, not zeros
            assert same["output"] <= 1e-5 and same["input_grad"] <= 1e-5, (case["case"], same)
            assert same["gathers"] == [2 if case["case"] == "zero3" else 1] * MODULES, case["case"]
            assert same["scatters"] == [1] * MODULES, case["case"]
            assert same["gathered_parts"] == [1.0, 2.0]  # both ranks' shards arrived


@pytest.mark.multiprocess
def test_the_timing_pairs_every_round(results):
    for case in results["cases"]:
        timings = [rank["timing"] for rank in case["ranks"]]
        assert timings[0] == timings[1]  # the slowest rank's times, on every rank
        assert len(timings[0]["rounds_s"]) == 3 and timings[0]["fsdp2_s"] > 0 and timings[0]["priced_s"] > 0
