"""Measured kernel tables (perfsim.cost.measured, perfsim.calibrate.tables; docs/equations.md 3.10):
interpolation near measurements, the curve far from them, the share that rests on the curve, the
profile round trip, and a machine the parametric curve cannot describe."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from perfsim import calibrate as cal
from perfsim.cost import measured
from perfsim.cost.layer import Gemm, MemoryOp, gemm_curve_time, gemm_time, gemm_time_and_share, memory_times
from perfsim.errors import PerfsimError
from perfsim.predict import predict
from perfsim.spec.plan import Plan
from perfsim.spec.system import for_dtype, load_system
from tests.test_calibrate_fit import _truth, synthetic_records

DIMS = (64, 128, 256, 512, 1024, 2048)


def _amx_like(m, n, k):
    """A machine the product-form curve cannot describe: GEMMs with every dimension a multiple of
    512 run 3x faster than the rest (tiles that fill the matrix unit), the others as the curve says."""
    return np.where((np.asarray(m) % 512 == 0) & (np.asarray(n) % 512 == 0) & (np.asarray(k) % 512 == 0), 1 / 3, 1.0)


def _gemm_table(device, peak, shapes, dtype="bf16", speed=_amx_like, width=0.5):
    points = tuple((1.0, m, n, k, float(gemm_curve_time(device, peak, 1, m, n, k) * speed(m, n, k))) for m, n, k in shapes)
    return measured.KernelTable(measured.GEMM, dtype, points, width)


def test_near_a_measured_shape_the_prediction_is_the_measurement_and_far_away_the_curve():
    system = load_system("cpu-example")
    peak = system.device.peak_flops_bf16
    table = _gemm_table(system.device, peak, [(1024, 1024, 1024)])
    device = dataclasses.replace(system.device, measured=(table,), kernel_dtype="bf16")
    curve = float(gemm_curve_time(device, peak, 1, 1024, 1024, 1024))
    at, share = gemm_time_and_share(device, peak, Gemm("g", 1, 1024, 1024, 1024))
    # one point: the prior weighs exp(-1.5^2 / (2 w^2)) against the point's 1
    prior = np.exp(-measured.PRIOR_OCTAVES**2 / (2 * 0.5**2))
    assert share == pytest.approx(prior / (1 + prior))
    assert at == pytest.approx(curve * np.exp(np.log(1 / 3) / (1 + prior)))
    far, far_share = gemm_time_and_share(device, peak, Gemm("g", 1, 64, 64, 64))
    assert far == pytest.approx(float(gemm_curve_time(device, peak, 1, 64, 64, 64)), rel=1e-6)
    assert far_share == pytest.approx(1.0, abs=1e-6)
    # another dtype's prediction does not use the bf16 table
    assert gemm_time(dataclasses.replace(device, kernel_dtype="fp32"), peak, Gemm("g", 1, 1024, 1024, 1024)) == \
        pytest.approx(curve)


def test_backward_gemms_are_priced_at_their_own_shapes():
    """A head GEMM's backward: without a table twice its forward (the curve is symmetric in m, n and
    k); with a table whose only slow shapes are the forward's, the two backward products (data
    gradient (m, k, n), weight gradient (n, k, m), as torch's linear computes them) keep the
    curve's time, so the backward is no longer 2 x the measured forward."""
    from perfsim.cost.layer import backward_gemms, work

    system = load_system("cpu-example")
    peak = system.device.peak_flops_bf16
    head = Gemm("head", 1, 512, 8192, 512)
    assert [(g.m, g.n, g.k) for g in backward_gemms(head)] == [(512, 512, 8192), (8192, 512, 512)]
    scores = Gemm("scores", 16, 256, 256, 64)  # no weights: B's gradient A^T dC is (k, n, m)
    assert [(g.count, g.m, g.n, g.k) for g in backward_gemms(scores)] == [(16, 256, 64, 256), (16, 64, 256, 256)]
    plain = work(system.device, peak, [head], [])
    assert plain.backward_s == pytest.approx(2 * plain.time_s) and plain.weight_grad_s == pytest.approx(plain.time_s)
    slow_forward = lambda m, n, k: np.where(np.asarray(n) == 8192, 3.0, 1.0)  # noqa: E731
    table = _gemm_table(system.device, peak, [(512, 8192, 512), (512, 512, 8192), (8192, 512, 512)], speed=slow_forward,
                        width=0.1)
    device = dataclasses.replace(system.device, measured=(table,), kernel_dtype="bf16")
    timed = work(device, peak, [head], [])
    assert timed.time_s == pytest.approx(3 * plain.time_s, rel=1e-3)
    assert timed.backward_s == pytest.approx(plain.backward_s, rel=1e-3)
    assert timed.weight_grad_s == pytest.approx(plain.weight_grad_s, rel=1e-3)


