"""`perfsim calibrate --emit-slurm` and `perfsim validate --emit-slurm`: the SMNG-P2 batch scripts
are valid bash and match their golden files byte for byte (regenerate them with
PERFSIM_UPDATE_GOLDEN=1 after an intended change); the validation job runs end to end with
stand-ins for mpiexec and scontrol."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden" / "calibrate-smng-p2.sbatch"
VALIDATE_GOLDEN = Path(__file__).parent / "golden" / "validate-smng-p2.sbatch"
ARGS = ("calibrate", "--emit-slurm", "job.sbatch", "--nodes", "4", "--time", "02:00:00", "--partition", "general",
        "--account", "pn12ab", "--setup", "module load intel-oneapi-compilers",
        "--setup", 'source "$HOME/venvs/torch-xpu/bin/activate"', "--ledger", "smng-p2.jsonl",
        "--out", "smng-p2-calibrated.toml")
VALIDATE_MODEL = "layers=4,hidden=512,heads=16,seq=256,vocab=8192,tied_embeddings=false,dropout=false"
VALIDATE_PLANS = "tp=16,sp=true,recompute=selective;tp=8,pp=2,gbs=8;tp=8,dp=2,zero=1,gbs=2"
VALIDATE_ARGS = ("validate", "--emit-slurm", "validate.sbatch", "--nodes", "2", "--model", VALIDATE_MODEL,
                 "--plans", VALIDATE_PLANS, "--steps", "5", "--time", "00:30:00", "--account", "pn12ab",
                 "--setup", 'source "$HOME/venvs/torch-xpu/bin/activate"', "--ledger", "steps.jsonl")

# What rank 0 of validate.steps writes for a plan (a stand-in's numbers).
STEP_RESULT = {"world": 16, "backend": "xccl", "device": "stand-in", "step_times_s": [0.5, 0.4, 0.6],
               "step_time_s": 0.5, "losses": [9.0, 8.9], "peak_memory_bytes": 2e9, "activation_bytes": 1e8,
               "flops": 1e13, "comm_bytes_by_kind": {"all_reduce": 1e9}, "comm_bytes": 1e9}


def emit(run_cli, tmp_path, monkeypatch, args, *said) -> Path:
    """Run an --emit-slurm command line in tmp_path; the script it wrote (args[2])."""
    monkeypatch.chdir(tmp_path)
    r = run_cli(*args)
    assert r.code == 0, r.err
    for text in said:
        assert text in r.out
    return tmp_path / args[2]


@pytest.fixture
def emitted(run_cli, tmp_path, monkeypatch):
    return emit(run_cli, tmp_path, monkeypatch, ARGS, "sbatch job.sbatch")


@pytest.fixture
def validation_job(run_cli, tmp_path, monkeypatch):
    return emit(run_cli, tmp_path, monkeypatch, VALIDATE_ARGS, "3 plan(s) on 2 nodes", "sbatch validate.sbatch")


# Both scripts, by fixture name, with their golden files.
SCRIPTS = pytest.mark.parametrize("job, golden", [("emitted", GOLDEN), ("validation_job", VALIDATE_GOLDEN)],
                                  ids=["calibrate", "validate"])


@SCRIPTS
def test_script_matches_golden_file(request, job, golden):
    text = request.getfixturevalue(job).read_text()
    if os.environ.get("PERFSIM_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text()


@SCRIPTS
@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_script_passes_bash_syntax_check(request, job, golden):
    script = request.getfixturevalue(job)
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(script, os.X_OK)


def test_script_carries_the_smng_p2_settings(emitted):
    text = emitted.read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "export ZE_FLAT_DEVICE_HIERARCHY=FLAT",
                 "export ZE_AFFINITY_MASK=0,1,2,3,4,5,6,7", "export CCL_OP_SYNC=1", "export CCL_SKIP_SCHEDULER=1",
                 "export CCL_ALLGATHERV_MEDIUM_SIZE_THRESHOLD=0", "export ZE_ENABLE_PCI_ID_DEVICE_ORDER=1",
                 "export MASTER_ADDR MASTER_PORT"):
        assert line in text.splitlines()
    mpiexec = next(line for line in text.splitlines() if line.startswith("mpiexec"))
    assert '-n "$NRANKS" -ppn 8 perfsim calibrate --worker --device xpu' in mpiexec
    assert "--tp 8" in mpiexec and "--ledger smng-p2.jsonl" in mpiexec
    assert "perfsim calibrate --fit smng-p2.jsonl --system smng-p2 --device xpu --out smng-p2-calibrated.toml" in text


def _launched_suites(text: str) -> list:
    return [line.split("--suites ")[1].split()[0] for line in text.splitlines()
            if line.startswith("mpiexec") and "calibrate --worker" in line]


def test_suites_run_in_sensitivity_order_with_their_shares(emitted):
    """Issue 16 item 5: the job measures first what settles most of the doubt about the plan and
    the step time (perfsim/calibrate/priority.py), each suite with its shares in a comment; the
    overheads suite (issue 15) comes after the kernel suites its provisional fit needs."""
    from perfsim.calibrate import SUITES
    from perfsim.calibrate.overheads import HOST_RUNS, OVERHEAD_RUNS, VARIANT_RUNS
    from perfsim.calibrate.priority import builtin_case_priorities
    from perfsim.spec.plan import Plan

    text = emitted.read_text()
    ranked, _ = builtin_case_priorities("smng-p2", SUITES + ("overheads",))
    kernel_order = [p.suite for p in ranked if p.suite != "overheads"]
    assert _launched_suites(text) == kernel_order
    assert kernel_order[0] == "collective"  # Xe Link: most of the doubt, for SMNG-P2
    lines = text.splitlines()
    numbered = [p for p in ranked if p.suite != "overheads"] + [p for p in ranked if p.suite == "overheads"]
    for i, p in enumerate(numbered):
        assert any(line.startswith(f"# {i + 1}. {p.comment()}") for line in lines), p.suite
    assert "# 1. collective: settles" in text and "node.node_link_bandwidth_Bps" in lines[lines.index(next(
        line for line in lines if line.startswith("# 1. collective")))]
    shares = [(round(p.decides, 2), round(p.moves, 2)) for p in ranked if p.suite != "overheads"]
    assert shares == sorted(shares, reverse=True)
    # the overhead runs: after every kernel suite, before the final fit, into the steps ledger, in one launch
    (jobs,) = [i for i, line in enumerate(lines) if line.startswith("python -m validate.slurm jobs ")]
    (launch,) = [i for i, line in enumerate(lines) if line.strip().startswith("mpiexec") and "validate.steps" in line]
    last_suite = max(i for i, line in enumerate(lines) if line.startswith("mpiexec"))
    final_fit = lines.index("perfsim calibrate --fit smng-p2.jsonl --system smng-p2 --device xpu --out smng-p2-calibrated.toml")
    assert last_suite < jobs < launch < final_fit
    # the variants held out too, and the held-out run's replica alone on every rank (framework.rank_jitter)
    # and the host model's runs alone on every rank (framework.layer_overhead_s)
    assert len(_overhead_runs(text)) == len(OVERHEAD_RUNS) + len(VARIANT_RUNS) + 1 + len(HOST_RUNS)
    assert _overhead_runs(text)[-1][2] == "alone" and Plan(**_overhead_runs(text)[-1][1]).devices == 1
    assert any("--ledger smng-p2-overheads.jsonl" in line for line in lines)
    assert "perfsim calibrate --fit smng-p2.jsonl --system smng-p2 --device xpu --out smng-p2-provisional.toml" in lines


def test_suites_flag_keeps_the_order_and_drops_the_rest(run_cli, tmp_path, monkeypatch):
    job = emit(run_cli, tmp_path, monkeypatch, ("calibrate", "--emit-slurm", "j.sbatch", "--nodes", "2", "--suites",
                                                "gemm,collective", "--no-fit"))
    text = job.read_text()
    assert _launched_suites(text) == ["collective", "gemm"] and "validate.slurm jobs" not in text and "--fit" not in text
    r = run_cli("calibrate", "--emit-slurm", "k.sbatch", "--nodes", "2", "--suites", "overheads", "--no-fit")
    assert r.code == 2 and "measures nothing" in r.err and r.err.count("\n") == 1


def _overhead_runs(script: str) -> list:
    """The [model, plan] runs the calibration script hands `validate.slurm jobs`."""
    line = next(line for line in script.splitlines() if line.startswith("python -m validate.slurm jobs "))
    return json.loads(shlex.split(line)[shlex.split(line).index("--runs") + 1])


def test_overhead_jobs_carry_their_models_and_the_provisional_profiles_probes(tmp_path):
    """`python -m validate.slurm jobs` writes one validate.steps job per run, with the run's own
    model and the probe times the provisional profile predicts (validate.slurm.probes); bad runs
    get one line and exit status 2."""
    from perfsim.calibrate.overheads import CALIBRATION_MODEL
    from perfsim.spec.plan import Plan
    from validate import slurm

    runs = [[CALIBRATION_MODEL.format(layers=layers), Plan(dp=16, mbs=1, gbs=16 * m).as_dict()] for layers, m in
            ((1, 1), (2, 2))]
    out = subprocess.run([sys.executable, "-m", "validate.slurm", "jobs", str(tmp_path), "--runs", json.dumps(runs),
                          "--system", "smng-p2", "--dtype", "bf16"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    jobs = json.loads((tmp_path / "jobs.json").read_text())
    assert [[job["model"], job["plan"]] for job in jobs] == runs
    for (model, plan), job in zip(runs, jobs):
        probe, norm, kind = slurm.probes(plan, model, "smng-p2", "bf16")
        assert (job["probe_expected_s"], job["norm_probe_expected_s"]) == (probe, norm) and probe > 0 and norm > 0
        assert job["reference_probes"] is (kind == "reference") is False
    bad = subprocess.run([sys.executable, "-m", "validate.slurm", "jobs", str(tmp_path), "--runs", '[["layers=1"]]',
                          "--system", "smng-p2", "--dtype", "bf16"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


# Stand-in for perfsim in the calibration job: logs its arguments; a fit writes smng-p2 as its --out.
FAKE_PERFSIM = """#!/bin/bash
echo "perfsim $*" >> "$FAKE_LOG"
while [ "$#" -gt 0 ]; do [ "$1" = --out ] && cp """ + shlex.quote(str(REPO / "perfsim" / "hwprofiles" / "smng-p2.toml")) + """ "$2"; shift; done
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_overhead_runs_take_one_launch_and_key_as_the_local_campaign(run_cli, tmp_path, monkeypatch):
    """The calibration job under bash with stand-ins: the overhead runs' jobs go to one launch
    after the provisional fit, each recorded in the steps ledger under the key perfsim
    calibrate's local runs use (validate.timing), so the fit finds them. A run that fails its
    launch is left out and named, the others are measured, and the job goes on to the fit."""
    from perfsim.calibrate.overheads import HOST_RUNS, VARIANT_RUNS
    from perfsim.spec.plan import Plan
    from validate import timing

    job = emit(run_cli, tmp_path, monkeypatch, ("calibrate", "--emit-slurm", "c.sbatch", "--nodes", "2", "--suites",
                                                "gemm,overheads", "--ledger", "cal.jsonl", "--out", "cal.toml"))
    env = _stand_ins(tmp_path, FAKE_MPIEXEC)
    (tmp_path / "bin" / "perfsim").write_text(FAKE_PERFSIM)
    (tmp_path / "bin" / "perfsim").chmod(0o755)
    result, launches = _submit(job, tmp_path, dict(env, FAKE_FAIL_PLAN="layers=2"))
    assert result.returncode == 0, result.stderr
    # every run of the two-layer model fails its launch (the held-out run, then each variant of it and
    # the run alone on every rank, all layers=2): each failure ends a launch and the next goes on with the
    # rest, the host model's runs last
    steps = [line for line in launches if "validate.steps" in line]
    assert len(steps) == 3 + len(VARIANT_RUNS) and "--jobs cal-overheads-results/launch-0.jobs.json" in steps[0]
    assert "of model layers=2,hidden=256" in result.stderr and "is left out: launch-0 ended (exit status 1)" in result.stderr
    assert "fitting without" in result.stderr
    assert launches[-1].startswith("perfsim calibrate --fit cal.jsonl")  # the fit, after the runs
    records = [json.loads(line) for line in (tmp_path / "cal-overheads.jsonl").read_text().splitlines()]
    runs = _overhead_runs(job.read_text())
    assert len(records) == 4 + len(HOST_RUNS)
    assert [r["model"] for r in records] == [model for model, *_ in runs if "layers=2" not in model]
    for r, (*_, how) in zip(records, [run for run in runs if "layers=2" not in run[0]]):
        alone = how == "alone"
        assert r["key"] == timing.point_key(r["model"], Plan(**r["plan"]), "bf16", 3, 1, "xpu", 16, alone=alone)
    result, launches = _submit(job, tmp_path, env)  # again, the failed runs' files still there: nothing launched
    assert result.returncode == 0 and len([line for line in launches if "validate.steps" in line]) == 3 + len(VARIANT_RUNS)


