"""The Slurm batch scripts of SuperMUC-NG Phase 2: a calibration campaign (`perfsim calibrate
--emit-slurm`) and a training-step validation (`perfsim validate --emit-slurm`).

The calibration job launches each microbenchmark suite on its own, in the order the caller gives
(perfsim calibrate: the suite that settles most of the doubt about the plan and the step time
first, perfsim/calibrate/priority.py), then the overhead runs (all of them in one launch, as the
validation job's plans below), then the fit.

One rank per Max 1550 tile (FLAT device hierarchy, 8 tiles per node), started by `mpiexec -ppn 8`;
each rank reads its rank and local rank from PMI_RANK / PMI_SIZE / PALS_LOCAL_RANKID
(validate.ranks.rank_environment), the rendezvous address from MASTER_ADDR / MASTER_PORT, which
the script sets from the allocation. The environment is the one the SMNG-P2 LLM study validated
(shared/reference/hardware.md). After the campaign the script fits the profile on the first node.
No torch is needed to write the script.

The validation job runs every plan in one `mpiexec` launch of `python -m validate.steps --jobs`
(the per-rank program `perfsim validate --device` launches locally), so that the ranks import torch
from the shared file system and build their oneCCL communicators once, not once per plan. Rank 0
writes each plan's result as a line the moment the plan ends. Before each launch `python -m
validate.slurm next` adds the lines of the launches before it to the ledger, with perfsim's
prediction, exactly as the local run does (validate.timing), and writes the jobs of the plans still
missing. A launch that fails is blamed on the first of its plans without a result, which is left
out of the next launch; so one plan that cannot run (out of memory, say) does not cost the others.
Finally `perfsim validate --device xpu --ledger ... --json` reads every plan back from the ledger
(nothing is measured again) and writes the comparison. Resubmitting resumes: a plan in the ledger
is not run again, and a launch the time limit cut short is not held against its plan.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass

from perfsim.errors import PerfsimError

TILES_PER_NODE = 8

# Level Zero and SYCL: one device per tile, all eight visible, numbered in PCI order.
LEVEL_ZERO_ENV = (
    ("ZE_FLAT_DEVICE_HIERARCHY", "FLAT"),
    ("ZE_AFFINITY_MASK", ",".join(str(i) for i in range(TILES_PER_NODE))),
    ("ZE_ENABLE_PCI_ID_DEVICE_ORDER", "1"),
    ("SYCL_PI_LEVEL_ZERO_USE_IMMEDIATE_COMMANDLISTS", "1"),
    ("UR_L0_IN_ORDER_BARRIER_BY_SIGNAL", "0"),
)
# oneCCL settings of the SMNG-P2 LLM study (LRZ-BADW/LLMsOnSMNG-P2), and its SDP fusion switch.
ONECCL_ENV = (
    ("CCL_OP_SYNC", "1"),
    ("CCL_SKIP_SCHEDULER", "1"),
    ("CCL_ALLGATHERV_MEDIUM_SIZE_THRESHOLD", "0"),
    ("ENABLE_SDP_FUSION", "1"),
)


@dataclass(frozen=True, kw_only=True)
class BatchJob:
    """The Slurm settings both batch scripts take (_preamble writes them)."""
    nodes: int
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    job_name: str
    setup: tuple = ()  # shell lines run before the work (module load, activate a venv)
    port_base: int = 29500


@dataclass(frozen=True)
class SuiteLaunch:
    """One microbenchmark suite of a calibration campaign, launched on its own so that the suites
    run in the order given: why it comes where it does (a comment) and its worker's arguments
    (`perfsim calibrate --worker ... --suites SUITE`, validate.campaign.worker_argv)."""
    comment: str
    worker_argv: tuple


@dataclass(frozen=True, kw_only=True)
class OverheadRuns:
    """The `overheads` suite (perfsim.calibrate.overheads): real training steps of the calibration
    model, each timed with speed probes from a provisional fit of the suites before it, recorded
    in the steps ledger beside the calibration ledger (overheads_ledger)."""
    comment: str
    runs: tuple  # (model spec, plan as a dict of Plan fields[, "alone": a one-device plan on every rank]), ...
    provisional_fit_argv: tuple  # `perfsim calibrate --fit LEDGER ... --out PROVISIONAL`
    provisional: str  # the profile that fit writes
    ledger: str  # the steps ledger
    dtype: str = "bf16"
    steps: int = 3
    warmup: int = 1
    timeout: float = 300.0


@dataclass(frozen=True, kw_only=True)
class Job(BatchJob):
    """A calibration campaign on `nodes` x 8 tiles: the suites in the order given, then the
    overhead runs, then the fit."""
    suites: tuple  # SuiteLaunch, ...
    order_note: tuple = ()  # comment lines on how the suites were ordered
    overheads: OverheadRuns | None = None
    fit_argv: tuple  # `perfsim calibrate --fit ...` arguments, or empty
    job_name: str = "perfsim-calibrate"


def _preamble(job: BatchJob, what: str, written_by: str, resubmitting: str, port: str) -> list:
    """Both scripts' lines up to their work: the Slurm header, the software and device environment,
    and the rendezvous on MASTER_PORT=`port` (a shell expression); `resubmitting` says what a
    second submission of the same script does."""
    lines = ["#!/bin/bash", f"# {what} on SuperMUC-NG Phase 2: one rank per Max 1550 tile, 8 tiles per node.",
             f"# Written by `{written_by}`; submit with `sbatch` from the folder that should",
             f"# hold the ledger. Resubmitting the same script {resubmitting}.",
             f"#SBATCH --job-name={job.job_name}",
             f"#SBATCH --nodes={job.nodes}",
             f"#SBATCH --ntasks-per-node={TILES_PER_NODE}",
             f"#SBATCH --time={job.time}",
             "#SBATCH --exclusive",
             f"#SBATCH --output={job.job_name}-%j.out"]
    if job.partition:
        lines.append(f"#SBATCH --partition={job.partition}")
    if job.account:
        lines.append(f"#SBATCH --account={job.account}")
    lines += ["", "set -euo pipefail", ""]
    if job.setup:
        lines += ["# Software environment"] + list(job.setup) + [""]
    else:
        lines += ["# Software environment: load the XPU torch stack here (module load ..., source venv/bin/activate)",
                  ""]
    lines.append("# One device per tile (FLAT hierarchy), the node's 8 tiles in PCI order")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in LEVEL_ZERO_ENV]
    lines += ["", "# oneCCL settings validated on SMNG-P2 (shared/reference/hardware.md)"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in ONECCL_ENV]
    return lines + [
        "",
        "# Rendezvous on the first node of the allocation; each rank takes RANK, WORLD_SIZE and",
        "# LOCAL_RANK from PMI_RANK, PMI_SIZE and PALS_LOCAL_RANKID set by mpiexec.",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT={port}",
        "export MASTER_ADDR MASTER_PORT",
        f"NRANKS=$(( SLURM_NNODES * {TILES_PER_NODE} ))",
        f"export LOCAL_WORLD_SIZE={TILES_PER_NODE}",
    ]


def _command(argv) -> str:
    return " ".join(shlex.quote(a) for a in argv)


CALIBRATION_PORTS = 20  # launches of one calibration job (suites, overhead runs): launch i rendezvouses on PORT0 + i


def script(job: Job) -> str:
    """The calibration batch script's text (deterministic: the golden-file test compares it byte for byte)."""
    launches = len(job.suites) + (len(job.overheads.runs) if job.overheads else 0)
    if not 1 <= launches <= CALIBRATION_PORTS:
        raise ValueError(f"a calibration job makes 1 to {CALIBRATION_PORTS} launches, got {launches}")
    lines = _preamble(job, "perfsim calibrate", "perfsim calibrate --emit-slurm", "resumes from the ledger",
                      f"$(( {job.port_base} + SLURM_JOB_ID % 50 * {CALIBRATION_PORTS} ))")
    lines += [
        "PORT0=$MASTER_PORT",
        "",
        'echo "perfsim calibrate: $NRANKS ranks on $SLURM_NNODES nodes, rendezvous $MASTER_ADDR:$PORT0"',
        "",
    ] + [f"# {line}" if line else "#" for line in job.order_note]
    for i, suite in enumerate(job.suites):
        lines += ["", f"# {i + 1}. {suite.comment}", f"MASTER_PORT=$(( PORT0 + {i} ))",
                  f'mpiexec -n "$NRANKS" -ppn {TILES_PER_NODE} {_command(("perfsim",) + tuple(suite.worker_argv))}']
    if job.overheads:
        lines += _overhead_lines(job.overheads, len(job.suites))
    if job.fit_argv:
        lines += ["", "# Fit the profile to the ledger (no GPU needed; can be rerun anywhere)",
                  _command(("perfsim",) + tuple(job.fit_argv))]
    return "\n".join(lines) + "\n"


