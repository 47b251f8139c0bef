"""The measurement ledger: append, read back, damaged lines, resume keys, bad paths (no torch)."""

from __future__ import annotations

import json

import pytest

from perfsim.calibrate import LEDGER_SCHEMA, read_ledger
from perfsim.errors import PerfsimError
from validate.ledger import Ledger, check_path, relevant_env


def record(i, suite="gemm"):
    shape = {"count": 1, "m": 64 * (i + 1), "n": 64, "k": 64} if suite == "gemm" else {"nbytes": 1024 * (i + 1)}
    out = {"key": f"{suite}:{i}", "suite": suite, "op": "matmul" if suite == "gemm" else "all_reduce",
           "dtype": "fp32", "shape": shape, "stats": {"median_s": 1e-3 * (i + 1)}}
    if suite == "collective":
        out.update(group=[2, 1], nbytes=shape["nbytes"])
    return out


def test_append_and_read_back(tmp_path):
    path = tmp_path / "l.jsonl"
    with Ledger(str(path), {"device": {"kind": "cpu"}, "host": "box"}) as ledger:
        for i in range(3):
            ledger.append(record(i))
        ledger.append(record(0, "collective"))
    records, problems = read_ledger(str(path))
    assert problems == []
    assert [r["key"] for r in records] == ["gemm:0", "gemm:1", "gemm:2", "collective:0"]
    first = records[0]
    assert first["schema"] == LEDGER_SCHEMA and first["device"] == {"kind": "cpu"} and first["host"] == "box"
    assert "timestamp" in first
    # appended and flushed line by line: every line is a whole JSON object
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_damaged_line_is_reported_and_skipped(tmp_path):
    path = tmp_path / "l.jsonl"
    lines = [json.dumps({"schema": 1, **record(0)}), '{"schema": 1, "key": "gemm:1", "su', "[1, 2]",
             json.dumps({"schema": 99, **record(3)}), json.dumps({"schema": 1, **record(2)}), "",
             json.dumps({"schema": 1, **record(4), "stats": {"median_s": -1}})]
    path.write_text("\n".join(lines) + "\n")
    records, problems = read_ledger(str(path))
    assert [r["key"] for r in records] == ["gemm:0", "gemm:2"]
    assert len(problems) == 4
    assert problems[0].startswith("line 2 is damaged")
    assert "line 4 has schema 99" in problems[2]
    assert "line 7 has no positive stats.median_s" in problems[3]


def test_resume_after_a_tail_cut_short(tmp_path):
    """A kill while writing leaves a partial last line: the next open reports it, starts a new
    line, and the point is not counted as done."""
    path = tmp_path / "l.jsonl"
    with Ledger(str(path)) as ledger:
        ledger.append(record(0))
    with open(path, "a") as fh:
        fh.write(json.dumps({"schema": 1, **record(1)})[:30])  # no newline
    warnings = []
    with Ledger(str(path), report=warnings.append) as ledger:
        assert ledger.done("gemm:0") and not ledger.done("gemm:1")
        ledger.append(record(1))
    assert len(warnings) == 1 and "line 2" in warnings[0] and "measured again" in warnings[0]
    records, problems = read_ledger(str(path))
    assert [r["key"] for r in records] == ["gemm:0", "gemm:1"] and len(problems) == 1


def test_last_record_of_a_key_wins(tmp_path):
    path = tmp_path / "l.jsonl"
    first, second = {"schema": 1, **record(0)}, {"schema": 1, **record(0), "stats": {"median_s": 5.0}}
    path.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    records, _ = read_ledger(str(path))
    assert len(records) == 1 and records[0]["stats"]["median_s"] == 5.0


def test_bad_paths(tmp_path):
    with pytest.raises(PerfsimError, match="is a directory"):
        check_path(str(tmp_path))
    with pytest.raises(PerfsimError, match="does not exist"):
        check_path(str(tmp_path / "missing" / "l.jsonl"))
    with pytest.raises(PerfsimError, match="does not exist"):
        read_ledger(str(tmp_path / "none.jsonl"))
    with pytest.raises(PerfsimError, match="is a directory"):
        read_ledger(str(tmp_path))


def test_relevant_env_keeps_what_matters_and_no_secrets():
    env = {"CCL_OP_SYNC": "1", "ZE_FLAT_DEVICE_HIERARCHY": "FLAT", "HOME": "/root", "NCCL_ALGO": "Ring",
           "TORCH_API_TOKEN": "x", "OMP_NUM_THREADS": "1", "PATH": "/bin"}
    assert relevant_env(env) == {"CCL_OP_SYNC": "1", "NCCL_ALGO": "Ring", "OMP_NUM_THREADS": "1",
                                 "ZE_FLAT_DEVICE_HIERARCHY": "FLAT"}


def test_fit_command_on_bad_ledgers(run_cli, tmp_path):
    r = run_cli("calibrate", "--fit", str(tmp_path / "none.jsonl"), "--system", "cpu-example",
                "--out", str(tmp_path / "p.toml"))
    assert r.code == 2 and r.err.startswith("perfsim: error: ledger") and "does not exist" in r.err
    damaged = tmp_path / "bad.jsonl"
    damaged.write_text("not json\n")
    r = run_cli("calibrate", "--fit", str(damaged), "--system", "cpu-example", "--out", str(tmp_path / "p.toml"))
    assert r.code == 2 and "line 1 is damaged" in r.err and "holds no measurements" in r.err
    r = run_cli("calibrate", "--fit", str(damaged), "--out", str(tmp_path / "p.toml"))
    assert r.code == 2 and "--fit needs --system" in r.err