def test_arrays_are_interpolated_as_each_element_alone():
    system = load_system("cpu-example")
    peak = system.device.peak_flops_bf16
    table = _gemm_table(system.device, peak, itertools.product((256, 1024), repeat=3))
    device = dataclasses.replace(system.device, measured=(table,), kernel_dtype="bf16")
    m = np.array([256.0, 300.0, 1024.0, 256.0, 4096.0])
    n = np.array([1024.0, 700.0, 1024.0, 1024.0, 64.0])
    together = gemm_time(device, peak, Gemm("g", 1.0, m, n, 512.0))
    alone = [float(gemm_time(device, peak, Gemm("g", 1.0, a, b, 512.0))) for a, b in zip(m, n)]
    np.testing.assert_allclose(together, alone, rtol=1e-12)


def test_element_wise_tables_correct_forward_and_backward_kernels_apart():
    system = load_system("cpu-calibrated")
    dev = dataclasses.replace(system.device, measured=(), kernel_dtype="bf16")
    sizes = [2.0**e for e in range(16, 26)]
    forward = [float(memory_times(dev, MemoryOp("norm1", n, "layernorm"))[0]) for n in sizes]
    backward = [float(memory_times(dev, MemoryOp("norm1", n, "layernorm"))[1]) for n in sizes]
    # a machine whose layernorm forward runs 2x slower than the curve, its backward as the curve
    fwd = measured.KernelTable("layernorm", "bf16", tuple((n, 2 * t) for n, t in zip(sizes, forward)))
    bwd = measured.KernelTable("layernorm_backward", "bf16", tuple((1.5 * n, t) for n, t in zip(sizes, backward)))
    with_tables = dataclasses.replace(dev, measured=(fwd, bwd))
    f, b = memory_times(with_tables, MemoryOp("norm1", 2.0**20, "layernorm"))
    f0, b0 = memory_times(dev, MemoryOp("norm1", 2.0**20, "layernorm"))
    assert float(f) == pytest.approx(2 * float(f0), rel=0.01)  # the prior's pull, under 1% amid 10 points
    assert float(b) == pytest.approx(float(b0), rel=1e-9)


def test_a_machine_the_curve_cannot_describe_is_predicted_from_its_table():
    """GEMMs 3x faster on 512-multiples: the fitted curve misses the held-out shapes by tens of
    percent; the table, built from the fitted shapes only, predicts them within a few."""
    base, truth = _truth()
    records = synthetic_records(truth, noise=0.02)
    for r in records:
        if r["suite"] == "gemm" and r["dtype"] == "bf16":
            s = r["shape"]
            r["stats"]["median_s"] *= float(_amx_like(s["m"], s["n"], s["k"]))
    calibration = cal.fit(records, base, "amx.jsonl")
    rows = {q.name: q for q in calibration.quality}
    curve, table = rows["gemm bf16"], rows["table gemm bf16 (fit: leave-one-out)"]
    assert curve.held_mape > 0.2
    assert table.held_points == curve.held_points > 10
    assert table.held_mape < 0.08
    assert table.held_mape < curve.held_mape / 3
    # measured with the table of the fitted shapes; the profile's table then has the held-out too
    shipped = next(t for t in calibration.tables if (t.kernel, t.dtype) == ("gemm", "bf16"))
    assert table.fit_points < len(shipped.points) and table.held_mape > 0.003


def _amx_records(truth):
    records = synthetic_records(truth)
    for r in records:
        if r["suite"] == "gemm":
            r["stats"]["median_s"] *= float(_amx_like(r["shape"]["m"], r["shape"]["n"], r["shape"]["k"]))
    return records