def _launch_loop(next_args: str, steps_args: str, port0: str, on_failed: str | None = None) -> list:
    """The loop that measures the jobs of "$RESULTS/jobs.json" (validation plans, overhead runs):
    `validate.slurm next NEXT_ARGS` adds what the launches so far wrote to the ledger and names the
    next launch's jobs, nothing once every job is in; one `validate.steps` launch (STEPS_ARGS)
    runs them one after the other, rendezvousing on PORT0 + its attempt. `next` exits 1 when the
    jobs left had failed their launches: the loop then runs ON_FAILED (none: the job stops there,
    `set -e`)."""
    go_on = f' || {{ rc=$?; [ "$rc" -eq 1 ] || exit "$rc"; {on_failed}; }}' if on_failed else ""
    return [
        "attempt=0",
        "while :; do",
        f'    launch=$(python -m validate.slurm next "$RESULTS" --nproc "$NRANKS" {next_args}){go_on}',
        '    [ -n "$launch" ] || break',
        f'    MASTER_PORT=$(( {port0} + attempt )); export MASTER_PORT; attempt=$(( attempt + 1 ))',
        "    status=0",
        f'    mpiexec -n "$NRANKS" -ppn {TILES_PER_NODE} python -m validate.steps "$launch.jsonl" --jobs "$launch.jobs.json" '
        f'--device xpu {steps_args} || status=$?',
        '    echo "$status" > "$launch.status"',
        "done",
    ]


