"""benchmarks/gpu_check.sh, issue 29's one-call GPU check: calibrate one device, then validate GPT
and Llama-shaped models against the fitted profile, into one folder. CI has no GPU, so this runs
the script's plumbing on a CPU at smoke-test sizes (DEVICE=cpu QUICK=1) and checks what the full
run would measure (LIST=1): at least 12 plans over both models, unfused and flash attention, every
recomputation mode."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from perfsim.spec.model import load_model
from validate.timing import parse_plans

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"


def _run(env: dict, *args, timeout=900):
    return subprocess.run(["bash", str(SCRIPT), *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)


def test_the_full_run_covers_both_models_every_attention_and_recomputation():
    proc = _run({"LIST": "1"})
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("\t") for line in proc.stdout.splitlines()]
    models = [load_model(spec) for spec, _ in rows]
    assert [m.norm for m in models] == ["layernorm", "rmsnorm"] and models[1].gated_mlp
    assert models[1].kv_head_count < models[1].heads and not models[1].learned_positions
    plans = [plan for _, text in rows for plan in parse_plans(text)]
    assert len(plans) >= 12
    for _, text in rows:
        assert {p.attention for p in parse_plans(text)} == {"unfused", "flash"}
        assert {p.recompute for p in parse_plans(text)} == {"none", "selective", "full"}


@pytest.mark.multiprocess
def test_the_plumbing_runs_on_a_cpu_and_resumes(tmp_path):
    pytest.importorskip("torch")
    env = {"DEVICE": "cpu", "QUICK": "1", "BASE": "cpu-example"}
    proc = _run(env, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("cal.jsonl", "cal-overheads.jsonl", "gpu.toml", "validation.jsonl", "errors.txt", "calibrate.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
    steps = [json.loads(line) for line in (tmp_path / "validation.jsonl").read_text().splitlines()]
    assert len(steps) == 4 and {s["system"] for s in steps} == {"gpu"}
    assert any("norm=rmsnorm" in s["model"] for s in steps)
    errors = (tmp_path / "errors.txt").read_text()
    assert errors.count("mean |error| over 2 plans") == 2
    # a second run measures nothing again: every plan is read back from the ledger
    again = _run(env, str(tmp_path))
    assert again.returncode == 0 and "from the ledger" in again.stdout + again.stderr
    assert len((tmp_path / "validation.jsonl").read_text().splitlines()) == 4
