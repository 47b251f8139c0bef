"""validate.speed_probe: which timed steps ran at the profile's speed, and what a plan's step time
is then (docs/real-steps-timing.md, "Machine speed")."""

from __future__ import annotations

import statistics

import pytest

from perfsim.cost.layer import gemm_time
from perfsim.predict import peak_flops
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system
from validate import speed_probe, timing


def test_a_step_is_at_speed_within_the_tolerance_either_way():
    assert speed_probe.at_speed(1.0, 1.0, 0.15)
    assert speed_probe.at_speed(1.15, 1.0, 0.15) and not speed_probe.at_speed(1.16, 1.0, 0.15)
    assert speed_probe.at_speed(1 / 1.15, 1.0, 0.15) and not speed_probe.at_speed(0.86, 1.0, 0.15)
    assert speed_probe.at_speed(123.0, None, 0.15)  # no expected time: every step counts
    assert speed_probe.at_speed(1e9, 1.0, float("inf"))


def test_step_time_is_the_median_of_the_steps_at_speed_else_of_all():
    assert speed_probe.step_time([1.0, 5.0, 2.0, 3.0], [True, False, True, True]) == 2.0
    assert speed_probe.step_time([1.0, 5.0, 2.0], [False, False, False]) == 2.0


def test_a_plan_stops_stepping_when_enough_steps_at_speed_agree():
    """`steps` steps at speed within tolerance / 2 of their median: mkl-compat r7's 1d + SP plan
    with full recomputation (4.10, 3.94, 3.30 s, all at speed by the probes) steps on; three steps
    within 7.5% of their median stop it, however many steps disagree beside them."""
    r7 = [4.10, 3.94, 3.30]
    assert not speed_probe.steps_settled(r7, [True] * 3, 3, 0.15)
    assert not speed_probe.steps_settled(r7 + [3.30], [True] * 4, 3, 0.15)  # median 3.62: none within 7.5%
    assert speed_probe.steps_settled(r7 + [3.30, 3.32], [True] * 5, 3, 0.15)  # median 3.32: three agree
    assert speed_probe.steps_settled([1.0, 1.07, 0.94], [True] * 3, 3, 0.15)
    assert not speed_probe.steps_settled([1.0, 1.0, 9.0], [True, True, False], 3, 0.15)  # two at speed
    assert speed_probe.steps_settled([1.0, 9.0, 1.01, 1.02], [True, False, True, True], 3, 0.15)
    assert speed_probe.steps_settled([1.0, 3.0, 9.0], [True] * 3, 3, float("inf"))  # every step counts


def test_the_probe_is_the_models_fc1_at_the_plans_micro_batch_priced_by_the_profile():
    model = load_model("gpt3-350m")
    g = speed_probe.probe_gemm(model, Plan(tp=2, mbs=3))
    assert (g.count, g.m, g.n, g.k) == (1, 3 * model.seq, model.ffn_size, model.hidden)  # tp = 1 whatever the plan
    system = load_system("cpu-calibrated")
    assert speed_probe.expected_probe_s(system, "bf16", g) == float(gemm_time(system.device, peak_flops(system, "bf16"), g))


def test_the_norm_probe_is_the_models_layernorm_priced_as_the_calibration_records_it():
    from perfsim.cost.layer import KIND_TRAFFIC, MemoryOp, memory_time

    model = load_model("gpt3-350m")
    rows, cols = speed_probe.probe_norm(model, Plan(tp=2, mbs=3))
    assert (rows, cols) == (3 * model.seq, model.hidden)  # tp = 1 whatever the plan
    system = load_system("cpu-calibrated")
    passes, extra = KIND_TRAFFIC["layernorm"]
    by_hand = float(memory_time(system.device, MemoryOp("layernorm", (2 * passes + extra) * rows * cols, "layernorm")))
    assert speed_probe.expected_norm_probe_s(system, "bf16", (rows, cols)) == pytest.approx(by_hand, rel=1e-12)


def test_a_step_is_at_speed_only_by_every_probe():
    assert speed_probe.all_at_speed([1.0, 1.1], [1.0, 1.0], 0.15)
    assert not speed_probe.all_at_speed([1.0, 1.3], [1.0, 1.0], 0.15)
    assert speed_probe.all_at_speed([1.0, 9.0], [1.0, None], 0.15)  # a probe without a prediction lets it pass


