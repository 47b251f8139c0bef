"""Bad input: one line `perfsim: error: ...` on stderr, exit status 2, no traceback (README.md, "Use")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from profile_toml import write_variant

SMALL = "layers=2,hidden=64,heads=4,seq=8,vocab=10"

# (id, argv after `predict`, a word the message must contain so that it fails for the right reason)
CLI_CASES = [
    ("unknown-preset", ["--model", "gpt3-9000b"], "unknown model"),
    ("unknown-system", ["--system", "frontier-xyz"], "unknown system"),
    ("empty-model", ["--model", ""], "unknown model"),
    ("empty-system", ["--system", ""], "unknown system"),
    ("inline-missing-equals", ["--model", "layers=2,hidden"], "key=value"),
    ("inline-empty-value", ["--model", SMALL + ",ffn="], "key=value"),
    ("inline-not-integer", ["--model", "layers=two,hidden=64,heads=4,seq=8,vocab=10"], "whole number"),
    ("inline-float", ["--model", "layers=2,hidden=64.5,heads=4,seq=8,vocab=10"], "whole number"),
    ("inline-missing-vocab", ["--model", "layers=2,hidden=64,heads=4,seq=8"], "vocab"),
    ("inline-unknown-key", ["--model", SMALL + ",experts=8"], "experts"),
    ("inline-bad-norm", ["--model", SMALL + ",norm=batchnorm"], "norm"),
    ("inline-bad-bool", ["--model", SMALL + ",gated_mlp=3"], "gated_mlp"),
    ("layers-zero", ["--model", "layers=0,hidden=64,heads=4,seq=8,vocab=10"], "layers"),
    ("negative-ffn", ["--model", SMALL + ",ffn=-4"], "ffn"),
    ("hidden-not-multiple-of-heads", ["--model", "layers=2,hidden=65,heads=4,seq=8,vocab=10"], "multiple of heads"),
    ("kv-heads-not-dividing-heads", ["--model", SMALL + ",kv_heads=3"], "kv_heads"),
    ("tp-zero", ["--tp", "0"], "--tp"),
    ("tp-not-a-number", ["--tp", "eight"], "--tp"),
    ("mbs-negative", ["--mbs", "-1"], "--mbs"),
    ("gbs-zero", ["--gbs", "0"], "--gbs"),
    ("nodes-zero", ["--nodes", "0"], "--nodes"),
    ("zero-stage-4", ["--zero", "4"], "--zero"),
    ("tp-not-dividing-heads", ["--model", "gpt3-1.3b", "--devices", "3", "--tp", "3"], "heads"),
    ("devices-not-multiple-of-tp", ["--model", "gpt3-1.3b", "--devices", "10", "--tp", "4"], "10 devices"),
    ("dp-mismatch", ["--model", "gpt3-1.3b", "--devices", "8", "--dp", "3"], "does not match"),
    ("dp-mismatch-nodes", ["--model", "gpt3-1.3b", "--system", "dgx-a100", "--nodes", "2", "--tp", "8", "--dp", "1"], "does not match"),
    ("gbs-not-multiple", ["--model", "gpt3-1.3b", "--devices", "8", "--mbs", "2", "--gbs", "20"], "multiple of mbs x dp"),
    ("pp-not-dividing-layers", ["--model", "gpt3-1.3b", "--devices", "5", "--pp", "5"], "24 layers"),
    ("vpp-not-dividing-layers", ["--model", "gpt3-1.3b", "--devices", "4", "--pp", "4", "--vpp", "5", "--gbs", "4"], "layers"),
    ("vpp-without-interleaved", ["--model", "gpt3-1.3b", "--devices", "2", "--pp", "2", "--vpp", "2", "--schedule", "1f1b"], "interleaved"),
    ("interleaved-without-vpp", ["--model", "gpt3-1.3b", "--devices", "2", "--pp", "2", "--schedule", "interleaved", "--gbs", "4"], "--vpp"),
    ("interleaved-without-pp", ["--model", "gpt3-1.3b", "--devices", "1", "--vpp", "2", "--gbs", "4"], "pp"),
    ("interleaved-microbatches", ["--model", "gpt3-1.3b", "--devices", "4", "--pp", "4", "--vpp", "2", "--gbs", "6"], "multiple of pp"),
    ("sp-with-2d", ["--model", "gpt3-1.3b", "--devices", "4", "--tp", "4", "--tp-mode", "2d", "--sp"], "--sp"),
    ("tp-depth-without-2.5d", ["--model", "gpt3-1.3b", "--devices", "1", "--tp-depth", "2"], "tp_depth"),
    ("sp-seq-not-divisible", ["--model", "layers=2,hidden=64,heads=4,seq=6,vocab=10", "--devices", "4", "--tp", "4", "--sp"], "sequence length"),
    ("nodes-and-devices", ["--nodes", "1", "--devices", "8"], "not allowed"),
    ("unknown-tp-mode", ["--tp-mode", "4d"], "--tp-mode"),
    ("unknown-schedule", ["--schedule", "zb-v"], "--schedule"),
    ("unknown-recompute", ["--recompute", "some"], "--recompute"),
    ("bad-order", ["--order", "tp-tp-pp"], "order"),
    ("unknown-dtype", ["--dtype", "fp64"], "--dtype"),
    ("unknown-flag", ["--bogus"], "--bogus"),
    ("model-file-missing", ["--model", "/nonexistent/dir/model.toml"], "does not exist"),
    ("system-file-missing", ["--system", "/nonexistent/dir/profile.toml"], "does not exist"),
]


def assert_one_line_error(result, needle: str | None = None):
    assert result.code == 2, (result.code, result.out, result.err)
    assert "Traceback" not in result.err and "Traceback" not in result.out
    assert result.out == ""
    assert result.err.endswith("\n")
    lines = result.err.splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("perfsim: error: ")
    assert len(lines[0]) > len("perfsim: error: ") + 5
    if needle is not None:
        assert needle.lower() in lines[0].lower(), lines[0]


@pytest.mark.parametrize("argv,needle", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_bad_cli_input(run_cli, argv, needle):
    assert_one_line_error(run_cli("predict", *argv), needle)


def test_error_cases_are_distinct():
    assert len({tuple(c[1]) for c in CLI_CASES}) == len(CLI_CASES) >= 20


def test_no_command(run_cli):
    assert_one_line_error(run_cli(), "command")


def test_unknown_command(run_cli):
    assert_one_line_error(run_cli("frobnicate"), "frobnicate")


def test_profiles_unknown_flag(run_cli):
    assert_one_line_error(run_cli("profiles", "--tp", "2"), "unrecognized")


def test_model_path_is_a_directory(run_cli, tmp_path):
    assert_one_line_error(run_cli("predict", "--model", str(tmp_path) + os.sep), "directory")


def test_system_path_is_a_directory(run_cli, tmp_path):
    assert_one_line_error(run_cli("predict", "--system", str(tmp_path) + os.sep), "directory")


# ---- model TOML files ----------------------------------------------------------------------

def test_model_toml_invalid(run_cli, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("layers = = 3\n")
    assert_one_line_error(run_cli("predict", "--model", str(path)), "not valid TOML")


def test_model_toml_float_field(run_cli, tmp_path):
    path = tmp_path / "m.toml"
    path.write_text("[model]\nlayers = 2.0\nhidden = 64\nheads = 4\nseq = 8\nvocab = 10\n")
    assert_one_line_error(run_cli("predict", "--model", str(path)), "layers")


def test_model_toml_missing_key(run_cli, tmp_path):
    path = tmp_path / "m.toml"
    path.write_text("layers = 2\nhidden = 64\nheads = 4\nvocab = 10\n")
    assert_one_line_error(run_cli("predict", "--model", str(path)), "seq")


def test_model_toml_model_not_a_table(run_cli, tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('model = "gpt3-175b"\n')
    assert_one_line_error(run_cli("predict", "--model", str(path)), "table")


def test_model_toml_good_file_works(run_cli, tmp_path):
    """The control for the cases above: the same kind of file, valid, predicts."""
    path = tmp_path / "tiny.toml"
    path.write_text("[model]\nlayers = 2\nhidden = 64\nheads = 4\nseq = 8\nvocab = 10\n")
    result = run_cli("predict", "--model", str(path), "--system", "cpu-example", "--json")
    assert result.code == 0, result.err
    assert result.json()["model"]["name"] == "tiny"


# ---- system profiles -------------------------------------------------------------------------

def _drop(section, key):
    def edit(d):
        del d[section][key]
    return edit


def _set(section, key, part, value):
    def edit(d):
        d[section][key][part] = value
    return edit


def _top(key, value):
    def edit(d):
        if value is None:
            del d[key]
        else:
            d[key] = value
    return edit


PROFILE_CASES = [
    ("missing-key", _drop("device", "gemm_efficiency"), "device.gemm_efficiency"),
    ("missing-section", _top("collectives", None), "[collectives]"),
    ("missing-schema", _top("schema", None), "schema"),
    ("wrong-schema", _top("schema", 2), "schema"),
    ("string-for-number", _set("device", "peak_flops_bf16", "value", "419.4e12"), "peak_flops_bf16"),
    ("bool-for-number", _set("network", "nic_bandwidth_Bps", "value", True), "nic_bandwidth_Bps"),
    ("float-for-count", _set("node", "devices_per_node", "value", 8.5), "devices_per_node"),
    ("bad-provenance", _set("device", "memory_bytes", "provenance", "folklore"), "provenance"),
    ("empty-source", _set("device", "memory_bytes", "source", "  "), "source"),
    ("no-value", lambda d: d["device"]["memory_bytes"].pop("value"), "memory_bytes"),
    ("efficiency-above-one", _set("device", "gemm_efficiency", "value", 1.5), "gemm_efficiency"),
    ("efficiency-zero", _set("collectives", "node_efficiency", "value", 0.0), "node_efficiency"),
    ("negative-latency", _set("network", "latency_s", "value", -1e-6), "latency_s"),
    ("zero-bandwidth", _set("device", "memory_bandwidth_Bps", "value", 0), "memory_bandwidth_Bps"),
    ("nan-value", _set("device", "peak_flops_fp32", "value", float("nan")), "peak_flops_fp32"),
    ("inf-value", _set("node", "node_link_bandwidth_Bps", "value", float("inf")), "node_link_bandwidth_Bps"),
    ("oversubscription-below-one", _set("network", "oversubscription", "value", 0.5), "oversubscription"),
    ("number-not-a-table", lambda d: d["device"].__setitem__("memory_bytes", 64e9), "memory_bytes"),
    ("unknown-key", lambda d: d["device"].__setitem__("turbo", {"value": 1.0, "provenance": "spec", "source": "x"}), "turbo"),
    ("unknown-topology", lambda d: d["network"].__setitem__("topology", "torus"), "topology"),
    ("cards-not-dividing-node", _set("node", "devices_per_card", "value", 3), "devices_per_card"),
    ("name-not-string", _top("name", 5), "name"),
    ("unknown-zero-implementation", lambda d: d["framework"].__setitem__("zero_implementation", "megatron"),
     "framework.zero_implementation"),
    ("zero-implementation-as-table", lambda d: d["framework"].__setitem__(
        "zero_implementation", {"value": "fsdp2", "provenance": "assumed", "source": "x"}), "plain string"),
]


@pytest.mark.parametrize("edit,needle", [c[1:] for c in PROFILE_CASES], ids=[c[0] for c in PROFILE_CASES])
def test_bad_profile(run_cli, tmp_path, edit, needle):
    path = write_variant(tmp_path, "smng-p2", edit)
    result = run_cli("predict", "--system", path)
    assert_one_line_error(result, needle)
    assert path in result.err  # the message names the file


def test_unedited_profile_copy_works(run_cli, tmp_path):
    """Control: the writer itself produces a valid profile, so the failures above are the edits'."""
    path = write_variant(tmp_path, "smng-p2")
    result = run_cli("predict", "--system", path, "--json")
    assert result.code == 0, result.err
    assert result.json()["system"] == "smng-p2"


