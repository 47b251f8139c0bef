"""Framework overheads measured by construction (perfsim.calibrate.overheads; docs/equations.md 8.2):
the loop's per-step, per-micro-batch and per-layer host time, fitted on real steps of a calibration
model, and how predictions charge them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from perfsim.calibrate import overheads as oh
from perfsim.predict import predict
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan, plan_problems
from perfsim.spec.system import load_system

TRUTH = {"framework.step_overhead_s": 0.012, "framework.microbatch_overhead_s": 0.004,
         "framework.layer_overhead_s": 0.0015}


def _with(system, **framework):
    return dataclasses.replace(system, framework=dataclasses.replace(system.framework, **framework))


def _records(system, truth=TRUTH, dtype="fp32", noise=0.0, seed=0):
    """Step records as validate.timing writes them, their times from `system` with `truth`'s overheads."""
    rng = np.random.default_rng(seed)
    machine = _with(system, **{k.split(".")[1]: v for k, v in truth.items()})
    records = []
    for model, plans in oh.overhead_cases(2):
        for plan in plans:
            t = predict(model, oh.as_trained(machine, dtype), plan, dtype).step_time_s * float(np.exp(rng.normal(0, noise)))
            records.append({"suite": "step", "model": model, "plan": plan.as_dict(), "dtype": dtype,
                            "measured": {"step_time_s": t}})
    return records


def test_the_fit_finds_the_overheads_back_and_predicts_the_held_out_run():
    system = load_system("cpu-calibrated")
    values, quality, notes = oh.fit_framework_overheads(_records(system), system, "steps.jsonl")
    for key, value in TRUTH.items():
        assert values[key].value == pytest.approx(value, rel=1e-6, abs=1e-9)
        assert "steps.jsonl" in values[key].source
    row, variants = quality
    assert row.fit_points == len(oh.OVERHEAD_RUNS) - 1 and row.held_points == 1
    assert row.fit_mape < 1e-6 and row.held_mape < 1e-6
    assert "kernels, collectives and optimizer alone" in row.note
    # the flash and full-recomputation layers, held out, priced by the ops they dispatch
    assert variants.fit_points == 0 and variants.held_points == len(oh.VARIANT_RUNS) and variants.held_mape < 1e-6
    assert "flash attention" in variants.name and "full recomputation" in variants.name


def test_noisy_runs_still_predict_the_held_out_run_within_the_noise():
    system = load_system("cpu-calibrated")
    values, quality, _ = oh.fit_framework_overheads(_records(system, noise=0.03, seed=4), system, "s")
    assert quality[0].held_mape < 0.1
    assert all(v.value >= 0 for v in values.values())


def test_runs_in_a_slow_spell_are_moved_to_the_profiles_speed_by_their_probes():
    """Every fitted run met a spell in which both probes read 1.5x the profile's time (no step at
    speed): its kernels took longer by half their probed parts (perfsim.probed_speed). The fit
    takes that out and finds the loop's own time again; taken as measured, the spell would be
    fitted into the overheads (mkl-compat r8: held-out 66% where it is now 6%)."""
    from perfsim.probed_speed import speed_shifts

    system = load_system("cpu-calibrated")
    zero = _with(system, step_overhead_s=0.0, microbatch_overhead_s=0.0, layer_overhead_s=0.0)
    records = _records(system)
    slow = {"probe_s": [1.5] * 3, "probe_expected_s": 1.0, "norm_probe_s": [1.5] * 3, "norm_probe_expected_s": 1.0,
            "at_speed": [False] * 3}
    for r in records:
        model, plan = load_model(r["model"]), Plan(**r["plan"])
        if (model.layers, plan.microbatches) == oh.OVERHEAD_RUNS[-1]:  # the held-out runs stay at speed
            continue
        p0 = predict(model, oh.as_trained(zero, "fp32"), plan, "fp32")
        t = r["measured"]["step_time_s"] + speed_shifts(slow, p0.time_breakdown_s)[0]
        r["measured"] = {**slow, "step_times_s": [t] * 3, "step_time_s": t}
    values, quality, _ = oh.fit_framework_overheads(records, system, "s")
    for key, value in TRUTH.items():
        assert values[key].value == pytest.approx(value, rel=1e-6, abs=1e-9)
    assert quality[0].held_mape < 1e-6
    as_measured = [{**r, "measured": {"step_time_s": r["measured"]["step_time_s"]}} for r in records]
    _, spell, _ = oh.fit_framework_overheads(as_measured, system, "s")
    assert spell[0].held_mape > 0.1


def test_a_run_is_taken_from_its_steps_at_speed_each_moved_by_its_probes():
    breakdown = {"compute": 1.0, "optimizer": 0.5, "tp_comm": 2.0}
    measured = {"step_times_s": [4.0, 9.0, 3.4], "step_time_s": 3.7, "at_speed": [True, False, True],
                "probe_s": [1.1, 3.0, 0.9], "probe_expected_s": 1.0, "norm_probe_s": [1.0, 1.0, 0.8],
                "norm_probe_expected_s": 1.0}
    # steps 1 and 3: 4.0 - 0.1 and 3.4 + 0.1 + 0.1; their median
    assert oh.at_profile_speed(measured, breakdown) == pytest.approx((3.9 + 3.6) / 2)
    assert oh.at_profile_speed({"step_time_s": 3.7, "step_times_s": [3.7]}, breakdown) == 3.7  # before the probes
    none_at_speed = dict(measured, at_speed=[False] * 3)
    assert oh.at_profile_speed(none_at_speed, breakdown) == pytest.approx(3.9)  # 3.9, 9 - 2 - 0 = 7, 3.6


