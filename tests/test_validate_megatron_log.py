"""`perfsim validate --megatron-log`: parsing Megatron-DeepSpeed's per-iteration log lines and
comparing them with the prediction. The log text follows Megatron-DeepSpeed's training_log format
(written here, not copied from a run)."""

from __future__ import annotations

import statistics

import pytest

from perfsim.megatron_log import parse_lines

CASE = ["--model", "sc21-1.7b", "--system", "dgx-a100", "--devices", "8", "--tp", "2", "--mbs", "4", "--gbs", "64"]


def ds_line(iteration, total, ms, tflops=None, samples=64):
    line = (f" iteration {iteration:>8d}/{total:>8d} | consumed samples: {iteration * samples:>12d} | "
            f"consumed tokens: {iteration * samples * 2048:>12d} | elapsed time per iteration (ms): {ms:.1f} | "
            f"learning rate: 1.500E-04 | global batch size: {samples:>5d} | lm loss: 7.123456E+00 | loss scale: 1.0 | "
            f"grad norm: 1.234 | num zeros: 0.0 | actual seqlen:  2048 | number of skipped iterations:   0 | "
            f"number of nan iterations:   0 | samples per second: {samples / ms * 1e3:.3f} | "
            f"tokens per gpu per second (tgs): 1234.567 |")
    return line + (f" TFLOPs: {tflops:.2f} |" if tflops is not None else "")


def write_log(path, rows):
    noise = ["[INFO] building GPT model ...", "time (ms) | forward-compute: 1200.00 | backward-compute: 2400.00",
             "[Rank 0] (after 10 iterations) memory (MB) | allocated: 1024.0 | max allocated: 2048.0"]
    lines = noise[:1] + [ds_line(*r) for r in rows] + noise[1:]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_parse_skips_the_first_interval_and_takes_medians():
    rows = [(10, 100, 9000.0, 80.0), (20, 100, 5000.0, 120.0), (30, 100, 5200.0, 118.0), (40, 100, 4900.0, 121.5)]
    s = parse_lines([ds_line(*r) for r in rows])
    assert s.skipped_first and s.iterations == [20, 30, 40]
    assert s.step_time_s == pytest.approx(5.0)
    assert s.tflops_per_device == pytest.approx(120.0)


def test_one_interval_is_kept_and_tflops_are_optional():
    s = parse_lines([ds_line(10, 10, 1234.5)])
    assert not s.skipped_first and s.step_time_s == pytest.approx(1.2345) and s.tflops_per_device is None


def test_compares_with_the_prediction(run_cli, tmp_path):
    rows = [(5, 50, 4000.0, 90.0), (10, 50, 2100.0, 101.0), (15, 50, 2000.0, 104.0), (20, 50, 2050.0, 103.0)]
    log = write_log(tmp_path / "train.log", rows)
    r = run_cli("validate", "--megatron-log", log, *CASE, "--json")
    assert r.code == 0, r.err
    out = r.json()
    predicted = run_cli("predict", *CASE, "--json").json()
    assert out["step_time_s"]["measured"] == pytest.approx(2.05)
    assert out["step_time_s"]["predicted"] == pytest.approx(predicted["step_time_s"])
    assert out["megatron_ds_tflops_per_device"]["measured"] == pytest.approx(statistics.median([101.0, 104.0, 103.0]))
    assert out["megatron_ds_tflops_per_device"]["predicted"] == pytest.approx(predicted["megatron_ds_tflops_per_device"])
    assert out["step_time_s"]["relative_error"] == pytest.approx(predicted["step_time_s"] / 2.05 - 1)
    assert out["intervals"] == 3 and out["plan"]["tp"] == 2 and out["devices"] == 8
    table = run_cli("validate", "--megatron-log", log, *CASE)
    assert table.code == 0 and "step time (s)" in table.out and "TFLOPs per device (DS)" in table.out


@pytest.mark.parametrize("content, needle", [
    (None, "does not exist"),
    ("nothing that Megatron prints\n", "no 'elapsed time per iteration (ms):' line"),
    ("", "no 'elapsed time per iteration (ms):' line"),
])
def test_bad_logs_are_one_line_errors(run_cli, tmp_path, content, needle):
    path = tmp_path / "run.log"
    if content is not None:
        path.write_text(content)
    r = run_cli("validate", "--megatron-log", str(path), *CASE)
    assert r.code == 2 and r.out == ""
    assert r.err.startswith("perfsim: error: ") and needle in r.err and r.err.count("\n") == 1


def test_needs_a_log(run_cli):
    r = run_cli("validate", *CASE)
    assert r.code == 2 and "--megatron-log FILE" in r.err and r.err.count("\n") == 1


def test_plan_errors_are_one_line(run_cli, tmp_path):
    log = write_log(tmp_path / "t.log", [(1, 2, 1000.0, 10.0)])
    r = run_cli("validate", "--megatron-log", log, "--model", "sc21-1.7b", "--system", "dgx-a100", "--devices", "8",
                "--tp", "3")
    assert r.code == 2 and r.err.startswith("perfsim: error: ") and r.err.count("\n") == 1
