"""`perfsim validate --device cpu --nproc 2`: real steps per plan, the --json schema, the ledger
(appended, resumed without re-running), and faults (a rank that dies or hangs ends the run with a
clear error within the stated timeout, and what was measured stays in the ledger)."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

import pytest

from perfsim.errors import PerfsimError
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan, plan_problems
from perfsim.spec.system import load_system
from validate import timing

MODEL = "layers=2,hidden=64,heads=4,seq=32,vocab=512,tied_embeddings=false,dropout=false"
PLANS = "tp=2,mbs=2,gbs=4;tp=2,sp=true,recompute=selective,mbs=1,gbs=2"  # mbs 1: DTensor hands on unwaited all-gathers
KEYS = ("plan", "step_time_s", "flops", "comm_bytes", "activation_bytes", "peak_memory_bytes")


def test_default_plans_cover_modes_and_are_valid():
    model = load_model(timing.DEFAULT_MODEL)
    plans = timing.default_plans(2)
    assert len(plans) >= 12
    assert {p.recompute for p in plans} == {"none", "selective", "full"}
    assert {p.schedule for p in plans if p.pp > 1} == {"gpipe", "1f1b", "interleaved"}
    assert {p.zero for p in plans if p.dp > 1} == {0, 1, 2, 3}
    assert any(p.sp for p in plans)
    assert any(p.attention == "flash" and p.tp == 2 for p in plans)
    assert any(p.cp == 2 and p.attention == "flash" for p in plans)
    assert all(timing.harness_problems(p) == [] for p in plans)
    for p in plans:
        assert p.devices == 2 and not plan_problems(p, model, 2), p
    assert {p.tp_mode for p in timing.default_plans(4)} >= {"1d", "2d"}
    assert {p.tp_mode for p in timing.default_plans(8)} >= {"2.5d", "3d"}


def test_parse_plans():
    a, b = timing.parse_plans("tp=2,sp=true,recompute=full; pp=2,vpp=2,gbs=8")
    assert a == Plan(tp=2, sp=True, recompute="full")
    assert b == Plan(pp=2, vpp=2, schedule="interleaved", gbs=8)
    for bad, says in (("tp=x", "tp='x'"), ("banana=2", "'banana=2'"), ("sp=maybe", "sp="), (" ; ", "empty")):
        with pytest.raises(PerfsimError, match=says):
            timing.parse_plans(bad)


def test_bad_input_is_a_one_line_error(run_cli, tmp_path):
    ledger = str(tmp_path / "v.jsonl")
    cases = [(["--plans", "tp=3,mbs=1,gbs=1"], "tp"),
             (["--plans", "tp=2", "--tp", "2"], "not both"),
             (["--warmup", "0"], "--warmup"),
             (["--dtype", "fp16"], "bf16 or fp32"),
             (["--megatron-log", "x.log"], "not both")]
    for extra, says in cases:
        r = run_cli("validate", "--device", "cpu", "--nproc", "2", "--model", MODEL, "--ledger", ledger, *extra)
        assert r.code == 2, (extra, r.err)
        assert says in r.err and r.err.count("\n") == 1, (extra, r.err)


def test_rounds_keep_their_own_keys_and_merge_into_one_measurement():
    """Round 1's key is the key of a run without rounds (old ledgers resume); later rounds' keys
    differ. Merged: every timed step of every round and their median, the largest peak, the
    first round's counts."""
    plan = timing.parse_plans("tp=2")[0]
    args = (MODEL, plan, "bf16", 3, 1, "cpu", 2)
    assert timing.point_key(*args, 1) == timing.point_key(*args)
    assert len({timing.point_key(*args, r) for r in (1, 2, 3)}) == 3
    # a point measured by an older harness is not read back for this one (revision 1 keys as before)
    assert timing.point_key(*args, 1, 1) != timing.point_key(*args)
    assert len({timing.point_key(*args, 1, v) for v in (1, 2, 3)}) == 3
    one = {"step_times_s": [1.0, 2.0, 9.0], "step_time_s": 2.0, "peak_memory_bytes": 10.0, "flops": 5.0}
    two = {"step_times_s": [3.0, 4.0, 5.0], "step_time_s": 4.0, "peak_memory_bytes": 12.0, "flops": 5.0}
    assert timing.merge_rounds([one]) is one
    merged = timing.merge_rounds([one, two])
    assert merged["step_times_s"] == [1.0, 2.0, 9.0, 3.0, 4.0, 5.0] and merged["step_time_s"] == 3.5
    assert merged["peak_memory_bytes"] == 12.0 and merged["flops"] == 5.0 and merged["rounds"] == 2


