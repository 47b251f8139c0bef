"""Collectives timed beside compute and the overlap efficiency they calibrate
(perfsim.calibrate.overlap; validate.microbench "concurrent" points; docs/calibration.md)."""

from __future__ import annotations

import json

import pytest

from perfsim.calibrate import fit, fit_ledger
from perfsim.calibrate.overlap import fit_overlap, hidden_share, overlap_efficiency
from perfsim.ledger import calibration_problem, read_ledger
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system
from validate import microbench as mb

MODEL = "layers=2,hidden=64,heads=4,seq=32,vocab=256"


def record(op, nbytes, alone, burst, eta, jitter=1.0):
    """A concurrent point whose together-time follows max + (1 - eta) min (times `jitter`)."""
    both = (max(alone, burst) + (1 - eta) * min(alone, burst)) * jitter
    return {"schema": 1, "key": f"collective:{op}:bf16:{nbytes}", "suite": "collective", "op": op, "dtype": "bf16",
            "shape": {"nbytes": nbytes}, "nbytes": nbytes, "group": [2, 1], "timing": "concurrent",
            "stats": {"median_s": both, "min_s": both, "mean_s": both}, "alone_stats": {"median_s": alone},
            "burst_stats": {"median_s": burst}}


def points(eta, jitters=(1.0,) * 8):
    sizes = [(op, n) for op in ("all_reduce", "all_gather", "reduce_scatter", "send") for n in (1 << 16, 1 << 20)]
    return [record(op, n, alone=1e-3 * (1 + i % 3), burst=1.2e-3 * (1 + i % 2), eta=eta, jitter=j)
            for i, ((op, n), j) in enumerate(zip(sizes, jitters))]


@pytest.mark.parametrize("eta", [1.0, 0.6, 0.25])
def test_the_fit_recovers_a_known_eta(eta):
    rows = points(eta)
    assert [hidden_share(r) for r in rows] == pytest.approx([eta] * len(rows))
    values, quality, notes = fit_overlap(rows, "synthetic.jsonl")
    assert values["collectives.overlap_efficiency"].value == pytest.approx(eta)
    assert quality[0].fit_mape == pytest.approx(0.0, abs=1e-12) and quality[0].held_mape == pytest.approx(0.0, abs=1e-12)
    assert quality[0].held_points == len(rows) and quality[0].passed
    if eta < 1:  # perfect overlap predicts every point too fast
        assert quality[1].fit_mape > 0.05


def test_the_fit_is_robust_to_an_outlier_and_held_out_points_use_the_others_eta():
    rows = points(0.5, jitters=(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0))  # one point three times too slow
    eta = overlap_efficiency(rows)
    assert eta == pytest.approx(0.5)  # the median ignores it
    _, quality, _ = fit_overlap(rows, "synthetic.jsonl")
    assert quality[0].held_mape >= quality[0].fit_mape > 0


def test_contention_worse_than_serial_clips_to_the_floor_and_says_so():
    rows = [record("all_reduce", 1 << 16 << i, 1e-3, 1e-3, eta=0.0, jitter=1.5) for i in range(4)]  # 3 ms together
    assert hidden_share(rows[0]) == pytest.approx(-1.0)
    values, _, notes = fit_overlap(rows, "synthetic.jsonl")
    assert values["collectives.overlap_efficiency"].value == 0.01
    assert "clipped" in values["collectives.overlap_efficiency"].source
    assert "slower than one after the other" in notes[0]


def test_too_few_points_fit_nothing():
    assert fit_overlap(points(0.5)[:2], "x") == ({}, [], [])


