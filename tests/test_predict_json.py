"""`perfsim predict --json`: the object README.md documents, the built-in case, and the SMNG-P2 authors' plans."""

from __future__ import annotations

import math

import pytest

import perfsim

TOP_KEYS = {
    "devices", "step_time_s", "tokens_per_s", "samples_per_s", "model_flops_per_step", "hardware_flops_per_step",
    "model_tflops_per_device", "hardware_tflops_per_device", "mfu", "hfu", "time_breakdown_s", "memory_bytes",
    "device_memory_bytes", "fits", "plan", "model", "system", "megatron_ds_tflops_per_device",
}
TIME_KEYS = {"compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "pp_bubble", "dp_comm", "optimizer", "other",
             "synchrony"}
MEMORY_KEYS = {"weights", "gradients", "optimizer", "activations", "buffers", "total"}
PLAN_KEYS = {"tp", "tp_mode", "tp_depth", "sp", "pp", "vpp", "schedule", "dp", "zero", "mbs", "gbs", "recompute", "order"}


@pytest.fixture
def builtin(run_cli):
    result = run_cli("predict", "--json")
    assert result.code == 0, result.err
    assert result.err == ""
    return result.json()


def test_json_has_every_documented_key(builtin):
    assert TOP_KEYS <= set(builtin)
    assert set(builtin["time_breakdown_s"]) == TIME_KEYS
    assert set(builtin["memory_bytes"]) == MEMORY_KEYS
    assert PLAN_KEYS <= set(builtin["plan"])  # the 13 documented knobs (later ones may follow)
    assert isinstance(builtin["model"], dict) and isinstance(builtin["system"], str)
    assert isinstance(builtin["fits"], bool)


def test_builtin_case_is_the_smng_p2_175b_run(builtin):
    assert builtin["system"] == "smng-p2"
    assert builtin["devices"] == 128  # 16 nodes x 8 tiles
    plan = builtin["plan"]
    assert (plan["tp"], plan["pp"], plan["dp"], plan["mbs"], plan["gbs"], plan["zero"], plan["recompute"]) == \
        (8, 16, 1, 3, 300, 1, "full")
    assert plan["tp_mode"] == "1d" and plan["sp"] is False and plan["vpp"] == 1
    model = builtin["model"]
    assert model["name"] == "gpt3-175b"
    assert (model["layers"], model["hidden"], model["heads"], model["seq"], model["vocab"]) == (96, 12288, 96, 2048, 50257)
    assert builtin["fits"] is True
    assert builtin["memory_bytes"]["total"] <= builtin["device_memory_bytes"] == 64e9


def test_builtin_numbers_are_consistent(builtin):
    j = builtin
    step = j["step_time_s"]
    assert step > 0 and all(math.isfinite(v) for v in j["time_breakdown_s"].values())
    assert sum(j["time_breakdown_s"].values()) == pytest.approx(step, rel=1e-9)
    assert sum(v for k, v in j["memory_bytes"].items() if k != "total") == pytest.approx(j["memory_bytes"]["total"], rel=1e-9)
    assert j["tokens_per_s"] == pytest.approx(300 * 2048 / step, rel=1e-12)
    assert j["samples_per_s"] == pytest.approx(300 / step, rel=1e-12)
    # GPT-3 175B, vocabulary padded to 51200 at TP 8, 4 passes with full recompute (logits 3)
    l, h, s, V, B = 96, 12288, 2048, 51200, 300
    layer = 24 * s * h * h + 4 * s * s * h
    assert j["model_flops_per_step"] == pytest.approx(B * 3 * (l * layer + 2 * s * h * V), rel=1e-12)
    assert j["hardware_flops_per_step"] == pytest.approx(B * (4 * l * layer + 3 * 2 * s * h * V), rel=1e-12)
    assert j["hardware_tflops_per_device"] == pytest.approx(j["hardware_flops_per_step"] / step / 128 / 1e12, rel=1e-12)
    assert j["hfu"] == pytest.approx(j["hardware_tflops_per_device"] * 1e12 / 419.4e12, rel=1e-12)
    assert j["mfu"] == pytest.approx(j["model_tflops_per_device"] * 1e12 / 419.4e12, rel=1e-12)
    assert 0 < j["mfu"] < j["hfu"] < 1