def test_too_few_runs_leave_the_profile_alone():
    system = load_system("cpu-calibrated")
    values, quality, notes = oh.fit_framework_overheads(_records(system)[:2], system, "s")
    assert values == {} and quality == [] and "3 needed" in notes[0]


def test_predictions_charge_the_overheads_per_layer_and_micro_batch():
    """One stage, m micro-batches of L layers: the step gains m (L x layer + micro-batch) plus the
    step's own; full recomputation replays the layer's forward ops and checkpointing's own, 189
    dispatched ops a layer where the layer alone has 116 (perfsim.cost.host.HARNESS_LAYER_OPS)."""
    base = load_system("cpu-calibrated")
    model = load_model("layers=4,hidden=256,heads=4,seq=128,vocab=2048")
    plan = Plan(dp=2, mbs=1, gbs=6)
    layer, mb, step = 0.002, 0.005, 0.03
    with_overheads = _with(base, layer_overhead_s=layer, microbatch_overhead_s=mb, step_overhead_s=step)
    without = _with(base, layer_overhead_s=0.0, microbatch_overhead_s=0.0, step_overhead_s=0.0)
    m = plan.microbatches
    delta = predict(model, with_overheads, plan, "fp32").step_time_s - predict(model, without, plan, "fp32").step_time_s
    assert delta == pytest.approx(m * (model.layers * layer + mb) + step, rel=1e-9)
    full = plan.replace(recompute="full")
    delta_full = (predict(model, with_overheads, full, "fp32").step_time_s
                  - predict(model, without, full, "fp32").step_time_s)
    assert delta_full == pytest.approx(m * (model.layers * layer * 189 / 116 + mb) + step, rel=1e-9)


def test_the_calibration_model_is_not_the_validation_model_and_its_runs_are_valid():
    from validate.timing import DEFAULT_MODEL

    validation = load_model(DEFAULT_MODEL)
    for spec, plans in oh.overhead_cases(8) + oh.overhead_cases(2, quick=True):
        model = load_model(spec)
        assert (model.hidden, model.heads, model.seq, model.vocab) != (validation.hidden, validation.heads,
                                                                       validation.seq, validation.vocab)
        for plan in plans:
            assert not plan_problems(plan, model, plan.devices)
    runs = {(load_model(spec).layers, plan.microbatches) for spec, plans in oh.overhead_cases(2) for plan in plans}
    assert runs == set(oh.OVERHEAD_RUNS)


def test_the_overheads_ledger_sits_beside_the_calibration_ledger():
    assert oh.overheads_ledger("runs/calibration-cpu.jsonl") == "runs/calibration-cpu-overheads.jsonl"
    assert oh.overheads_ledger("ledger") == "ledger-overheads.jsonl"


def _host_records(system, truth=TRUTH, dtype="bf16", world=2):
    """The host model's runs alone on `world` ranks, their times from `system` with `truth`'s overheads."""
    machine = _with(system, **{k.split(".")[1]: v for k, v in truth.items()})
    return [{"suite": "step", "model": model, "plan": plan.as_dict(), "dtype": dtype,
             "measured": {"step_time_s": predict(model, oh.as_trained(machine, dtype), plan, dtype).step_time_s,
                          "alone": True, "world": world}}
            for model, plans in oh.host_cases() for plan in plans]


def test_the_host_models_runs_give_the_layer_overhead_and_the_step_runs_the_rest():
    """The layer's host time from the host model's runs alone (their difference, less the kernels),
    the step and micro-batch terms from the calibration model's runs beside it: all three back
    where the step runs' kernels are priced 10% too slow (a kernel error that the three-term fit
    takes into its layer term, as on CPU ranks)."""
    system = _with(load_system("cpu-calibrated"), rank_jitter=0.0)
    exact = oh.fit_framework_overheads(_records(system) + _host_records(system), system, "steps.jsonl")[0]
    for key, value in TRUTH.items():
        assert exact[key].value == pytest.approx(value, rel=1e-6)
    assert "host model" in exact["framework.layer_overhead_s"].source
    slow = [dict(r, measured={**r["measured"], "step_time_s": 1.1 * r["measured"]["step_time_s"]})
            for r in _records(system)]
    without_host = oh.fit_framework_overheads(slow, system, "s")[0]
    with_host = oh.fit_framework_overheads(slow + _host_records(system), system, "s")[0]
    assert with_host["framework.layer_overhead_s"].value == pytest.approx(TRUTH["framework.layer_overhead_s"], rel=1e-6)
    assert abs(without_host["framework.layer_overhead_s"].value / TRUTH["framework.layer_overhead_s"] - 1) > 0.2


def test_the_host_model_is_small_its_runs_stay_out_of_the_rank_jitter_and_run_in_the_training_dtype():
    from validate.timing import DEFAULT_MODEL

    system = load_system("cpu-calibrated")
    assert all(oh.is_host_run(r) for r in _host_records(system))
    assert not any(oh.is_host_run(r) for r in _records(system))
    validation, calibration = load_model(DEFAULT_MODEL), load_model(oh.CALIBRATION_MODEL.format(layers=1))
    for spec, plans in oh.host_cases():
        host = load_model(spec)
        assert host.hidden < calibration.hidden and host.seq < calibration.seq
        assert (host.hidden, host.seq) != (validation.hidden, validation.seq)
        assert all(not plan_problems(plan, host, 1) for plan in plans)
    # the host runs alone on every rank spread too, but are not the rank-jitter run
    assert oh.fit_rank_jitter(_host_records(system), "s") == ({}, [])
    assert oh.overheads_dtype(("fp32", "bf16")) == "bf16" and oh.overheads_dtype(("fp32",)) == "fp32"