def test_script_workers_parse_as_perfsim_arguments(emitted):
    """The worker line is a valid `perfsim calibrate` command line (the parser accepts it)."""
    import shlex

    from perfsim import cli

    mpiexec = next(line for line in emitted.read_text().splitlines() if line.startswith("mpiexec"))
    argv = shlex.split(mpiexec.split(" -ppn 8 ", 1)[1])[1:]
    args = cli.make_parser().parse_args(argv)
    assert args.worker and args.device == "xpu" and args.tp == 8 and args.ledger == "smng-p2.jsonl"


def test_emit_slurm_rejects_other_devices_and_bad_times(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run_cli("calibrate", "--emit-slurm", "j.sbatch", "--nodes", "2", "--device", "cuda")
    assert r.code == 2 and "SMNG-P2 (XPU)" in r.err
    r = run_cli("calibrate", "--emit-slurm", "j.sbatch", "--nodes", "2", "--time", "90 minutes")
    assert r.code == 2 and "Slurm time" in r.err


def test_emit_slurm_and_fit_never_import_torch(tmp_path):
    """perfsim imports torch only in the commands that measure: writing the job script and
    fitting a ledger work on a login node without it."""
    import sys

    code = ("import sys; from perfsim import cli; "
            "assert cli.main(['calibrate', '--emit-slurm', 'j.sbatch', '--nodes', '2']) == 0; "
            "assert cli.main(['calibrate', '--fit', 'none.jsonl', '--system', 'smng-p2']) == 2; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


# --- perfsim validate --emit-slurm ------------------------------------------------------------

def _jobs(script: str) -> list:
    """The jobs the validation script writes to $RESULTS/jobs.json (its heredoc)."""
    return json.loads(script.split("<<'JOBS'\n")[1].split("\nJOBS\n")[0])


def test_validation_script_runs_every_plan_in_one_launch(validation_job):
    from perfsim import cli
    from validate.timing import parse_plans

    text = validation_job.read_text()
    lines = text.splitlines()
    assert "#SBATCH --nodes=2" in lines and "export CCL_OP_SYNC=1" in lines and "export ZE_FLAT_DEVICE_HIERARCHY=FLAT" in lines
    mpiexec = [line.strip() for line in lines if line.strip().startswith("mpiexec")]
    assert len(mpiexec) == 1 and mpiexec[0].startswith(
        'mpiexec -n "$NRANKS" -ppn 8 python -m validate.steps "$launch.jsonl" --jobs "$launch.jobs.json" --device xpu')
    assert "--steps 5" in mpiexec[0] and "--dtype bf16" in mpiexec[0]
    jobs = _jobs(text)
    assert len(jobs) == 3 and all(set(job) == {"plan", "probe_expected_s", "norm_probe_expected_s", "reference_probes"}
                                  for job in jobs)
    assert not any(job["reference_probes"] for job in jobs)  # smng-p2 has no reference kernels
    # the comparison line is a valid `perfsim validate` command over the same plans
    compare = next(line for line in lines if line.startswith("python -m perfsim.cli validate"))
    argv = shlex.split(compare.split(" > ")[0])[3:]
    args = cli.make_parser().parse_args(argv)
    assert (args.device, args.nproc, args.ledger, args.json, args.steps) == ("xpu", 16, "steps.jsonl", True, 5)
    planned = [job["plan"] for job in jobs]
    assert [p.as_dict() for p in parse_plans(args.plans)] == planned
    assert [p.as_dict() for p in parse_plans(VALIDATE_PLANS)] == planned


# Stand-in for mpiexec running `validate.steps OUT --jobs JOBS`: logs the launch and writes rank 0's
# line for each job; at a job whose JSON holds $FAKE_FAIL_PLAN it writes half a line and fails. Any
# other launch (a calibration suite's workers) is logged only.
FAKE_MPIEXEC = """#!/bin/bash
echo "$*" >> "$FAKE_LOG"
while [ "$#" -gt 0 ] && [ "$1" != validate.steps ]; do shift; done
[ "$#" -gt 0 ] || exit 0
python - "$2" "$4" <<'PY'
import json, os, sys
fail = os.environ.get("FAKE_FAIL_PLAN")
with open(sys.argv[1], "w") as out:
    for job in json.load(open(sys.argv[2])):
        if fail and fail in json.dumps(job, sort_keys=True):
            out.write('{"world": 16, "step_ti')
            sys.exit(1)
        out.write(json.dumps(""" + repr(STEP_RESULT) + """) + "\\n")
PY
"""


def _stand_ins(tmp_path, mpiexec: str) -> dict:
    """bin/ with mpiexec, scontrol and python stand-ins; the environment the job script runs in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mpiexec").write_text(mpiexec)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node001\n")
    (bin_dir / "python").write_text(f'#!/bin/bash\nexec {shlex.quote(sys.executable)} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    (tmp_path / "venvs" / "torch-xpu" / "bin").mkdir(parents=True)
    (tmp_path / "venvs" / "torch-xpu" / "bin" / "activate").write_text("")
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_NNODES="2", SLURM_JOB_ID="4242",
                SLURM_JOB_NODELIST="node[001-002]", FAKE_LOG=str(tmp_path / "launches.log"), HOME=str(tmp_path),
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def _submit(job, tmp_path, env) -> tuple:
    """(the script's run, the launches logged so far)."""
    result = subprocess.run(["bash", str(job)], cwd=tmp_path, env=env, capture_output=True, text=True)
    log = tmp_path / "launches.log"
    return result, log.read_text().splitlines() if log.exists() else []


def _ledger_plans(tmp_path) -> list:
    return [json.loads(line)["plan"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_validation_job_runs_end_to_end_and_resumes(validation_job, tmp_path):
    """The script under bash with stand-ins for mpiexec and scontrol: one launch runs the three
    plans, each recorded in the ledger with its prediction, and `perfsim validate --device xpu`
    then reads all of them back. Submitting again launches nothing."""
    env = _stand_ins(tmp_path, FAKE_MPIEXEC)
    for attempt in (1, 2):
        result, launches = _submit(validation_job, tmp_path, env)
        assert result.returncode == 0, result.stderr
        assert len(launches) == 1, launches  # the second submission launches nothing
        assert launches[0].startswith("-n 16 -ppn 8 python -m validate.steps steps-results/launch-0.jsonl --jobs "
                                      "steps-results/launch-0.jobs.json --device xpu")
    compared = json.loads((tmp_path / "steps.json").read_text())
    assert len(compared) == 3
    for entry in compared:
        assert entry["step_time_s"]["measured"] == 0.5 and entry["step_time_s"]["predicted"] > 0
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(records) == 3 and {r["world_size"] for r in records} == {16}
    assert [r["plan"] for r in records] == [job["plan"] for job in _jobs(validation_job.read_text())]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_a_plan_that_fails_its_launch_costs_only_itself(validation_job, tmp_path):
    """The launch fails in the second plan, after half its line: the first plan is recorded, the
    second left out and named, the third measured in a launch of its own; the job then stops
    before the comparison. Submitting again does not retry the failed plan; removing its launch's
    files, as the message says, does, and the job completes."""
    env = dict(_stand_ins(tmp_path, FAKE_MPIEXEC), FAKE_FAIL_PLAN='"pp": 2')
    result, launches = _submit(validation_job, tmp_path, env)
    assert result.returncode == 1 and len(launches) == 2
    assert '"pp": 2' in result.stderr and "is left out: launch-0 ended (exit status 1)" in result.stderr
    assert "remove steps-results/launch-0.* to try it again" in result.stderr
    assert [p["pp"] for p in _ledger_plans(tmp_path)] == [1, 1] and not (tmp_path / "steps.json").exists()
    assert "--jobs steps-results/launch-1.jobs.json" in launches[1]
    assert [j["plan"]["dp"] for j in json.loads((tmp_path / "steps-results" / "launch-1.jobs.json").read_text())] == [2]
    result, launches = _submit(validation_job, tmp_path, env)
    assert result.returncode == 1 and len(launches) == 2
    for leftover in (tmp_path / "steps-results").glob("launch-0.*"):
        leftover.unlink()
    env.pop("FAKE_FAIL_PLAN")
    result, launches = _submit(validation_job, tmp_path, env)
    assert result.returncode == 0, result.stderr
    assert len(launches) == 3 and "--jobs steps-results/launch-2.jobs.json" in launches[2]
    assert sorted(p["pp"] for p in _ledger_plans(tmp_path)) == [1, 1, 2]
    assert len(json.loads((tmp_path / "steps.json").read_text())) == 3


def test_a_launch_cut_short_blames_no_plan(tmp_path):
    """A launch without a status file (the batch job's time ran out in it) is not held against the
    plan it was running: `next` records the whole lines and hands that plan to the next launch."""
    from validate import slurm

    results = tmp_path / "results"
    results.mkdir()
    plans = [{"tp": 8}, {"tp": 8, "pp": 2, "gbs": 8}]
    jobs = [{"plan": p, "probe_expected_s": 1e-3, "norm_probe_expected_s": 1e-4, "reference_probes": False}
            for p in plans]
    (results / "jobs.json").write_text(json.dumps(jobs))
    (results / "launch-0.jobs.json").write_text(json.dumps(jobs))
    (results / "launch-0.jsonl").write_text(json.dumps(STEP_RESULT) + "\n" + '{"world": 8, "st')
    ledger = tmp_path / "steps.jsonl"
    stem, failed = slurm.next_launch(str(results), VALIDATE_MODEL, "smng-p2", 8, "bf16", 3, 1, str(ledger))
    assert failed == [] and stem == str(results / "launch-1")
    assert [j["plan"] for j in json.loads((results / "launch-1.jobs.json").read_text())] == plans[1:]
    assert [json.loads(line)["plan"]["pp"] for line in ledger.read_text().splitlines()] == [1]
    (results / "launch-0.status").write_text("143\n")  # with a status, the cut line blames the plan
    (results / "launch-1.jobs.json").unlink()
    stem, failed = slurm.next_launch(str(results), VALIDATE_MODEL, "smng-p2", 8, "bf16", 3, 1, str(ledger))
    assert stem is None and [(job["plan"]["pp"], launch, status) for job, launch, status in failed] == [(2, "launch-0", "143")]
    assert len(ledger.read_text().splitlines()) == 1  # recorded once
    out = subprocess.run([sys.executable, "-m", "validate.slurm", "next", str(tmp_path / "none"), "--model",
                          VALIDATE_MODEL, "--system", "smng-p2", "--dtype", "bf16", "--ledger", str(ledger), "--nproc",
                          "8", "--steps", "3", "--warmup", "1"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "none" in out.stderr


def test_a_profile_with_reference_kernels_gets_them_as_the_jobs_probes(run_cli, tmp_path, monkeypatch):
    """A profile calibrated with reference kernels (device.speed_reference_*_s) is judged by them in
    the Slurm job too, as `perfsim validate --device` judges it: each plan's probes are those
    kernels' times and validate.steps gets reference_probes; without them, the model's probes."""
    from validate import slurm

    profile = tmp_path / "smng-p2-refs.toml"
    profile.write_text((REPO / "hwprofiles" / "smng-p2.toml").read_text() + "".join(
        f'\n[device.speed_reference_{kind}_s]\nvalue = {value}\nprovenance = "calibrated"\nsource = "a test"\n'
        for kind, value in (("gemm", 0.0123), ("norm", 0.000456))))
    assert slurm.probes({"tp": 8}, VALIDATE_MODEL, str(profile), "bf16") == (0.0123, 0.000456, "reference")
    assert slurm.probes({"tp": 8}, VALIDATE_MODEL, "smng-p2", "bf16")[2] == "model"
    script = emit(run_cli, tmp_path, monkeypatch, VALIDATE_ARGS + ("--system", str(profile)), "3 plan(s)").read_text()
    jobs = _jobs(script)
    assert len(jobs) == 3 and all((j["probe_expected_s"], j["norm_probe_expected_s"], j["reference_probes"])
                                  == (0.0123, 0.000456, True) for j in jobs)
    (job,) = slurm.write_jobs(str(tmp_path), [[VALIDATE_MODEL, {"tp": 8}]], str(profile), "bf16")  # overhead runs
    assert (job["probe_expected_s"], job["norm_probe_expected_s"], job["reference_probes"]) == (0.0123, 0.000456, True)


def test_validate_emit_slurm_rejects_impossible_jobs(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run_cli("validate", "--emit-slurm", "j.sbatch", "--plans", "tp=8")
    assert r.code == 2 and "--nodes" in r.err
    r = run_cli("validate", "--emit-slurm", "j.sbatch", "--nodes", "1", "--plans", "tp=16")
    assert r.code == 2 and "tp=16" not in r.err and "8 tiles" in r.err
    r = run_cli("validate", "--emit-slurm", "j.sbatch", "--nodes", "1", "--device", "cuda")
    assert r.code == 2 and "SMNG-P2 (XPU)" in r.err
    assert not (tmp_path / "j.sbatch").exists()