def test_builtin_text_output_matches_json(run_cli, builtin):
    text = run_cli("predict")
    assert text.code == 0 and text.err == ""
    assert "gpt3-175b" in text.out and "smng-p2" in text.out and "fits" in text.out


def test_explicit_flags_reproduce_builtin(run_cli, builtin):
    result = run_cli("predict", "--json", "--model", "gpt3-175b", "--system", "smng-p2", "--nodes", "16", "--tp", "8",
                     "--pp", "16", "--mbs", "3", "--gbs", "300", "--zero", "1", "--recompute", "full")
    assert result.code == 0, result.err
    assert result.json() == builtin


def test_dp_is_derived_from_devices(run_cli):
    result = run_cli("predict", "--json", "--model", "gpt3-1.3b", "--system", "dgx-a100", "--nodes", "2", "--tp", "2",
                     "--pp", "2")
    assert result.code == 0, result.err
    plan = result.json()["plan"]
    assert result.json()["devices"] == 16 and plan["dp"] == 4 and plan["gbs"] == 4  # gbs defaults to mbs x dp


def test_vpp_implies_interleaved(run_cli):
    result = run_cli("predict", "--json", "--model", "gpt3-1.3b", "--system", "dgx-a100", "--devices", "4", "--pp", "4",
                     "--vpp", "2", "--gbs", "8")
    assert result.code == 0, result.err
    assert result.json()["plan"]["schedule"] == "interleaved"


def test_inline_model_spec(run_cli):
    result = run_cli("predict", "--json", "--model", "layers=4,hidden=256,heads=4,seq=128,vocab=1000,ffn=512,kv_heads=2",
                     "--system", "cpu-example", "--devices", "2")
    assert result.code == 0, result.err
    model = result.json()["model"]
    assert (model["layers"], model["hidden"], model["ffn"], model["kv_heads"]) == (4, 256, 512, 2)


SMNG_RUNS = [
    # preset, devices, tp, pp, dp, zero, mbs, gbs (shared/reference/published.md, section 1)
    ("smng-p2-3.6b", 8, 1, 1, 8, 2, 8, 64),
    ("smng-p2-20b", 32, 8, 4, 1, 1, 1, 8),
    ("smng-p2-175b", 128, 8, 16, 1, 1, 3, 300),
]


@pytest.mark.parametrize("run", SMNG_RUNS, ids=[r[0] for r in SMNG_RUNS])
def test_smng_p2_authors_plans_fit(run):
    name, devices, tp, pp, dp, zero, mbs, gbs = run
    plan = perfsim.Plan(tp=tp, pp=pp, dp=dp, zero=zero, mbs=mbs, gbs=gbs, recompute="full")
    assert perfsim.plan_problems(plan, perfsim.load_model(name), devices) == []
    pred = perfsim.predict(name, "smng-p2", plan)
    assert pred.devices == devices
    assert pred.fits, pred.memory_bytes
    assert pred.memory_bytes["total"] <= 64e9


@pytest.mark.parametrize("run", SMNG_RUNS, ids=[r[0] for r in SMNG_RUNS])
def test_smng_p2_authors_plans_through_cli(run_cli, run):
    name, devices, tp, pp, dp, zero, mbs, gbs = run
    result = run_cli("predict", "--json", "--model", name, "--system", "smng-p2", "--devices", str(devices),
                     "--tp", str(tp), "--pp", str(pp), "--zero", str(zero), "--mbs", str(mbs), "--gbs", str(gbs),
                     "--recompute", "full")
    assert result.code == 0, result.err
    j = result.json()
    assert j["fits"] is True and j["plan"]["dp"] == dp and j["devices"] == devices


def test_175b_without_recompute_does_not_fit():
    """The other side of the memory model: the 175B plan needs activation checkpointing."""
    plan = perfsim.Plan(tp=8, pp=16, dp=1, zero=1, mbs=3, gbs=300, recompute="none")
    assert not perfsim.predict("smng-p2-175b", "smng-p2", plan).fits
