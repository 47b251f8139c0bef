"""`perfsim validate --device cpu --nproc 2`: real steps per plan, the --json schema, the ledger
(appended, resumed without re-running), and faults (a rank that dies or hangs ends the run with a
clear error within the stated timeout, and what was measured stays in the ledger)."""

from __future__ import annotations

import json
import statistics
import time

import pytest

from perfsim.errors import PerfsimError
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan, plan_problems
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
    _, results, messages = first_run
    assert len(results) == 2 and len(messages) == 2 and "[2/2]" in messages[1]
    for r in results:
        for key in KEYS[1:]:
            assert r[key]["predicted"] > 0, (key, r)
        assert r["step_time_s"]["measured"] > 0 and r["peak_memory_bytes"]["measured"] > 0
        # the speed probe ran before every timed step: 2 at the profile's speed, or up to 3 x 2 tried
        speed = r["machine_speed"]
        assert speed["probe_over_profile"] > 0 and 2 <= speed["steps"] <= 6
        assert speed["steps_at_speed"] == 2 or speed["steps"] == 6
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
@pytest.mark.parametrize("fault", ["die", "hang"])
def test_a_failing_rank_ends_the_run_and_keeps_the_ledger(fault, first_run, tmp_path, monkeypatch):
    ledger = tmp_path / "v.jsonl"
    earlier = first_run[0].read_text().splitlines()[0]
    ledger.write_text(earlier + "\n")
    monkeypatch.setenv("PERFSIM_VALIDATE_FAULT", fault)
    timeout = 8
    start = time.perf_counter()
    # the blame falls on the last rank, which died or hung, not on rank 0 that waited for it
    blamed = {"die": r"rank 1 exited with status 3",
              "hang": r"rank 1 stopped responding \(rank 0 gave up waiting for it: .*[Tt]imed out"}[fault]
    with pytest.raises(PerfsimError, match=r"^validation of tp2 1d\+sp [^:]*: " + blamed) as err:
        timing.run_plans(timing.parse_plans(PLANS), MODEL, "cpu-calibrated", "cpu", 2, steps=2,
                         ledger_path=str(ledger), timeout_s=timeout, threads=1, progress=lambda m: None)
    assert "run the same command again" in str(err.value)
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