def entry(steps: int, at_speed: int, gemm: float | None, norm: float | None) -> dict:
    """A --json entry as far as the machine verdict reads it."""
    return {"machine_speed": {"steps": steps, "steps_at_speed": at_speed, "probe_over_profile": gemm,
                              "norm_probe_over_profile": norm}}


def test_the_machine_matches_its_profile_when_half_the_timed_steps_ran_at_its_speed():
    assert timing.machine_matches(3, 3) and timing.machine_matches(3, 6) and not timing.machine_matches(2, 5)
    matched = timing.machine_verdict([entry(3, 3, 1.02, 0.97), entry(5, 3, 1.1, 1.2), entry(4, 2, 1.4, 1.0)])
    assert matched == {"matches": True, "steps": 12, "steps_at_speed": 8, "gemm_over_profile": 1.1,
                       "norm_over_profile": 1.0}
    assert not timing.machine_verdict([entry(3, 3, 1.0, 1.0), entry(9, 2, 1.3, 1.0)])["matches"]  # 5 of 12
    off = timing.machine_verdict([entry(9, 0, 57.0, 3.5), entry(9, 1, 40.0, 3.0), entry(9, 0, 60.0, None)])
    assert off["matches"] is False and (off["steps"], off["steps_at_speed"]) == (27, 1)
    assert off["gemm_over_profile"] == 57.0 and off["norm_over_profile"] == 3.25
    # records from before the probes count every step: the machine matches
    assert timing.machine_verdict([entry(3, 3, None, None)])["matches"]
    text = timing.mismatch_warning(off, "cpu-calibrated", 0.15, "perfsim calibrate X", "perfsim validate Y")
    assert text.startswith("WARNING: this machine runs GEMMs 57x slower and element-wise kernels 3.2x slower than "
                           "profile cpu-calibrated describes") and "1 of 27 timed steps" in text
    assert text.endswith("\n  perfsim calibrate X\n  perfsim validate Y")
    faster = timing.mismatch_warning(timing.machine_verdict([entry(3, 0, 0.2, 1.05)]), "p", 0.15, "c", "v")
    assert "runs GEMMs 5.0x faster than profile p describes" in faster and "element-wise" not in faster


def test_steps_read_back_are_judged_against_the_profile_of_this_run():
    """A ledger's steps were judged by the ranks against the profile they ran under; read back
    under another profile (one calibrated since) or tolerance, they are judged anew."""
    measured = {"step_times_s": [1.0, 2.0, 3.0, 4.0], "step_time_s": 2.5, "at_speed": [True] * 4,
                "probe_s": [1.0, 1.0, 2.0, 2.0], "probe_expected_s": 1.0, "norm_probe_s": [1.0, 1.3, 1.0, 1.0],
                "norm_probe_expected_s": 1.0}
    again = timing.judged(measured, 1.0, 1.0, 0.15)
    assert again["at_speed"] == [True, False, False, False] and again["step_time_s"] == 1.0
    calibrated_since = timing.judged(measured, 2.0, 1.0, 0.15)
    assert calibrated_since["at_speed"] == [False, False, True, True] and calibrated_since["step_time_s"] == 3.5
    assert calibrated_since["probe_expected_s"] == 2.0
    assert timing.judged(measured, 1.0, 1.0, float("inf"))["at_speed"] == [True] * 4
    gemm_only = {k: v for k, v in measured.items() if not k.startswith("norm")}
    assert timing.judged(gemm_only, 1.0, 1.0, 0.15)["at_speed"] == [True, True, False, False]
    before_probes = {"step_times_s": [1.0, 2.0], "step_time_s": 1.5}
    assert timing.judged(before_probes, 1.0, 1.0, 0.15) is before_probes