def test_profile_invalid_toml(run_cli, tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("schema = 1\n[device\nname = 'x'\n")
    assert_one_line_error(run_cli("predict", "--system", str(path)), "not valid TOML")


# ---- the real executable --------------------------------------------------------------------

def _check_process(proc):
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("perfsim: error: ")


def test_subprocess_module_tp_zero():
    proc = subprocess.run([sys.executable, "-m", "perfsim.cli", "predict", "--tp", "0"],
                          capture_output=True, text=True, timeout=60)
    _check_process(proc)


@pytest.mark.skipif(shutil.which("perfsim") is None, reason="console script not on PATH")
def test_subprocess_console_script_bad_model():
    proc = subprocess.run([shutil.which("perfsim"), "predict", "--model", "layers=2"],
                          capture_output=True, text=True, timeout=60)
    _check_process(proc)


# ---- library API: the same errors as PerfsimError (a ValueError), never a crash ------------

def test_api_predict_bad_plan_raises_perfsim_error():
    import perfsim

    with pytest.raises(perfsim.PerfsimError) as info:
        perfsim.predict("gpt3-1.3b", "dgx-a100", perfsim.Plan(tp=3, pp=5))
    message = str(info.value)
    assert "heads" in message and "layers" in message  # both reasons, not just the first
    assert isinstance(info.value, ValueError)


def test_api_unknown_dtype():
    import perfsim

    with pytest.raises(perfsim.PerfsimError, match="dtype"):
        perfsim.predict("gpt3-125m", "dgx-a100", perfsim.Plan(), dtype="fp8")


# ---- absurd sizes: still an input error, not a crash ------------------------------------------

HUGE = str(10**23)


@pytest.mark.parametrize("argv", [
    ["--model", "gpt3-125m", "--system", "dgx-a100", "--devices", HUGE],
    ["--model", "gpt3-125m", "--system", "dgx-a100", "--devices", "1", "--gbs", HUGE],
    ["--model", f"layers=1,hidden={HUGE},heads=1,seq=8,vocab=10", "--system", "dgx-a100", "--devices", "1"],
], ids=["devices", "gbs", "hidden"])
def test_huge_sizes_are_input_errors(run_cli, argv):
    result = run_cli("predict", *argv)
    if result.code == 0:  # a prediction is also acceptable, as long as it does not crash
        return
    assert_one_line_error(result)


def test_huge_size_combination_does_not_crash(run_cli):
    """Each size is under the input cap, their product is far beyond int64: the cost layer works in floats."""
    big = str(2**24)
    result = run_cli("predict", "--model", f"layers=1,hidden={big},heads=1,seq={big},vocab={big}",
                     "--system", "dgx-a100", "--devices", "1", "--mbs", big)
    if result.code != 0:
        assert_one_line_error(result)