def test_the_calibrated_profile_carries_its_tables_and_predictions_use_them(tmp_path):
    base, truth = _truth()
    calibration = cal.fit(_amx_records(truth), base, "synthetic.jsonl")
    assert {(t.kernel, t.dtype) for t in calibration.tables} >= {("gemm", "fp32"), ("gemm", "bf16")}
    path = tmp_path / "with-tables.toml"
    path.write_text(cal.calibrated_profile(base.path, calibration, "synthetic.jsonl", "with-tables", "test"))
    system = load_system(str(path))
    loaded = {(t.kernel, t.dtype): t for t in system.device.measured + system.collectives.measured}
    for t in calibration.tables:
        assert loaded[(t.kernel, t.dtype)].width == t.width
        np.testing.assert_allclose(loaded[(t.kernel, t.dtype)].seconds, t.seconds, rtol=1e-5)
    assert "synthetic.jsonl" in loaded[("gemm", "bf16")].source
    assert not any(".measured." in key for key in system.provenance)  # provenance holds the numbers only
    records = [r for r in _amx_records(truth) if r["suite"] == "gemm" and r["dtype"] == "bf16"]
    held = [r for r in records if cal.held_out(r)]
    assert held and len(loaded[("gemm", "bf16")].points) == len(records)  # measured on them, it keeps the held-out
    shapes = {p[1:4] for p in loaded[("gemm", "bf16")].points}
    assert all((r["shape"]["m"], r["shape"]["n"], r["shape"]["k"]) in shapes for r in held)
    plan = Plan(tp=2, mbs=1, gbs=2)
    model = "layers=2,hidden=512,heads=8,seq=256,vocab=1024"
    with_tables = predict(model, system, plan, "bf16")
    without = predict(model, dataclasses.replace(system, device=dataclasses.replace(system.device, measured=())),
                      plan, "bf16")
    assert without.compute_extrapolated_share == pytest.approx(1.0)
    assert 0.0 <= with_tables.compute_extrapolated_share < 1.0
    assert with_tables.as_json()["compute_extrapolated_share"] == with_tables.compute_extrapolated_share
    from perfsim.report import format_prediction
    measured_line = f"compute from measured kernels: {1 - with_tables.compute_extrapolated_share:.0%}"
    assert measured_line in format_prediction(with_tables)
    assert "compute from measured kernels" not in format_prediction(without)
    # recalibrating from a profile with tables starts from its curves alone
    again = cal.fit(_amx_records(truth), system, "synthetic.jsonl")
    assert [t.points for t in again.tables] == [t.points for t in calibration.tables]


def test_a_profile_without_tables_predicts_as_before():
    # dgx-a100 (dgx-h100 carries the H200 ledger's GEMM table since 2026-11)
    system = load_system("dgx-a100")
    assert for_dtype(system, "bf16") is system  # nothing to apply: no copy, no cost
    p = predict("gpt3-1.3b", system, Plan(tp=2, dp=4, mbs=2, gbs=64), "bf16")
    assert p.compute_extrapolated_share == pytest.approx(1.0)


def _profile_with(tmp_path, table_text: str):
    text = open(load_system("cpu-example").path).read() + table_text
    path = tmp_path / "p.toml"
    path.write_text(text)
    return str(path)


GOOD = """
[device.measured.gemm.bf16]
provenance = "measured"
source = "a test"
width_octaves = 0.5
columns = ["count", "m", "n", "k", "seconds"]
points = [[1, 64, 64, 64, 1e-5]]
"""


@pytest.mark.parametrize("change, message", [
    (("gemm.bf16", "gemm.bf17"), "unknown dtype device.measured.gemm.bf17"),
    (("gemm.bf16", "gemmm.bf16"), "unknown kernel device.measured.gemmm"),
    (('"measured"\nsource', '"assumed"\nsource'), 'provenance must be "measured"'),
    (("1e-5]]", "-1e-5]]"), r"points\[0\] must be 5 positive numbers"),
    (("1e-5]]", "1e-5, 3]]"), r"points\[0\] must be 5 positive numbers"),
    (('"k", "seconds"', '"seconds", "k"'), "columns must be"),
    (("width_octaves = 0.5", "width_octaves = -1"), "width_octaves.value must be above 0"),
    (("width_octaves = 0.5\n", ""), "has no width_octaves"),
    (("points = [[1, 64, 64, 64, 1e-5]]", "points = []"), "points must be a list of 1 to"),
])
def test_bad_tables_are_one_line_errors_naming_the_key(tmp_path, change, message):
    path = _profile_with(tmp_path, GOOD.replace(*change))
    with pytest.raises(PerfsimError, match=message) as error:
        load_system(path)
    assert "\n" not in str(error.value)