def test_validate_without_torch_is_a_one_line_error(tmp_path):
    """After `pip install .` alone: torch cannot be imported (here made so), and the command says
    what to install, before any rank starts."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from perfsim.cli import main\n"
            f"sys.exit(main(['validate', '--device', 'cpu', '--model', {MODEL!r}, '--plans', 'tp=2', "
            f"'--ledger', {str(tmp_path / 'v.jsonl')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("perfsim: error: perfsim validate --device cpu needs torch") and "Traceback" not in done.stderr
    assert "pip install torch==2.13.0" in done.stderr and "[validate] extra" in done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "v.jsonl").exists()


def test_validate_help_states_what_it_runs():
    """--model and --system say the harness's defaults, not predict's (gpt3-175b on smng-p2)."""
    from perfsim.commands.validate import HARNESS_MODEL

    assert HARNESS_MODEL == timing.DEFAULT_MODEL and timing.DEFAULT_SYSTEM["cpu"] == "cpu-calibrated"
    done = subprocess.run([sys.executable, "-m", "perfsim.cli", "validate", "--help"], capture_output=True, text=True,
                          timeout=60)
    flat = "".join(done.stdout.split())
    model_help = flat[flat.index("--modelMODELpresetname"):flat.index("--systemSYSTEMprofilename")]
    system_help = flat[flat.index("--systemSYSTEMprofilename"):flat.index("--nodesNODES", flat.index("--systemSYSTEMp"))]
    assert f"with--deviceor--emit-slurm,theharness'ssmallGPT{HARNESS_MODEL}" in model_help
    assert "cpu-calibratedwith--devicecpu" in system_help and "smng-p2with--megatron-log" in system_help
    assert "atleast12plans" in flat


torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    ledger = tmp_path_factory.mktemp("timing") / "validation-cpu.jsonl"
    messages = []
    results = timing.run_plans(timing.parse_plans(PLANS), MODEL, "cpu-calibrated", "cpu", 2, steps=2,
                               ledger_path=str(ledger), timeout_s=60, threads=1, progress=messages.append)
    return ledger, results, messages


@pytest.mark.multiprocess
def test_json_entries_and_exact_counts(first_run):
    ledger, results, messages = first_run
    assert len(results) == 2 and len(messages) == 2 and "[2/2]" in messages[1]
    for r in results:
        for key in KEYS[1:]:
            assert r[key]["predicted"] > 0, (key, r)
        assert r["step_time_s"]["measured"] > 0 and r["peak_memory_bytes"]["measured"] > 0
        # the speed probe ran before every timed step: 2 at the profile's speed, or up to 3 x 2 tried
        speed = r["machine_speed"]
        assert speed["probe_over_profile"] > 0 and 2 <= speed["steps"] <= 6
        assert speed["steps_at_speed"] == 2 or speed["steps"] == 6
        assert r["machine_matches_profile"] is (2 * speed["steps_at_speed"] >= speed["steps"])
        # every rank's own time of every timed step, the job-wide time their slowest (gathered after the step)
        record = next(json.loads(x)["measured"] for x in ledger.read_text().splitlines()
                      if json.loads(x)["plan"] == r["plan"])
        assert [max(ranks) for ranks in record["rank_step_times_s"]] == record["step_times_s"]
        assert all(len(ranks) == 2 for ranks in record["rank_step_times_s"])
        assert r["rank_spread"]["ranks"] == 2 and r["rank_spread"]["cv"] >= 0 and not r["rank_spread"]["alone"]
        # exact by construction of the harness: FLOPs and (for plain 1d) bytes sent
        assert r["flops"]["counted"] == pytest.approx(r["flops"]["predicted"], rel=1e-9)
    plain = results[0]
    assert plain["comm_bytes"]["counted"] == pytest.approx(plain["comm_bytes"]["predicted"], rel=1e-12)
    assert set(plain["comm_bytes_counted_by_kind"]) >= {"all_reduce", "all_gather", "reduce_scatter"}


@pytest.mark.multiprocess
def test_resume_reads_the_ledger_instead_of_running(first_run):
    ledger, results, _ = first_run
    lines = ledger.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(x)["suite"] == "step" for x in lines)
    messages = []
    start = time.perf_counter()
    again = timing.run_plans(timing.parse_plans(PLANS), MODEL, "cpu-calibrated", "cpu", 2, steps=2,
                             ledger_path=str(ledger), timeout_s=60, threads=1, progress=messages.append)
    assert time.perf_counter() - start < 5  # nothing launched
    assert all("from the ledger" in m for m in messages)
    assert [r["step_time_s"]["measured"] for r in again] == [r["step_time_s"]["measured"] for r in results]
    assert ledger.read_text().splitlines() == lines


@pytest.mark.multiprocess
@pytest.mark.parametrize("probe", ["gemm", "norm"])
def test_steps_off_the_profiles_speed_are_retaken_up_to_a_limit_then_all_count(probe):
    """A probe time no machine meets, the GEMM's or the LayerNorm's: the ranks take MAX_STEPS_FACTOR
    x steps, none at speed, and the step time is the median of them all; every rank stopped at the
    same step (the run ends)."""
    from validate.speed_probe import MAX_STEPS_FACTOR

    plan = timing.parse_plans(PLANS)[0]
    expected = {f"{'probe' if probe == 'gemm' else 'norm_probe'}_expected_s": 1e-12}
    got = timing.measure_plan(plan, MODEL, "cpu", 2, "bf16", 2, 1, 60, 1, **expected)
    assert len(got["step_times_s"]) == len(got["probe_s"]) == len(got["norm_probe_s"]) == MAX_STEPS_FACTOR * 2
    assert got["at_speed"] == [False] * (MAX_STEPS_FACTOR * 2)
    assert {k: got[k] for k in expected} == expected
    assert got["step_time_s"] == statistics.median(got["step_times_s"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", ["die", "hang", "kill"])
def test_a_failing_rank_ends_the_run_and_keeps_the_ledger(fault, first_run, tmp_path, monkeypatch):
    ledger = tmp_path / "v.jsonl"
    earlier = first_run[0].read_text().splitlines()[0]
    ledger.write_text(earlier + "\n")
    monkeypatch.setenv("PERFSIM_VALIDATE_FAULT", fault)
    timeout = 8
    start = time.perf_counter()
    # the blame falls on the last rank, which died or hung, not on rank 0 that waited for it
    blamed = {"die": r"rank 1 exited with status 3",
              "hang": r"rank 1 stopped responding \(rank 0 gave up waiting for it: .*[Tt]imed out",
              "kill": r"rank 1 was killed \(SIGKILL\)"}[fault]
    with pytest.raises(PerfsimError, match=r"^validation of tp2 1d\+sp [^:]*: " + blamed) as err:
        timing.run_plans(timing.parse_plans(PLANS), MODEL, "cpu-calibrated", "cpu", 2, steps=2,
                         ledger_path=str(ledger), timeout_s=timeout, threads=1, progress=lambda m: None)
    assert "run the same command again" in str(err.value) and "USDT" not in str(err.value)
    # process start and torch import come before the timeout starts to count
    assert time.perf_counter() - start < timeout + 40
    assert ledger.read_text().splitlines() == [earlier]


def test_plan_fields_added_later_keep_the_ledgers_keys():
    """Every plan in the committed validation ledger, read back into today's Plan (which has
    fields added since, such as attention), keys as it did when it was measured; a plan that
    sets a later field to something new keys apart."""
    import json

    from perfsim.spec.plan import Plan

    with open("hwprofiles/ledgers/validation-cpu.jsonl") as fh:
        plans = [json.loads(line)["plan"] for line in fh if '"plan"' in line]
    assert plans
    for stored in plans:
        assert timing.plan_key_fields(Plan(**stored)) == stored
    plan = Plan(**plans[0])
    args = (MODEL, plan, "bf16", 3, 1, "cpu", 2)
    assert timing.point_key(*args) != timing.point_key(MODEL, plan.replace(attention="flash"), *args[2:])


def _profile_with_faster_gemms(path, factor: float) -> str:
    """A copy of hwprofiles/cpu-calibrated.toml whose GEMM peaks are `factor` x higher: a profile
    of a machine whose GEMMs run that much faster than this one's."""
    from perfsim.spec.system import PROFILE_DIR

    text = open(os.path.join(PROFILE_DIR, "cpu-calibrated.toml")).read()
    def scale(match):
        return f"{match.group(1)}{float(match.group(2)) * factor!r}"
    text, n = re.subn(r"(\[device\.peak_flops_\w+\]\nvalue = )([0-9.e+-]+)", scale, text)
    assert n == 3
    path.write_text(text.replace('name = "cpu-calibrated"', 'name = "gemms-5x"'))
    return str(path)


