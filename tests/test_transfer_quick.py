"""Issue 15's transfer loop in CI (benchmarks/transfer.py --quick): on a "machine" made from this
box by the environment (element-wise kernels without vectorisation, oneDNN and MKL held to SSE),
from scratch, `perfsim calibrate` and then `perfsim validate` against the profile it wrote, on a
model the calibration never saw. Smoke-test sizes: this checks that the loop runs and hands over
what it should, and the one figure that does not depend on the machine's speed, peak memory; the
accuracy figures come from the full benchmark (docs/calibration.md section 5)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def transfer(tmp_path_factory):
    out = tmp_path_factory.mktemp("transfer")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "transfer.py"), "--quick", "--settings", "generic",
                           "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_the_loop_calibrates_from_scratch_and_validates_against_its_own_profile(transfer):
    from perfsim.spec.system import load_system

    out, proc = transfer
    (row,) = json.loads((out / "transfer.json").read_text())
    assert row["setting"] == "generic" and "error" not in row
    assert row["env"]["ATEN_CPU_CAPABILITY"] == "default" and row["nproc"] == 2
    profile = load_system(str(out / "generic" / "cpu-generic.toml"))
    assert profile.name == "cpu-generic"
    for key in ("device.gemm_efficiency", "device.memory_bandwidth_Bps", "device.flash_forward_efficiency",
                "device.flash_backward_efficiency", "node.node_link_bandwidth_Bps"):
        assert profile.provenance[key][0] == "calibrated", key
    assert profile.framework.step_overhead_s >= 0  # the overheads suite ran and was fitted
    validation = [json.loads(line) for line in (out / "generic" / "validation.jsonl").read_text().splitlines()]
    assert len(validation) == row["plans"] == 2
    assert all(r["system"] == "cpu-generic" for r in validation)
    # the GEMM curve's and the overheads' rows always report a held-out figure (a table, of
    # collectives say, is kept only where it beats its curve: at smoke-test sizes, not always)
    assert {"gemm", "overheads"} <= set(row["held_out"])
    assert 0 <= row["step_mape"] < 10  # finite; its size is the full benchmark's business
    assert 0 <= row["plans_at_speed"] <= row["plans"]  # the plans measured at the profile's speed, counted
    assert row["memory_mean"] <= 0.15, "peak memory does not depend on the machine's speed"
    assert "| generic |" in proc.stdout


def test_a_rerun_resumes_from_the_ledgers_instead_of_measuring_again(transfer):
    """Ledgers are appended to and resumed: the second run measures nothing again."""
    out, _ = transfer
    ledger = out / "generic" / "calibration.jsonl"
    before = ledger.read_text()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "transfer.py"), "--quick", "--settings", "generic",
                           "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ledger.read_text() == before