def test_rounds_merge_the_speed_flags_and_older_records_count_every_step():
    new = {"step_times_s": [1.0, 9.0], "at_speed": [True, False], "probe_s": [0.1, 0.5], "probe_expected_s": 0.1,
           "norm_probe_s": [0.02, 0.04], "norm_probe_expected_s": 0.02, "step_time_s": 1.0, "peak_memory_bytes": 1.0}
    old = {"step_times_s": [3.0], "step_time_s": 3.0, "peak_memory_bytes": 2.0}  # before the probe
    merged = timing.merge_rounds([new, old])
    assert merged["at_speed"] == [True, False, True] and merged["step_time_s"] == 2.0
    speed = timing.machine_speed(merged)
    assert speed["steps"] == 3 and speed["steps_at_speed"] == 2 and speed["step_time_all_steps_s"] == 3.0
    assert speed["probe_over_profile"] == pytest.approx(3.0)  # median of 0.1 and 0.5 over 0.1
    assert speed["norm_probe_over_profile"] == pytest.approx(1.5)
    assert merged["norm_probe_s"] == [0.02, 0.04, None]
    assert timing.machine_speed(old)["probe_over_profile"] is None
    assert timing.machine_speed(old)["norm_probe_over_profile"] is None


def test_the_command_line_default_is_the_probes():
    from perfsim import cli

    assert cli.make_parser().parse_args(["validate"]).speed_tolerance == speed_probe.DEFAULT_TOLERANCE


def test_a_profile_with_reference_kernels_is_judged_by_them():
    """A calibrated profile carries its reference kernels' typical times (perfsim.calibrate.drift):
    validate's probes are then those kernels at those times, whatever the model; a profile without
    them prices the model's FC1 and LayerNorm."""
    import dataclasses

    model, plan = load_model("gpt3-350m"), Plan(tp=2, mbs=2, gbs=4)
    system = load_system("cpu-example")
    gemm, norm, reference = speed_probe.probe_expectations(system, "bf16", model, plan)
    assert not reference
    assert gemm == speed_probe.expected_probe_s(system, "bf16", speed_probe.probe_gemm(model, plan))
    assert norm == speed_probe.expected_norm_probe_s(system, "bf16", speed_probe.probe_norm(model, plan))
    calibrated = dataclasses.replace(system, device=dataclasses.replace(
        system.device, speed_reference_gemm_s=4.6e-3, speed_reference_norm_s=2e-4))
    assert speed_probe.probe_expectations(calibrated, "bf16", model, plan) == (4.6e-3, 2e-4, True)
    # a record read back is judged against the probes it timed, whatever the profile would use now
    assert speed_probe.probe_expectations(calibrated, "bf16", model, plan, reference=False) == (gemm, norm, False)
    assert speed_probe.probe_expectations(system, "bf16", model, plan, reference=True) == (None, None, True)


@pytest.mark.multiprocess
def test_reference_probes_time_the_calibrations_reference_kernels():
    """A real plan on two CPU ranks with the reference probes: every timed step carries their
    times, near what the kernels take alone on this machine (the same References)."""
    import torch

    from validate.device import Device
    from validate.microbench import References

    plan = timing.parse_plans("tp=2,mbs=1,gbs=1")[0]
    model = "layers=2,hidden=128,heads=4,seq=64,vocab=512,tied_embeddings=false,dropout=false"
    alone = References(torch, Device("cpu", 0, 1)).time()
    got = timing.measure_plan(plan, model, "cpu", 2, "fp32", 2, 1, 60, 1, alone["gemm"], 10.0, alone["memory"],
                              reference_probes=True)
    assert len(got["probe_s"]) == len(got["norm_probe_s"]) == len(got["step_times_s"]) >= 2
    # each probe's median over the steps: on two cores a step's probe now and then reads several
    # times slow (in a full test run once 6.7x), which says nothing of which kernels it timed
    for probes, expected in ((got["probe_s"], alone["gemm"]), (got["norm_probe_s"], alone["memory"])):
        assert all(p > 0 for p in probes) and 0.2 * expected < statistics.median(probes) < 5 * expected, (probes, expected)
    assert all(got["at_speed"])  # a tolerance of 10x: the kernels ran, and were judged against those times
    assert got["reference_probes"] is True  # recorded, so that a read-back is judged against the same kernels