def _expected_probe(system_name: str, plan_text: str) -> float:
    from perfsim.spec.system import load_system
    from validate.speed_probe import expected_probe_s, probe_gemm

    system = timing.harness_system(load_system(system_name), "bf16")
    return expected_probe_s(system, "bf16", probe_gemm(load_model(MODEL), timing.parse_plans(plan_text)[0]))


def _ledger_with_a_plan_at_speed(path, plan_text: str) -> None:
    """A validation ledger holding one plan's three timed steps, each after probes that took what
    cpu-calibrated predicts for them (the machine it describes); no rank is run."""
    from perfsim.spec.system import load_system
    from validate.ledger import Ledger
    from validate.speed_probe import expected_norm_probe_s, expected_probe_s, probe_gemm, probe_norm

    plan, model = timing.parse_plans(plan_text)[0], load_model(MODEL)
    system = timing.harness_system(load_system("cpu-calibrated"), "bf16")
    prediction = timing.predicted(model, system, plan, "bf16")
    gemm = expected_probe_s(system, "bf16", probe_gemm(model, plan))
    norm = expected_norm_probe_s(system, "bf16", probe_norm(model, plan))
    measured = {"step_times_s": [0.10, 0.11, 0.12], "step_time_s": 0.11, "at_speed": [True] * 3,
                "probe_s": [gemm * 1.03] * 3, "probe_expected_s": gemm, "norm_probe_s": [norm * 0.97] * 3,
                "norm_probe_expected_s": norm, "peak_memory_bytes": prediction["peak_memory_bytes"],
                "flops": prediction["flops"], "comm_bytes": prediction["comm_bytes"],
                "comm_bytes_by_kind": {"all_reduce": prediction["comm_bytes"]},
                "activation_bytes": prediction["activation_bytes"]}
    key = timing.point_key(MODEL, plan, "bf16", 3, 1, "cpu", 2)
    with Ledger(str(path), {"device_kind": "cpu", "world_size": 2}) as ledger:
        ledger.append(timing.step_record(key, MODEL, plan, "bf16", 3, 1, measured, prediction, system))