def _overhead_lines(o: OverheadRuns, first: int) -> list:
    """The overhead runs: a provisional fit of the suites measured so far, their jobs with speed
    probes from that fit (`validate.slurm jobs`), then the launch loop, each run recorded in the
    steps ledger as `perfsim calibrate` records its local runs. A run that fails its launch is left
    out, and the fit goes on with the others."""
    common = ("--dtype", o.dtype, "--steps", str(o.steps), "--warmup", str(o.warmup))
    results = os.path.splitext(o.ledger)[0] + "-results"
    runs = json.dumps([list(run) for run in o.runs], sort_keys=True, separators=(",", ":"))
    return ["", f"# {first + 1}. {o.comment}",
            "# Real training steps of the calibration model, timed with speed probes from a provisional",
            "# fit of the suites above (perfsim/calibrate/overheads.py), all runs in one launch as the",
            "# validation job runs its plans; a run that fails its launch is left out of the fit.",
            _command(("perfsim",) + tuple(o.provisional_fit_argv)),
            f"RESULTS={shlex.quote(results)}",
            'mkdir -p "$RESULTS"',
            f'python -m validate.slurm jobs "$RESULTS" --system {shlex.quote(o.provisional)} --dtype {o.dtype} '
            f"--runs {shlex.quote(runs)}",
            ] + _launch_loop(f"--system {shlex.quote(o.provisional)} {_command(common)} --ledger {shlex.quote(o.ledger)}",
                             f"{_command(common)} --timeout {o.timeout:g}", f"PORT0 + {first}",
                             'echo "perfsim calibrate: fitting without the runs named above" >&2; break')


def probes(plan: dict, model_spec: str, system_name: str, dtype: str) -> tuple:
    """(GEMM probe seconds, LayerNorm probe seconds, PROBE_KIND) of the plan's speed probes
    (validate.speed_probe.probe_expectations): the calibration's reference kernels where the profile
    carries their times, else the model's FC1 GEMM and LayerNorm priced by the profile; as
    `perfsim validate --emit-slurm` writes them into its job."""
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan
    from perfsim.spec.system import load_system
    from validate import timing
    from validate.speed_probe import probe_expectations

    model, plan = load_model(model_spec), Plan(**plan)
    system = timing.harness_system(load_system(system_name), dtype, "xpu")
    probe, norm, reference = probe_expectations(system, dtype, model, plan)
    return probe, norm, PROBE_KIND[reference]