def test_a_good_table_loads(tmp_path):
    system = load_system(_profile_with(tmp_path, GOOD))
    (table,) = system.device.measured
    assert (table.kernel, table.dtype, table.width, table.points) == ("gemm", "bf16", 0.5, ((1, 64, 64, 64, 1e-5),))


def test_leave_one_out_chooses_a_width_and_never_sees_the_point_it_predicts():
    system = load_system("cpu-example")
    peak = system.device.peak_flops_bf16
    table = _gemm_table(system.device, peak, itertools.product(DIMS, repeat=3))
    at = gemm_curve_time(system.device, peak, *table.coordinates_linear())
    best = measured.best_width(table, at)
    assert best.width in measured.WIDTHS
    errors = {w: measured.leave_one_out_error(dataclasses.replace(table, width=w), at) for w in measured.WIDTHS}
    assert errors[best.width] == min(errors.values())
    # a lone point predicted from nothing else is the curve: its error is the machine's own deviation
    lone = measured.KernelTable("gemm", "bf16", table.points[:1], 0.5)
    assert measured.leave_one_out_error(lone, at[:1]) == pytest.approx(abs(1 - float(_amx_like(64, 64, 64))))


def test_no_table_where_the_curve_predicts_the_points_better_than_they_predict_each_other():
    """Points scattered at random around the curve (noise, no structure): interpolating them
    predicts each from its neighbours' noise, worse than the curve; calibration keeps no table."""
    system = load_system("cpu-example")
    peak = system.device.peak_flops_bf16
    rng = np.random.default_rng(3)
    shapes = list(itertools.product(DIMS, repeat=3))
    noisy = dict(zip(shapes, np.exp(rng.normal(0, 0.2, len(shapes)))))
    table = _gemm_table(system.device, peak, shapes, speed=lambda m, n, k: noisy[(m, n, k)])
    at = gemm_curve_time(system.device, peak, *table.coordinates_linear())
    assert measured.best_width(table, at) is None


def test_collective_tables_correct_the_link_model_at_their_group_and_leave_other_groups_alone(tmp_path):
    from perfsim.cost.topology import TopologyCommModel, clear_caches

    base, truth = _truth()
    records = synthetic_records(truth, noise=0.0)
    for r in records:  # a machine whose all-reduces above 64 KiB take twice the link model's time
        if r["suite"] == "collective" and r["op"] == "all_reduce" and r["shape"]["nbytes"] > 1 << 16:
            r["stats"]["median_s"] *= 2
    for r in records:
        r["stats"].setdefault("mean_s", r["stats"]["median_s"])
    calibration = cal.fit(records, base, "coll.jsonl")
    kinds = {(t.kernel, t.dtype) for t in calibration.tables}
    assert ("all_reduce", "fp32") in kinds
    path = tmp_path / "coll.toml"
    path.write_text(cal.calibrated_profile(base.path, calibration, "coll.jsonl", "coll", "test"))
    system = for_dtype(load_system(str(path)), "fp32")
    assert any(t.kernel == "all_reduce" for t in system.collectives.measured)
    clear_caches()
    comm = TopologyCommModel(system)
    plain = TopologyCommModel(dataclasses.replace(system, collectives=dataclasses.replace(system.collectives, measured=())))
    machine = TopologyCommModel(truth)
    big, small = float(1 << 24), float(1 << 11)
    assert float(comm.all_reduce(big, 2, 1)) == pytest.approx(2 * float(machine.all_reduce(big, 2, 1)), rel=0.05)
    assert float(comm.all_reduce(small, 2, 1)) == pytest.approx(float(machine.all_reduce(small, 2, 1)), rel=0.05)
    # the link model alone cannot follow a step in one operation's speed: the table does
    sizes = [float(1 << e) for e in range(10, 27)]
    truth_times = [float(machine.all_reduce(n, 2, 1)) * (2 if n > 1 << 16 else 1) for n in sizes]
    error = lambda model: np.mean([abs(float(model.all_reduce(n, 2, 1)) / t - 1) for n, t in zip(sizes, truth_times)])  # noqa: E731
    assert error(comm) < 0.05 < error(plain)
    # a group of 8 ranks was never measured: 2 octaves from every point, mostly the model
    assert float(comm.all_reduce(big, 8, 1)) == pytest.approx(float(plain.all_reduce(big, 8, 1)), rel=0.05)
    arrays = comm.all_reduce(np.array([big, small, big]), np.array([2, 2, 1]), np.array([1, 1, 1]))
    np.testing.assert_allclose(arrays, [float(comm.all_reduce(big, 2, 1)), float(comm.all_reduce(small, 2, 1)), 0.0])