def test_validate_against_a_profile_this_machine_does_not_match(run_cli, tmp_path, monkeypatch):
    """The same measured steps, validated against the profile of the machine they ran on and
    against one whose GEMMs are 5x faster: the second says so at the top and the bottom, heads
    its table as a mismatched profile's, gives the commands to calibrate and validate again, and
    marks every --json entry machine_matches_profile: false."""
    monkeypatch.chdir(tmp_path)
    ledger, plan = tmp_path / "v.jsonl", "tp=2,mbs=2,gbs=4"
    _ledger_with_a_plan_at_speed(ledger, plan)
    other = _profile_with_faster_gemms(tmp_path / "gemms-5x.toml", 5.0)
    argv = ("validate", "--device", "cpu", "--nproc", "2", "--model", MODEL, "--plans", plan, "--ledger", str(ledger))

    matched = run_cli(*argv, "--json")
    assert matched.code == 0 and "WARNING" not in matched.err, matched.err
    assert [e["machine_matches_profile"] for e in matched.json()] == [True]
    # every entry has its error at the speed its steps' probes measured (timing.error_at_measured_speed)
    assert matched.json()[0]["step_time_error_at_measured_speed"] is not None
    plain = run_cli(*argv).out
    assert "WARNING" not in plain and "@speed" in plain and "at each step's measured speed: " in plain

    off = run_cli(*argv, "--system", other)
    assert off.code == 0, off.err
    lines = off.out.splitlines()
    # the probe's GEMM is small: overheads the peak does not scale make the profile's time 2-3x shorter, not 5x
    slower = 1.03 * _expected_probe("cpu-calibrated", plan) / _expected_probe(other, plan)
    assert 2 < slower < 5
    assert lines[0].startswith(f"WARNING: this machine runs GEMMs {slower:.1f}x slower than profile {other} describes "
                               "(by the speed probes): 0 of 3 timed steps ran within 15% of the profile's speed")
    assert "element-wise" not in lines[0]  # the LayerNorm probe ran as the profile says
    calibrate, again = lines[1].strip(), lines[2].strip()
    assert calibrate.startswith(f"perfsim calibrate --device cpu --nproc 2 --system {other} --out cpu-")
    out = calibrate.split("--out ")[1]
    assert again == f"perfsim validate --device cpu --nproc 2 --plans {plan} --ledger {ledger} --model {MODEL} --system {out}"
    assert "Measured against profile" in off.out and "which does not describe this machine" in off.out
    table = off.out.index("plan  ")
    assert off.out.index("Measured against profile") < table < off.out.rindex("WARNING: this machine runs GEMMs")
    assert off.out.rstrip().endswith(again)

    as_json = run_cli(*argv, "--system", other, "--json")
    assert [e["machine_matches_profile"] for e in as_json.json()] == [False]
    assert as_json.json()[0]["machine_speed"]["probe_over_profile"] == pytest.approx(slower)
    assert f"WARNING: this machine runs GEMMs {slower:.1f}x slower" in as_json.err