# How probes() names the probes' kind: the calibration's reference kernels, or the model's shapes.
PROBE_KIND = {True: "reference", False: "model"}


MAX_PLANS = 100  # plan i rendezvouses on port base + i, inside the job's block of 100 ports


@dataclass(frozen=True, kw_only=True)
class ValidationJob(BatchJob):
    """A training-step validation on `nodes` x 8 tiles: every plan (perfsim Plan dicts) measured by
    `python -m validate.steps`, then compared by `perfsim validate --device xpu`."""
    plans: tuple  # of Plan.as_dict() dicts
    probes: tuple  # per plan, (GEMM seconds, LayerNorm seconds, PROBE_KIND) of its speed probes (probes())
    model: str
    system: str
    dtype: str = "bf16"
    steps: int = 3
    warmup: int = 1
    timeout: int = 300
    ledger: str = "validation-xpu.jsonl"
    results: str = "validation-xpu-results"  # folder of rank 0's per-plan JSON
    out: str = "validation-xpu.json"  # the `perfsim validate --json` output
    job_name: str = "perfsim-validate"

    @property
    def world(self) -> int:
        return self.nodes * TILES_PER_NODE


def plans_argument(plans) -> str:
    """The plans as `--plans` text (FIELD=VALUE lists joined by ';', validate.timing.parse_plans)."""
    def value(v):
        return str(v).lower() if isinstance(v, bool) else str(v)
    return ";".join(",".join(f"{k}={value(v)}" for k, v in p.items()) for p in plans)


def validation_jobs(job: ValidationJob) -> list:
    """validate.steps --jobs entries of the job's plans: each plan with its speed probes' seconds."""
    return [{"plan": plan, "probe_expected_s": probe, "norm_probe_expected_s": norm,
             "reference_probes": kind == "reference"} for plan, (probe, norm, kind) in zip(job.plans, job.probes)]


def validation_script(job: ValidationJob) -> str:
    """The validation batch script's text (deterministic: compared byte for byte by the golden test)."""
    if not 1 <= len(job.plans) <= MAX_PLANS:
        raise ValueError(f"a validation job runs 1 to {MAX_PLANS} plans, got {len(job.plans)}")
    if len(job.probes) != len(job.plans):
        raise ValueError(f"{len(job.plans)} plans but {len(job.probes)} probe times")
    common = ("--model", job.model, "--dtype", job.dtype, "--steps", str(job.steps), "--warmup", str(job.warmup))
    lines = _preamble(job, "perfsim validate (real training steps)", "perfsim validate --emit-slurm",
                      "skips the plans already measured", f"$(( {job.port_base} + SLURM_JOB_ID % 100 * {MAX_PLANS} ))")
    jobs = ",\n".join(json.dumps(entry, sort_keys=True, separators=(",", ":")) for entry in validation_jobs(job))
    lines += [
        "PORT0=$MASTER_PORT",
        f"RESULTS={shlex.quote(job.results)}",
        'mkdir -p "$RESULTS"',
        "",
        f'echo "perfsim validate: {len(job.plans)} plan(s), $NRANKS ranks on $SLURM_NNODES nodes, '
        'rendezvous $MASTER_ADDR:$MASTER_PORT"',
        f'if [ "$NRANKS" -ne {job.world} ]; then echo "the plans need {job.world} ranks, the job has $NRANKS" >&2; '
        "exit 1; fi",
        "",
        "# The plans, each with the seconds the profile predicts for its speed probes (a GEMM, a",
        "# LayerNorm; the calibration's reference kernels where reference_probes is true, else the",
        "# model's FC1 GEMM and LayerNorm): steps taken while a tile ran off that speed are taken again",
        "# (validate/speed_probe.py).",
        "cat > \"$RESULTS/jobs.json\" <<'JOBS'",
        "[" + jobs + "]",
        "JOBS",
        "",
        "# One launch runs every plan not yet in the ledger, one after the other; rank 0 writes each",
        "# plan's result as a line when the plan ends. `validate.slurm next` adds those lines to the",
        "# ledger with perfsim's prediction (as `perfsim validate --device` does when it launches",
        "# locally) and names the next launch's jobs, nothing once every plan is in. A launch that",
        "# fails is blamed on its first plan without a result, which the next launch leaves out.",
    ] + _launch_loop(f"--system {shlex.quote(job.system)} {_command(common)} --ledger {shlex.quote(job.ledger)}",
                     f"{_command(common)} --timeout {job.timeout}", "PORT0")
    compare = ("python", "-m", "perfsim.cli", "validate", "--device", "xpu", "--nproc", str(job.world),
               "--system", job.system, "--plans", plans_argument(job.plans)) + common + (
               "--ledger", job.ledger, "--json")
    lines += ["", "# Every plan is in the ledger now: compare (no GPU used, nothing measured again)",
              f"{_command(compare)} > {shlex.quote(job.out)}",
              f'echo "perfsim validate: comparison in {job.out}"']
    return "\n".join(lines) + "\n"


