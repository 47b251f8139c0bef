"""perfsim.calibrate.drift: a campaign measured partly in a slow spell of the machine (its
reference kernels slower for a stretch of points) is fitted as if it had run at its typical speed."""

from __future__ import annotations

import pytest

from perfsim.calibrate.drift import WINDOW, steadied


def point(suite: str, seconds: float, gemm_ref: float, norm_ref: float, **extra) -> dict:
    stats = {"median_s": seconds, "mean_s": seconds, "min_s": 0.9 * seconds, "std_s": 0.1 * seconds, "repeats": 5}
    return {"suite": suite, "op": "x", "stats": stats, "cpu_stats": dict(stats),
            "reference_s": {"gemm": gemm_ref, "memory": norm_ref}, **extra}


def campaign(slow: float = 1.6) -> list:
    """30 GEMM and 30 element-wise points of true time 1 ms; points 20-34 ran in a spell in which
    everything took `slow` times as long, the references too."""
    out = []
    for i in range(60):
        factor = slow if 20 <= i < 35 else 1.0
        suite = "gemm" if i % 2 else "memory"
        out.append(point(suite, 1e-3 * factor, 4e-3 * factor, 2e-4 * factor))
    return out


def test_a_slow_spell_is_taken_out_of_the_compute_points():
    records, notes, typical = steadied(campaign())
    assert typical == {"gemm": pytest.approx(4e-3), "memory": pytest.approx(2e-4)}
    spell = [r for i, r in enumerate(records) if 24 <= i < 31]  # well inside the spell
    assert all(r["stats"]["mean_s"] == pytest.approx(1e-3) and r["cpu_stats"]["median_s"] == pytest.approx(1e-3)
               for r in spell)
    assert all(r["drift_factor"] == pytest.approx(1 / 1.6) for r in spell)
    calm = [r for i, r in enumerate(records) if i < 10 or i >= 45]
    assert all(r["stats"]["mean_s"] == pytest.approx(1e-3) and r["drift_factor"] == pytest.approx(1.0) for r in calm)
    assert records[25]["stats"]["repeats"] == 5  # counts stay counts
    assert len(notes) == 2 and "0.62-1.00x its typical speed" in notes[0]


def test_collectives_and_ledgers_without_references_stay_as_measured():
    records = campaign()
    collective = {"suite": "collective", "op": "all_reduce", "stats": {"mean_s": 5e-3, "median_s": 5e-3}}
    bare = [{k: v for k, v in r.items() if k != "reference_s"} for r in records]
    out, notes, _ = steadied(records[:30] + [collective] + records[30:])
    assert out[30] is collective
    assert steadied(bare) == (bare, [], {})
    few = records[:WINDOW - 1]  # fewer points than the window: nothing to take a median over
    assert steadied(few)[0] == few


def test_the_fit_reports_the_drift(tmp_path):
    """calibrate's fit runs the correction and says so in its notes."""
    from perfsim.calibrate import fit
    from perfsim.spec.system import load_system

    records = []
    for i in range(40):
        factor = 1.5 if 10 <= i < 25 else 1.0
        m = 64 * (1 + i % 8)
        flops = 2 * m * 512 * 512
        r = point("gemm", flops / 50e9 * factor, 4e-3 * factor, 2e-4 * factor)
        r.update(op="matmul", dtype="fp32", shape={"count": 1, "m": m, "n": 512, "k": 512}, flops=flops,
                 timing="rotate", device={"kind": "cpu"}, key=f"gemm:{i}")
        records.append(r)
    calibration = fit(records, load_system("cpu-example"), "synthetic.jsonl", device_kind="cpu")
    assert any("machine drift during the campaign" in n and "0.67-1.00x" in n for n in calibration.notes)
    # the typical reference times go into the profile, for validate's speed probes
    assert calibration.values["device.speed_reference_gemm_s"].value == pytest.approx(4e-3)
    from perfsim.calibrate.common import with_values

    profile = with_values(load_system("cpu-example"), calibration.values)
    assert profile.device.speed_reference_gemm_s == pytest.approx(4e-3)
    assert profile.provenance["device.speed_reference_gemm_s"][0] == "calibrated"