@pytest.mark.parametrize("field, value", [("dp_overlap", True), ("tp_overlap", True)])
def test_knobs_the_harness_does_not_run_are_refused_before_anything_runs(run_cli, tmp_path, field, value):
    """The harness issues collectives between computations: a plan asking for overlap would
    compare a measurement of one thing with a prediction of another."""
    plan = f"tp=2,sp=true,{field}={str(value).lower()}"
    r = run_cli("validate", "--device", "cpu", "--nproc", "2", "--plans", plan, "--ledger", str(tmp_path / "l.jsonl"))
    assert r.code == 2 and r.err.startswith("perfsim: error:") and r.err.count("\n") == 1
    assert "harness" in r.err and field.split("_")[0] in r.err


def test_both_attention_kernels_are_run_by_the_harness():
    """Flash plans run torch's scaled_dot_product_attention (validate.gpt.fused_attention_core;
    tests/test_validate_attention.py checks it against the unfused core)."""
    for attention in ("unfused", "flash"):
        assert timing.harness_problems(Plan(tp=2, attention=attention)) == []
    assert timing.harness_problems(Plan(tp=2, sp=True, attention="flash", tp_overlap=True)) != []


@pytest.mark.parametrize("plan, problem", [
    (dict(cp=2, attention="flash", tp=2, dp=2), None),
    (dict(cp=2), "give --attention flash"),
    (dict(cp=2, attention="flash", pp=2), "without pipelining"),
    (dict(cp=2, attention="flash", tp=2, sp=True), "without SP"),
    (dict(cp=2, attention="flash", dp=2, zero=1), "ZeRO 0"),
    (dict(cp=2, attention="flash", tp=4, tp_mode="2d"), "1d tensor parallelism")])