def _read_json(path: str):
    with open(path) as fh:
        return json.load(fh)


def record_result(measured: dict, plan: dict, model_spec: str, system_name: str, nproc: int, dtype: str, steps: int,
                  warmup: int, ledger_path: str, alone: bool = False) -> bool:
    """Append rank 0's result of one plan, with perfsim's prediction, to the ledger under the key
    `perfsim validate --device xpu --nproc N` looks up (`alone`: a one-device plan run on every
    rank, keyed as perfsim calibrate's local run of it); False if it was there already."""
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan
    from perfsim.spec.system import load_system
    from validate import timing
    from validate.ledger import Ledger

    plan = Plan(**plan)
    key = timing.point_key(model_spec, plan, dtype, steps, warmup, "xpu", nproc, alone=alone)
    system = timing.harness_system(load_system(system_name), dtype, "xpu")
    with Ledger(ledger_path, {"device_kind": "xpu", "world_size": nproc}, check=timing.step_record_problem) as ledger:
        if ledger.done(key):
            return False
        prediction = timing.predicted(load_model(model_spec), system, plan, dtype)
        ledger.append(timing.step_record(key, model_spec, plan, dtype, steps, warmup, measured, prediction, system))
    return True


def write_jobs(results: str, runs: list, system_name: str, dtype: str) -> list:
    """Write `results`/jobs.json for the runs [(model spec, plan dict[, "alone"]), ...]: each a
    validate.steps job with its own model and its speed probes priced by the profile (probes()),
    "alone" where its one-device plan runs on every rank (validate.steps); the jobs."""
    jobs = []
    for model_spec, plan, *how in runs:
        if how not in ([], ["alone"]):
            raise ValueError(f"a run is [model, plan] or [model, plan, \"alone\"], got {[model_spec, plan, *how]!r}")
        probe, norm, kind = probes(plan, model_spec, system_name, dtype)
        jobs.append({"model": model_spec, "plan": plan, "probe_expected_s": probe, "norm_probe_expected_s": norm,
                     "reference_probes": kind == "reference", **({"alone": True} if how else {})})
    with open(os.path.join(results, "jobs.json"), "w") as fh:
        json.dump(jobs, fh)
    return jobs