def test_an_fp8_step_uses_the_bf16_tables_for_what_runs_in_bf16_and_none_for_its_fp8_gemms():
    system = load_system("cpu-example")
    peak = system.device.peak_flops_bf16
    table = _gemm_table(system.device, peak, [(1024, 1024, 1024)])
    device = dataclasses.replace(system.device, measured=(table,), peak_flops_fp8=4 * peak)
    fp8 = for_dtype(dataclasses.replace(system, device=device), "fp8").device
    assert fp8.kernel_dtype == "bf16"
    g = Gemm("g", 1, 1024, 1024, 1024)
    bf16_time, bf16_share = gemm_time_and_share(fp8, peak, g)  # a bf16 GEMM of the fp8 step (attention, logits)
    assert bf16_share < 0.1 and bf16_time < 0.5 * float(gemm_curve_time(fp8, peak, 1, 1024, 1024, 1024))
    fp8_time, fp8_share = gemm_time_and_share(fp8, 4 * peak, g)  # a weight GEMM at the fp8 peak: the curve
    assert fp8_share == 1.0 and fp8_time == pytest.approx(float(gemm_curve_time(fp8, 4 * peak, 1, 1024, 1024, 1024)))


def _wavy(s):
    """A speed no single efficiency describes: 0.5x to 2x the curve's time, smoothly in octaves of s."""
    return float(np.exp(0.7 * np.sin(2.0 * np.log2(s))))


def _flash_records(truth, seqs=(128, 256, 512, 1024, 2048), slowdown=lambda s: 1.0):
    """Causal fused-attention records (ops "flash", "flash_backward") timed by `truth`'s flash model
    times `slowdown(seq)`."""
    from perfsim.cost.layer import flash_curve_times

    records = []
    for dtype in ("fp32", "bf16"):
        peak = getattr(truth.device, f"peak_flops_{dtype}")
        for s, heads in itertools.product(seqs, (8, 16)):
            times = flash_curve_times(truth.device, peak, heads, s, s, 64)
            for op, t in zip(measured.FLASH_KERNELS, times):
                records.append({"schema": 1, "key": f"attention:{op}:{dtype}:{s}:{heads}", "suite": "attention",
                                "op": op, "dtype": dtype, "device": {"kind": "cpu"},
                                "shape": {"batch": 1, "heads": heads, "seq": s, "head_dim": 64},
                                "stats": {"median_s": float(t) * slowdown(s)}})
    return records


def test_flash_efficiencies_are_fitted_from_the_fused_kernels_times():
    base, truth = _truth()
    truth = dataclasses.replace(truth, device=dataclasses.replace(truth.device, flash_forward_efficiency=0.3,
                                                                  flash_backward_efficiency=0.12))
    calibration = cal.fit(synthetic_records(truth) + _flash_records(truth), base, "synthetic.jsonl")
    values = {k: v.value for k, v in calibration.values.items()}
    # relative to the fitted fp32 peak (the truth's, within the GEMM fit's noise)
    peak_ratio = calibration.system.device.peak_flops_fp32 / truth.device.peak_flops_fp32
    assert values["device.flash_forward_efficiency"] * peak_ratio == pytest.approx(0.3, rel=0.05)
    assert values["device.flash_backward_efficiency"] * peak_ratio == pytest.approx(0.12, rel=0.05)
    rows = {q.name: q for q in calibration.quality}
    assert rows["flash attention flash fp32"].fit_mape < 0.02
    assert not any(r["op"].startswith("flash") for r in synthetic_records(truth) if r["suite"] == "attention")


