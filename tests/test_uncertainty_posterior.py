"""Conditioning on observations (issue 16 item 2): a consistent observation narrows the spread,
an impossible one is named, bad observation files are one-line errors, the posterior cache is
keyed by its inputs, and the dgx-a100 odd/even test of the method."""

from __future__ import annotations

import os

import numpy as np
import pytest

from perfsim.cost.columns import columns_of
from perfsim.predict import predict
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system
from perfsim.uncertainty.holdout import mean_error, sc21_odd_even
from perfsim.uncertainty.posterior import profile_draws
from perfsim.uncertainty.sampling import draw, evaluate_draws

from profile_toml import HWPROFILES

PLAN = "{ tp = 8, pp = 2, dp = 4, mbs = 1, gbs = 64, recompute = \"full\" }"
CASE = ("--model", "sc21-39.1b", "--tp", "8", "--pp", "2", "--devices", "64", "--gbs", "64", "--recompute", "full")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFSIM_CACHE_DIR", str(tmp_path / "cache"))


def _observation(name="row", quantity="hardware_tflops_per_device", value=140.0, tolerance=3.0, plan=PLAN,
                 devices=64, extra=""):
    return (f'[[observation]]\nname = "{name}"\nsource = "a test"\nmodel = "sc21-39.1b"\nplan = {plan}\n'
            f"devices = {devices}\nquantity = \"{quantity}\"\nvalue = {value}\ntolerance = {tolerance}\n{extra}")


def _profile(tmp_path, observations: str) -> str:
    """dgx-a100 naming an observations file in tmp_path."""
    with open(os.path.join(HWPROFILES, "dgx-a100.toml"), encoding="utf-8") as fh:
        text = fh.read().replace("schema = 1\n", "schema = 1\nobservations = \"obs.toml\"\n", 1)
    (tmp_path / "obs.toml").write_text("schema = 1\n" + observations, encoding="utf-8")
    path = tmp_path / "a100-observed.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def _point_rate() -> float:
    plan = Plan(tp=8, pp=2, dp=4, mbs=1, gbs=64, recompute="full")
    return predict("sc21-39.1b", "dgx-a100", plan).hardware_tflops_per_device


def test_a_consistent_observation_narrows_the_spread(run_cli, tmp_path):
    target = _point_rate() * 0.97
    result = run_cli("predict", "--json", "--uncertainty", "--samples", "128", "--system",
                     _profile(tmp_path, _observation(value=target)), *CASE)
    assert result.code == 0 and result.err == "", result.err
    prior = run_cli("predict", "--json", "--uncertainty", "--samples", "128", "--system", "dgx-a100",
                    *CASE).json()["uncertainty"]
    post = result.json()["uncertainty"]
    width = lambda q: q["p90"] - q["p10"]  # noqa: E731
    assert width(post["step_time_s"]) < 0.6 * width(prior["step_time_s"])
    # the step time that 0.97 x the point's rate stands for lies inside the posterior's spread
    point_step = result.json()["step_time_s"]
    assert post["step_time_s"]["p10"] <= point_step / 0.97 <= post["step_time_s"]["p90"]


def test_an_impossible_observation_is_named(run_cli, tmp_path):
    observations = _observation(name="fine", value=_point_rate()) + "\n" + _observation(name="ten times faster",
                                                                                     value=_point_rate() * 10)
    result = run_cli("predict", "--json", "--uncertainty", "--samples", "64", "--system",
                     _profile(tmp_path, observations), *CASE)
    assert result.code == 0, result.err
    assert result.err.startswith("perfsim: note: cannot explain observation 'ten times faster'"), result.err
    assert "'fine'" not in result.err and result.err.count("\n") == 1
    assert result.json()["uncertainty"]["samples"] == 64


def test_scaling_observations_use_the_scaled_plan(tmp_path):
    weak = _observation(name="weak", quantity="weak_scaling_efficiency", value=0.9, tolerance=0.05, devices=512)
    system = load_system(_profile(tmp_path, weak))
    draws, posterior = profile_draws(system, 16)
    obs = posterior.observations[0]
    base, scaled = obs.plans()
    assert (scaled.dp, scaled.gbs) == (32, 512)  # 8 x the replicas, 8 x the batch, micro-batches kept
    m = obs.model
    r0, r1 = (evaluate_draws(m, posterior.prior, columns_of(p)) for p in (base, scaled))
    assert np.allclose(posterior.predicted["weak"], r0["step_time_s"] / r1["step_time_s"])