def test_concurrent_points_stay_out_of_the_collective_fit_and_calibrate_the_profile():
    """The ledger's concurrent points give eta; they take no part in the link fit (a record timed
    beside compute is no call's time) and a ledger without them leaves the profile's eta alone."""
    base = load_system("cpu-example")
    interleaved = [{"schema": 1, "key": f"c{n}{op}", "suite": "collective", "op": op, "dtype": "bf16",
                    "shape": {"nbytes": n}, "nbytes": n, "group": [2, 1], "timing": "interleaved",
                    "stats": {"median_s": 1e-4 + n / 1e9, "min_s": 1e-4 + n / 1e9, "mean_s": 1e-4 + n / 1e9}}
                   for op in ("all_reduce", "send") for n in (1 << 10, 1 << 14, 1 << 18, 1 << 22)]
    alone = fit(interleaved, base, "plain.jsonl", "cpu")
    both = fit(interleaved + points(0.4), base, "both.jsonl", "cpu")
    assert "collectives.overlap_efficiency" not in alone.values
    assert both.values["collectives.overlap_efficiency"].value == pytest.approx(0.4)
    assert both.system.collectives.overlap_efficiency == pytest.approx(0.4)
    assert both.system.provenance["collectives.overlap_efficiency"][0] == "calibrated"
    for key, fitted in alone.values.items():
        assert both.values[key].value == fitted.value, key


def test_a_concurrent_record_needs_both_sides():
    good = record("all_reduce", 1 << 16, 1e-3, 1e-3, 0.5)
    assert calibration_problem(good) is None
    for side in ("alone_stats", "burst_stats"):
        bad = {k: v for k, v in good.items() if k != side}
        assert "concurrent" in calibration_problem(bad)


def test_points_are_few_in_the_dtype_steps_send_and_keyed_apart_from_interleaved_ones():
    model = load_model(MODEL)
    sweep = mb.default_sweep("cpu", quick=True)
    built = mb.build_points("cpu", ("fp32", "bf16"), model, Plan(), 2, 2, sweep, ("collective",))
    concurrent = [p for p in built if p.timing == mb.CONCURRENT_TIMING]
    assert {p.op for p in concurrent} == set(mb.CONCURRENT_OPS) and {p.dtype for p in concurrent} == {"bf16"}
    assert sorted({p.dims["nbytes"] for p in concurrent}) == [1 << 16, 1 << 18, 1 << 20]  # quick: up to 1 MiB
    same = [p for p in built if p.timing == mb.COLLECTIVE_TIMING and p.op == "all_reduce" and p.dtype == "bf16"
            and p.dims["nbytes"] == 1 << 16]
    twin = next(p for p in concurrent if p.op == "all_reduce" and p.dims["nbytes"] == 1 << 16)
    assert same and same[0].key("cpu", 2) != twin.key("cpu", 2)


def test_two_ranks_measure_collectives_beside_compute_and_fit_eta(run_cli, tmp_path):
    """A real 2-rank gloo run: every concurrent point has the three times, and the fit writes
    collectives.overlap_efficiency (calibrated) into the profile."""
    ledger, out = tmp_path / "overlap.jsonl", tmp_path / "overlap.toml"
    r = run_cli("calibrate", "--device", "cpu", "--nproc", "2", "--quick", "--suites", "collective", "--dtypes", "bf16",
                "--max-bytes", "64KiB", "--repeats", "3", "--ledger", str(ledger), "--no-fit", "--model", MODEL)
    assert r.code == 0, r.err
    records, problems = read_ledger(str(ledger))
    assert problems == []
    concurrent = [x for x in records if x.get("timing") == "concurrent"]
    assert sorted(x["op"] for x in concurrent) == sorted(mb.CONCURRENT_OPS)
    for x in concurrent:
        assert "error" not in x, x.get("error")
        assert x["stats"]["repeats"] == x["alone_stats"]["repeats"] == x["burst_stats"]["repeats"] == 3
        assert x["shape"]["nbytes"] == 1 << 16 and x["group"] == [2, 1]
    calibration = fit_ledger(str(ledger), "cpu-example", str(out), report=lambda text: None)
    eta = calibration.values["collectives.overlap_efficiency"].value
    assert 0 < eta <= 1
    text = out.read_text()
    assert "[collectives.overlap_efficiency]" in text and json.dumps("calibrated") in text
    assert load_system(str(out)).collectives.overlap_efficiency == pytest.approx(eta, rel=1e-5)