def test_context_parallel_plans_the_harness_runs(plan, problem):
    """validate.context_parallel runs ring attention (flash) with 1d TP without SP and plain DP;
    anything else is refused before a rank starts."""
    problems = timing.harness_problems(Plan(**plan))
    assert problems == [] if problem is None else any(problem in p for p in problems)
    assert "cp2" in timing.plan_label(Plan(**plan))


def test_uneven_pipeline_splits_are_refused_by_the_harness():
    """validate.pipeline splits the layers evenly: an uneven plan would be timed as an even one
    against an uneven prediction."""
    assert timing.harness_problems(Plan(pp=2, first_stage_layers=1, gbs=4)) != []
    assert timing.harness_problems(Plan(pp=2, gbs=4)) == []


@pytest.mark.multiprocess
def test_fp32_steps_are_priced_in_four_byte_tensors(tmp_path):
    """Trained in fp32, every activation, weight and message has 4 bytes where bf16 has 2: the
    harness's counted bytes sent equal the prediction exactly, and its saved activations and peak
    memory follow the fp32 prediction, not the bf16 one (which is about half)."""
    plans = timing.parse_plans("tp=2,mbs=2,gbs=4;dp=2,mbs=2,gbs=4")
    results = timing.run_plans(plans, MODEL, "cpu-calibrated", "cpu", 2, "fp32", steps=1,
                               ledger_path=str(tmp_path / "fp32.jsonl"), timeout_s=60, threads=1,
                               progress=lambda m: None)
    model = load_model(MODEL)
    for plan, r in zip(plans, results):
        assert r["comm_bytes"]["counted"] == pytest.approx(r["comm_bytes"]["predicted"], rel=1e-12), plan
        bf16 = timing.predicted(model, timing.harness_system(load_system("cpu-calibrated"), "bf16"), plan, "bf16")
        assert r["activation_bytes"]["predicted"] > 1.5 * bf16["activation_bytes"]  # the loss's fp32 copy stays 4 bytes
        assert r["activation_bytes"]["counted"] == pytest.approx(r["activation_bytes"]["predicted"], rel=0.02)
        measured = r["peak_memory_bytes"]["measured"]  # the allocator's: a few % of run-to-run scatter
        assert abs(measured - r["peak_memory_bytes"]["predicted"]) < abs(measured - bf16["peak_memory_bytes"])


def test_budget_goes_to_the_plans_not_in_the_ledger(run_cli, tmp_path, monkeypatch):
    """`perfsim validate --budget` hands the plans still to be measured, in one launch, the
    minutes as seconds (the ranks share them out: speed_probe.retake_seconds); a plan read back
    from the ledger is not launched; every step off speed, the progress line says the budget cut
    it, and each plan reaches the ledger as its result comes."""
    monkeypatch.chdir(tmp_path)
    ledger = tmp_path / "v.jsonl"
    _ledger_with_a_plan_at_speed(ledger, "tp=2,mbs=2,gbs=4")
    system = timing.harness_system(load_system("cpu-calibrated"), "bf16")
    launches = []

    def fake_measure(jobs, *args, budget_s=None, done=None, **kwargs):
        launches.append(([job["plan"] for job in jobs], budget_s))
        for n, job in enumerate(jobs):
            prediction = timing.predicted(load_model(MODEL), system, job["plan"], "bf16")
            before = len(ledger.read_text().splitlines())
            done(n, {"step_times_s": [0.1] * 3, "step_time_s": 0.1, "at_speed": [False] * 3, "probe_s": [1.0] * 3,
                     "probe_expected_s": 1e-9, "norm_probe_s": [1.0] * 3, "norm_probe_expected_s": 1e-9,
                     **{k: prediction[k] for k in ("peak_memory_bytes", "flops", "comm_bytes", "activation_bytes")},
                     "comm_bytes_by_kind": {"all_reduce": prediction["comm_bytes"]}})
            assert len(ledger.read_text().splitlines()) == before + 1

    monkeypatch.setattr(timing, "measure_plans", fake_measure)
    r = run_cli("validate", "--device", "cpu", "--nproc", "2", "--model", MODEL, "--ledger", str(ledger),
                "--plans", "tp=2,mbs=2,gbs=4;tp=2,mbs=1,gbs=2;tp=2,sp=true,mbs=2,gbs=4", "--budget", "1")
    assert r.code == 0, r.err
    assert launches == [(timing.parse_plans("tp=2,mbs=1,gbs=2;tp=2,sp=true,mbs=2,gbs=4"), 60.0)]
    assert r.err.count("its retakes cut short by --budget") == 2