def _whole_lines(path: str) -> list:
    """The results of a launch: its whole lines (a line cut short by the launch's end is not one)."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh.read().split("\n")[:-1]]


def next_launch(results: str, model_spec: str | None, system_name: str, nproc: int, dtype: str, steps: int,
                warmup: int, ledger_path: str) -> tuple:
    """(the path stem of the next launch's files, or None when no plan is left; (job, launch,
    exit status) of each job left out after a launch failed on it): every result the launches in
    `results` wrote is added to the ledger first. Launch K's files are launch-K.jobs.json (its
    jobs), launch-K.jsonl (rank 0's lines) and launch-K.status (the launch's exit status, written
    when it ended: a launch without one was cut short with the batch job, which blames none of its
    plans). A launch that ended without a result for each of its jobs is blamed on the first job
    without one. A job's model is its own "model" where it has one (the overhead runs), else
    `model_spec`."""
    from perfsim.spec.plan import Plan
    from validate import timing

    def model_of(job: dict) -> str:
        if not job.get("model", model_spec):
            raise ValueError(f"job {json.dumps(job['plan'], sort_keys=True)} has no model and none was given")
        return job.get("model", model_spec)

    def key(job: dict) -> str:
        return timing.point_key(model_of(job), Plan(**job["plan"]), dtype, steps, warmup, "xpu", nproc,
                                alone=job.get("alone", False))

    stems = sorted((name[:-len(".jobs.json")] for name in os.listdir(results) if name.startswith("launch-")
                    and name.endswith(".jobs.json")), key=lambda stem: int(stem.split("-")[1]))
    blamed, recorded = {}, timing.ledger_keys(ledger_path)
    for stem in stems:
        path = os.path.join(results, stem)
        jobs, lines = _read_json(path + ".jobs.json"), _whole_lines(path + ".jsonl")
        for job, measured in zip(jobs, lines):
            if key(job) not in recorded:  # each launch's lines are read at every call
                record_result(measured, job["plan"], model_of(job), system_name, nproc, dtype, steps, warmup,
                              ledger_path, alone=job.get("alone", False))
                recorded.add(key(job))
        if len(lines) < len(jobs) and os.path.exists(path + ".status"):
            with open(path + ".status") as fh:
                status = fh.read().strip()
            blamed[key(jobs[len(lines)])] = (jobs[len(lines)], stem, status)
    left, seen = [], set()
    for job in _read_json(os.path.join(results, "jobs.json")):
        k = key(job)
        if k not in recorded and k not in blamed and k not in seen:
            left.append(job)
            seen.add(k)
    failed = [(job, stem, status) for k, (job, stem, status) in blamed.items() if k not in recorded]
    if not left:
        return None, failed
    stem = os.path.join(results, f"launch-{int(stems[-1].split('-')[1]) + 1 if stems else 0}")
    with open(stem + ".jobs.json", "w") as fh:
        json.dump(left, fh)
    return stem, failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m validate.slurm", description="steps of the SMNG-P2 job scripts")
    sub = p.add_subparsers(dest="what", required=True)
    j = sub.add_parser("jobs", help="write the results folder's jobs.json for runs of models of their own, their "
                                    "speed probes priced by a profile")
    j.add_argument("results", help="the job's results folder")
    j.add_argument("--runs", required=True, help="JSON list of [model spec, plan as a JSON object of Plan fields], "
                                                 "with \"alone\" third where the one-device plan runs on every rank")
    j.add_argument("--system", required=True)
    j.add_argument("--dtype", required=True)
    n = sub.add_parser("next", help="add what the launches so far wrote to the ledger, then print the path stem of "
                                    "the next launch's files (nothing when every plan is in)")
    n.add_argument("results", help="the job's results folder (its jobs.json: every plan of the job)")
    n.add_argument("--model", help="the model of every job without one of its own")
    for flag in ("--system", "--dtype", "--ledger"):
        n.add_argument(flag, required=True)
    for flag in ("--nproc", "--steps", "--warmup"):
        n.add_argument(flag, type=int, required=True)
    args = p.parse_args(argv)
    if args.what == "next":
        try:
            stem, failed = next_launch(args.results, args.model, args.system, args.nproc, args.dtype, args.steps,
                                       args.warmup, args.ledger)
        except (OSError, ValueError, KeyError) as e:  # no jobs.json, a line or job that is not what it should be
            print(f"python -m validate.slurm next: {args.results}: {e}", file=sys.stderr)
            return 2
        for job, launch, status in failed:
            what = json.dumps(job["plan"], sort_keys=True) + (f" of model {job['model']}" if "model" in job else "")
            print(f"python -m validate.slurm next: {what} is left out: {launch} ended "
                  f"(exit status {status}) before its result; remove {os.path.join(args.results, launch)}.* to "
                  "try it again", file=sys.stderr)
        if stem is None and failed:
            print(f"python -m validate.slurm next: every other plan is in {args.ledger}; {len(failed)} failed",
                  file=sys.stderr)
            return 1
        if stem is not None:
            print(stem)
        return 0
    try:
        jobs = write_jobs(args.results, json.loads(args.runs), args.system, args.dtype)
    except (OSError, ValueError, TypeError, PerfsimError) as e:  # no such folder, runs not [model, plan] pairs
        print(f"python -m validate.slurm jobs: {e}", file=sys.stderr)
        return 2
    print(f"{len(jobs)} jobs in {os.path.join(args.results, 'jobs.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
