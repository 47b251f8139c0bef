"""Scaling studies: the SMNG-P2 protocol against the paper, and the loss decomposition."""

import json

import pytest

import perfsim
from perfsim.cli import main
from perfsim.reproduce import (SMNG_PUBLISHED_EFFICIENCY, fit_network_efficiency, smng_scaling)
from perfsim.scaling import scale


@pytest.fixture(scope="module")
def results():
    return smng_scaling()


@pytest.mark.parametrize("kind", ["weak", "strong"])
def test_smng_efficiency_at_128_nodes_within_4_points(results, kind):
    assert results[kind][-1].nodes == 128
    assert abs(results[kind][-1].efficiency - SMNG_PUBLISHED_EFFICIENCY[kind]) <= 0.04


@pytest.mark.parametrize("kind", ["weak", "strong"])
def test_loss_decomposition_adds_up(results, kind):
    for point in results[kind]:
        assert sum(point.loss_points.values()) == pytest.approx(100 * (1 - point.efficiency), abs=1e-9)


def test_strong_scaling_loses_to_the_bubble_and_weak_to_data_parallel_traffic(results):
    strong, weak = results["strong"][-1].loss_points, results["weak"][-1].loss_points
    assert max(strong, key=strong.get) == "pp_bubble"
    assert max(weak, key=weak.get) == "dp_comm"


def test_the_calibrated_profile_value_is_the_fit():
    """The number marked calibrated in hwprofiles/smng-p2.toml is what the fit gives."""
    profile = perfsim.load_system("smng-p2")
    assert profile.provenance["collectives.network_efficiency"][0] == "calibrated"
    assert fit_network_efficiency(profile) == pytest.approx(profile.collectives.network_efficiency, rel=0.02)


def test_175b_stays_near_ten_percent_of_peak(results):
    base = results["weak"][0].prediction
    assert 0.075 <= base.megatron_ds_tflops_per_device / base.peak_tflops_per_device <= 0.125


def test_weak_scaling_keeps_microbatches_per_pipeline():
    base = perfsim.Plan(tp=2, pp=2, dp=2, mbs=2, gbs=32)
    points = scale(perfsim.load_model("gpt3-1.3b"), perfsim.load_system("dgx-a100"), base, [1, 2, 4], weak=True)
    assert [p.prediction.plan.gbs for p in points] == [32, 64, 128]
    assert {p.prediction.plan.microbatches for p in points} == {8}


def test_scale_json(capsys):
    assert main(["scale", "--weak", "--json", "--nodes", "16,32"]) == 0
    out = json.loads(capsys.readouterr().out)
    point = out["points"][1]
    assert {"nodes", "devices", "global_batch", "step_time_s", "tokens_per_s", "efficiency", "time_breakdown_s"} <= set(point)
    assert out["points"][0]["efficiency"] == 1.0 and point["global_batch"] == 600


@pytest.mark.parametrize("argv", [["--weak", "--nodes", "16,x"], ["--strong", "--nodes", "16,0"],
                                  ["--strong", "--nodes", "16,48", "--gbs", "300"], ["--nodes", "16"]])
def test_bad_scale_input(capsys, argv):
    code = main(["scale", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("perfsim: error: ")