def test_one_launch_hands_over_each_plan_as_it_ends_and_blames_the_plan_that_failed(monkeypatch):
    """measure_plans: the plans' results reach `done` as rank 0 writes them (whole lines only),
    and when the launch fails, the plans that ended keep their results and the error names the
    first plan without one."""
    from validate import launcher

    plans = timing.parse_plans("tp=2,mbs=1,gbs=1;tp=2,mbs=1,gbs=2;dp=2,mbs=1,gbs=2")
    jobs = [{"plan": p, "probe_expected_s": None, "norm_probe_expected_s": None, "reference_probes": False}
            for p in plans]
    seen = []

    def fake_launch(argv, nproc, device, threads, what, resume, on_poll):
        out = argv[argv.index("validate.steps") + 1]
        assert json.load(open(argv[argv.index("--jobs") + 1]))[2]["plan"]["dp"] == 2
        with open(out, "w") as fh:
            fh.write(json.dumps({"n": 0}) + "\n" + json.dumps({"n": 1})[:5])  # the second line not whole yet
        on_poll()
        assert seen == [(0, {"n": 0})]
        with open(out, "a") as fh:
            fh.write(json.dumps({"n": 1})[5:] + "\n")
        raise PerfsimError(f"{what()} rank 1 exited with status 3; {resume}")

    monkeypatch.setattr(launcher, "launch_ranks", fake_launch)
    with pytest.raises(PerfsimError, match=r"^validation of dp2 zero0 [^:]*: rank 1 exited"):
        timing.measure_plans(jobs, MODEL, "cpu", 2, "bf16", 2, 1, 60, 1, done=lambda n, got: seen.append((n, got)))
    assert seen == [(0, {"n": 0}), (1, {"n": 1})]


def test_a_plan_listed_twice_is_measured_once(tmp_path, monkeypatch):
    """The same plan twice in one list: one job in the launch, one ledger record, and both
    entries report it (the second read back)."""
    system = timing.harness_system(load_system("cpu-calibrated"), "bf16")
    launched, messages = [], []

    def fake_measure(jobs, *args, done=None, **kwargs):
        launched.append(len(jobs))
        prediction = timing.predicted(load_model(MODEL), system, jobs[0]["plan"], "bf16")
        done(0, {"step_times_s": [0.1] * 2, "step_time_s": 0.1, "at_speed": [True] * 2, "probe_s": [1.0] * 2,
                 "probe_expected_s": 1.0, "norm_probe_s": [1.0] * 2, "norm_probe_expected_s": 1.0,
                 **{k: prediction[k] for k in ("peak_memory_bytes", "flops", "comm_bytes", "activation_bytes")},
                 "comm_bytes_by_kind": {"all_reduce": prediction["comm_bytes"]}})

    monkeypatch.setattr(timing, "measure_plans", fake_measure)
    ledger = tmp_path / "v.jsonl"
    results = timing.run_plans(timing.parse_plans("tp=2,mbs=2,gbs=4;tp=2,mbs=2,gbs=4"), MODEL, "cpu-calibrated", "cpu",
                               2, steps=2, ledger_path=str(ledger), progress=messages.append)
    assert launched == [1] and len(ledger.read_text().splitlines()) == 1
    assert [r["step_time_s"]["measured"] for r in results] == [0.1, 0.1]
    assert "measured" in messages[0] and "from the ledger" in messages[1]