def test_a_flash_kernel_the_curve_cannot_describe_is_predicted_from_its_table(tmp_path):
    """The kernel's speed swings 2x either way with the sequence length: one efficiency cannot say
    so, the table does; the profile carries [device.measured.flash.fp32] and a flash step's
    prediction uses it."""
    from perfsim.cost.layer import flash_attention_times

    base, truth = _truth()
    seqs = (128, 160, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048)
    records = synthetic_records(truth) + _flash_records(truth, seqs, _wavy)
    calibration = cal.fit(records, base, "synthetic.jsonl")
    tables = {(t.kernel, t.dtype): t for t in calibration.tables}
    assert ("flash", "fp32") in tables and ("flash_backward", "fp32") in tables
    rows = {q.name: q for q in calibration.quality}
    curve_alone = rows["flash attention flash fp32"]
    table = rows["table flash fp32 (fit: leave-one-out)"]
    assert table.held_points == curve_alone.held_points > 0
    assert table.held_mape < curve_alone.held_mape / 2
    path = tmp_path / "flash.toml"
    path.write_text(cal.calibrated_profile(base.path, calibration, "synthetic.jsonl", "flash", "test"))
    system = for_dtype(load_system(str(path)), "fp32")
    dev = system.device
    for s in (256, 2048):  # measured shapes: the measurement
        forward, backward, forward_share, _ = flash_attention_times(dev, dev.peak_flops_fp32, Gemm("scores", 16, s, s, 64))
        from perfsim.cost.layer import flash_curve_times

        true_forward = flash_curve_times(truth.device, truth.device.peak_flops_fp32, 16, s, s, 64)[0] * _wavy(s)
        assert float(forward) == pytest.approx(true_forward, rel=0.15)
        assert forward_share < 0.5
    flash = predict("layers=2,hidden=512,heads=8,seq=1024,vocab=1024", system, Plan(mbs=1, gbs=1, attention="flash"), "fp32")
    bare = dataclasses.replace(system, device=dataclasses.replace(dev, measured=()))
    curve_only = predict("layers=2,hidden=512,heads=8,seq=1024,vocab=1024", bare, Plan(mbs=1, gbs=1, attention="flash"), "fp32")
    assert flash.compute_extrapolated_share < curve_only.compute_extrapolated_share == pytest.approx(1.0)


def test_draws_over_a_profile_with_tables_price_as_draw_by_draw():
    """Under --uncertainty the device's numbers are arrays over the draws: the curve at a table's
    points is then one curve per draw, and each draw's correction its own (a GEMM table on
    dgx-a100, its efficiencies and peaks drawn); the same as evaluating each draw alone."""
    from perfsim.cost.columns import columns_of
    from perfsim.predict import evaluate
    from perfsim.spec.model import load_model
    from perfsim.uncertainty.sampling import with_numbers, draw, evaluate_draws

    base = load_system("dgx-a100")
    shapes = [(1, m, n, k) for m in (2048, 4096) for n in (1024, 3072) for k in (1024, 4096)]
    points = tuple((*shape, 1.2 * float(gemm_curve_time(base.device, 312e12, *shape)) * (1 + 0.1 * (i % 3)))
                   for i, shape in enumerate(shapes))
    system = dataclasses.replace(base, device=dataclasses.replace(
        base.device, measured=(measured.KernelTable(measured.GEMM, "bf16", points, 0.5),)))
    model = load_model("layers=4,hidden=1024,heads=16,seq=2048,vocab=32000")
    draws, plan = draw(system, 8, comm_points=2), Plan(tp=2, dp=4, mbs=1, gbs=8)
    together = evaluate_draws(model, draws, columns_of(plan), "bf16")["step_time_s"]
    for i in (0, 3, 7):
        alone = evaluate(model, with_numbers(system, dict(zip(draws.keys, draws.values[i]))), columns_of(plan), "bf16")
        assert float(alone["step_time_s"]) == pytest.approx(together[i], rel=1e-12)