@pytest.mark.parametrize("observations,needle", [
    (_observation().replace("tolerance = 3.0\n", ""), "observation[0] has no tolerance"),
    (_observation(quantity="speed"), "observation[0].quantity must be one of"),
    (_observation(tolerance=-1), "observation[0].tolerance must be a positive number"),
    (_observation(value="nan"), "observation[0].value must be a positive number"),
    (_observation(devices=63), "observation[0].devices is 63 but the plan has"),
    (_observation(plan="{ tp = 3, pp = 2, dp = 4, mbs = 1, gbs = 64 }"), "observation[0].plan"),
    (_observation(plan="{ tp = 8, pipeline = 2 }"), "observation[0].plan"),
    (_observation(extra="colour = 1\n"), "unknown key observation[0].colour"),
    (_observation(quantity="weak_scaling_efficiency", devices=100), "must be a multiple of the plan's 64"),
    ("", "no [[observation]] tables"),
])
def test_a_bad_observations_file_is_one_line(run_cli, tmp_path, observations, needle):
    result = run_cli("predict", "--uncertainty", "--system", _profile(tmp_path, observations), *CASE)
    assert result.code == 2 and result.err.count("\n") == 1, result.err
    assert needle in result.err and "obs.toml" in result.err, result.err


def test_a_missing_observations_file_is_one_line(run_cli, tmp_path):
    path = _profile(tmp_path, _observation())
    os.remove(tmp_path / "obs.toml")
    result = run_cli("predict", "--uncertainty", "--system", path, *CASE)
    assert result.code == 2 and result.err.count("\n") == 1 and "obs.toml" in result.err, result.err


def _posteriors(tmp_path) -> list:
    """The cached posteriors (the cache folder may hold other things, e.g. Sobol designs)."""
    return sorted(f for f in os.listdir(tmp_path / "cache") if f.startswith("posterior-"))


def test_the_posterior_cache_follows_its_inputs(tmp_path):
    path = _profile(tmp_path, _observation(value=_point_rate()))
    first = profile_draws(load_system(path), 32)[1]
    cached = _posteriors(tmp_path)
    assert len(cached) == 1
    again = profile_draws(load_system(path), 32)[1]
    assert np.array_equal(first.weights, again.weights) and _posteriors(tmp_path) == cached
    (tmp_path / "obs.toml").write_text("schema = 1\n" + _observation(value=_point_rate() * 0.9))
    changed = profile_draws(load_system(path), 32)[1]
    assert len(_posteriors(tmp_path)) == 2 and not np.array_equal(first.weights, changed.weights)


def test_the_posterior_cache_follows_a_model_file_an_observation_names(tmp_path):
    """The observations file names a model file; changing only that file must not reuse the
    posterior conditioned on the old model."""
    model_file = tmp_path / "observed-model.toml"
    model_file.write_text("layers = 48\nhidden = 8192\nheads = 64\nseq = 2048\nvocab = 51200\n")
    observation = _observation(value=_point_rate()).replace('model = "sc21-39.1b"', f'model = "{model_file}"')
    path = _profile(tmp_path, observation)
    first = profile_draws(load_system(path), 32)[1]
    model_file.write_text("layers = 24\nhidden = 8192\nheads = 64\nseq = 2048\nvocab = 51200\n")
    changed = profile_draws(load_system(path), 32)[1]
    assert len(_posteriors(tmp_path)) == 2
    assert not np.array_equal(first.predicted["row"], changed.predicted["row"])


def test_smng_p2_conditions_on_the_papers_three_observations(run_cli):
    result = run_cli("predict", "--json", "--uncertainty", "--samples", "16")
    assert result.code == 0, result.err
    system = load_system("smng-p2")
    _, posterior = profile_draws(system, 16)
    assert [o.quantity for o in posterior.observations] == ["megatron_ds_tflops_per_device", "weak_scaling_efficiency",
                                                           "strong_scaling_efficiency"]
    assert posterior.observations[0].value == pytest.approx(0.10 * system.device.peak_flops_bf16 / 1e12, rel=1e-3)


def test_dgx_a100_conditioned_on_odd_sc21_rows_predicts_the_even_rows():
    """The issue's test that can fail: the posterior predictive's P10-P90 of a published rate covers
    at least 4 of the 5 held-out rows, and the median's mean error is no worse than the point
    prediction's (docs/validation.md has the table; the model's own P10-P90, without the error
    term the rows were conditioned with, covers 1-4 of them depending on the seed)."""
    posterior, held = sc21_odd_even(samples=512, comm_points=64)
    assert len(held) == 5 and [h.row.params_billion for h in held] == [3.6, 18.4, 76.1, 310.1, 1008.0]
    assert sum(h.predictive_covered for h in held) >= 4, [(h.row.tflops_per_gpu, h.predictive_p10, h.predictive_p90)
                                                          for h in held]
    assert mean_error(held, "p50") <= mean_error(held, "point")
    for h in held:  # the predictive interval holds the model's: it only adds the error term
        assert h.predictive_p10 <= h.p10 <= h.p50 <= h.p90 <= h.predictive_p90