def test_the_error_at_the_measured_speed_moves_each_probed_part_by_its_probe():
    """A step whose GEMM probe ran 2x the profile's time has its compute predicted twice as long,
    its optimizer by the LayerNorm probe, its communication as predicted; the median over steps."""
    prediction = {"step_time_s": 10.0, "time_breakdown_s": {"compute": 5.0, "recompute": 1.0, "pp_bubble": 1.0,
                                                            "tp_comm": 2.0, "optimizer": 0.5, "other": 0.5}}
    measured = {"step_times_s": [17.0, 10.0, 10.0], "probe_s": [2.0, 1.0, 1.0], "probe_expected_s": 1.0,
                "norm_probe_s": [3.0, 1.0, 1.0], "norm_probe_expected_s": 1.0}
    # step 1: 10 + 7 x (2 - 1) + 1 x (3 - 1) = 19 against 17; steps 2 and 3: 10 against 10
    assert timing.error_at_measured_speed(measured, prediction) == pytest.approx(0.0)
    # probes reading 2 and 2: 10 + 7 x 1 + 1 x 1 = 18 twice; 3 and 3: 10 + 7 x 2 + 1 x 2 = 26
    measured = dict(measured, step_times_s=[18.0 / 1.1, 18.0 / 1.1, 26.0 / 1.2], probe_s=[2.0, 2.0, 3.0],
                    norm_probe_s=[2.0, 2.0, 3.0])
    assert timing.error_at_measured_speed(measured, prediction) == pytest.approx(0.1)
    # without a LayerNorm probe the GEMM probe's ratio stands in for it
    without_norm = dict(measured, norm_probe_s=None, norm_probe_expected_s=None)
    assert timing.error_at_measured_speed(without_norm, prediction) == pytest.approx(0.1)
    assert timing.error_at_measured_speed({"step_times_s": [1.0]}, prediction) is None  # before the probes
    assert timing.error_at_measured_speed(dict(measured, probe_expected_s=None), prediction) is None


def test_a_budget_gives_each_plan_an_equal_share_for_its_retakes():
    """What is left of the run's budget split over the plans still to run, less what a plan costs
    besides its timed steps; never below 0; no budget, no limit."""
    assert speed_probe.retake_seconds(None, 50.0, 3, 4.0) is None
    assert speed_probe.retake_seconds(100.0, 10.0, 3, 5.0) == pytest.approx(25.0)  # 90 / 3 - 5
    assert speed_probe.retake_seconds(100.0, 120.0, 2, 0.0) == 0.0  # spent: --steps steps only
    assert speed_probe.retake_seconds(60.0, 0.0, 0, 0.0) == 60.0  # (a last plan re-measured)


@pytest.mark.multiprocess
def test_a_plan_out_of_its_budget_takes_only_its_steps():
    """Every step off the profile's speed (a probe priced a million times too fast): without a
    budget a plan takes 3 x --steps timed steps hoping for some at speed; with none left it takes
    its --steps and stops, whether the limit is given (--retake-until) or the ranks share out a
    budget over the plans of one launch (--budget), where every plan gets its own result, in order."""
    plans = timing.parse_plans("tp=2,mbs=1,gbs=1;tp=2,mbs=1,gbs=2")
    model = "layers=1,hidden=64,heads=2,seq=32,vocab=256,tied_embeddings=false,dropout=false"
    common = (plans[0], model, "cpu", 2, "fp32", 2, 1, 60, 1, 1e-9)
    unlimited = timing.measure_plan(*common)
    spent = timing.measure_plan(*common, retake_until_s=0.0)
    assert not any(unlimited["at_speed"]) and len(unlimited["step_times_s"]) == speed_probe.MAX_STEPS_FACTOR * 2
    assert not any(spent["at_speed"]) and len(spent["step_times_s"]) == 2
    jobs = [{"plan": plan, "probe_expected_s": 1e-9, "norm_probe_expected_s": None, "reference_probes": False}
            for plan in plans]
    seen = []
    shared = timing.measure_plans(jobs, model, "cpu", 2, "fp32", 2, 1, 60, 1, budget_s=0.0,
                                  done=lambda n, got: seen.append(n))
    assert seen == [0, 1] and all(len(got["step_times_s"]) == 2 for got in shared)
    assert shared[1]["flops"] == pytest.approx(2 * shared[0]["flops"])  # two micro-batches, in the plans' order


@pytest.mark.multiprocess
def test_jobs_of_one_launch_may_each_train_a_model_of_their_own():
    """validate.steps --jobs: a job with a "model" of its own trains it, one without trains
    --model's (the Slurm calibration job's overhead runs: one launch, three calibration models)."""
    plan = timing.parse_plans("dp=2,mbs=1,gbs=2")[0]
    small = "layers=1,hidden=64,heads=2,seq=32,vocab=256,tied_embeddings=false,dropout=false"
    jobs = [{"plan": plan, "probe_expected_s": None, "norm_probe_expected_s": None, "reference_probes": False},
            {"plan": plan, "probe_expected_s": None, "norm_probe_expected_s": None, "reference_probes": False,
             "model": small.replace("layers=1", "layers=3")}]
    one, three = timing.measure_plans(jobs, small, "cpu", 2, "fp32", 1, 1, 60, 1)
    per_layer = (three["flops"] - one["flops"]) / 2
    assert per_layer > 0 and one["flops"] > per_layer  # three layers against one, the rest alike
