"""The timing run of `perfsim validate --device D --nproc N`: every plan measured on real ranks
(validate.steps), predicted by perfsim with the device's calibrated profile, and both kept in the
ledger. This side imports torch only to check, before the first launch, that the ranks can run
(a run that reads every plan back from the ledger needs neither torch nor the device).

A plan already in the ledger (same model, plan, dtype, steps, device, rank count and harness
revision) is not run again, so an interrupted run resumes where it stopped and nothing measured is
lost.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import sys
import tempfile

from perfsim.errors import PerfsimError
from perfsim.ledger import step_problem
from perfsim.probed_speed import speed_shifts
from validate.speed_probe import DEFAULT_TOLERANCE, MAX_STEPS_FACTOR, all_at_speed, step_time, steps_settled

DEFAULT_MODEL = "layers=4,hidden=512,heads=8,seq=256,vocab=8192,tied_embeddings=false,dropout=false"
DEFAULT_SYSTEM = {"cpu": "cpu-calibrated"}
DTYPE_BYTES = {"bf16": 2, "fp32": 4}


def default_plans(nproc: int, model=None, mbs: int = 2) -> list:
    """At least 12 plans over `nproc` devices: 1d tensor parallelism with and without SP under
    each recompute mode, the three pipeline schedules, and ZeRO 0-3; 2d at 4 devices, 2.5d and 3d
    at 8 (where their grids exist); today's stack: 1d with flash attention (torch's SDPA) and
    context parallelism (ring attention). With `model` (a ModelSpec), the plans it cannot run (tp
    not dividing its heads, pp not dividing its layers, cp not dividing its sequence) are left out;
    a model with experts runs `expert_plans` instead on more than one device (EP at 2 and 4 ranks)."""
    from perfsim.spec.plan import RECOMPUTE, Plan, plan_problems

    n = nproc
    tp = [Plan(tp=n, sp=sp, recompute=rc, mbs=mbs, gbs=2 * mbs) for sp in (False, True) for rc in RECOMPUTE]
    pp = [Plan(pp=n, schedule=s, vpp=2 if s == "interleaved" else 1, mbs=mbs, gbs=4 * mbs)
          for s in ("gpipe", "1f1b", "interleaved")]
    dp = [Plan(dp=n, zero=z, mbs=mbs, gbs=2 * mbs * n) for z in range(4)]
    grids = {4: [Plan(tp=4, tp_mode="2d", mbs=mbs, gbs=2 * mbs)],
             8: [Plan(tp=8, tp_mode="2.5d", tp_depth=2, mbs=mbs, gbs=2 * mbs), Plan(tp=8, tp_mode="3d", mbs=mbs, gbs=2 * mbs)]}
    stack = [Plan(tp=n, attention="flash", mbs=mbs, gbs=2 * mbs)]
    if "cp" in Plan.__dataclass_fields__:
        stack.append(Plan(cp=n, attention="flash", mbs=mbs, gbs=2 * mbs))
    plans = (tp + pp + dp + grids.get(n, []) + stack if n > 1 else
             [Plan(recompute=rc, mbs=mbs, gbs=2 * mbs) for rc in RECOMPUTE] + [Plan(attention="flash", mbs=mbs, gbs=2 * mbs)])
    if getattr(model, "moe", False) and n > 1:
        plans = expert_plans(n, mbs)
    return [p for p in plans if model is None or not plan_problems(p, model, n)]


def expert_plans(n: int, mbs: int = 2) -> list:
    """The plans of a model with experts on `n` > 1 ranks (validate.expert_parallel runs them: data
    parallelism of the attention, experts folded over EP x expert-DP): EP over every rank with each
    dispatcher, EP over 2 ranks beside expert-DP where n > 2, selective recomputation, every
    expert on every rank (ep 1), and, where the model's heads split n ways, 1d + SP tensor
    parallelism with its ranks folded into EP (experts not tensor-parallel: etp 1) or the experts
    tensor-parallel over them (etp = tp, Megatron-Core's default)."""
    from perfsim.spec.plan import Plan

    if "ep" not in Plan.__dataclass_fields__:  # a perfsim without expert parallelism
        return [Plan(dp=n, mbs=mbs, gbs=2 * mbs * n)]
    eps = [n] + ([2] if n > 2 else [])
    plans = [Plan(dp=n, ep=e, mbs=mbs, gbs=2 * mbs * n) for e in eps]
    plans += [Plan(dp=n, ep=n, moe_dispatcher="allgather", mbs=mbs, gbs=2 * mbs * n),
              Plan(dp=n, ep=n, recompute="selective", mbs=mbs, gbs=2 * mbs * n), Plan(dp=n, mbs=mbs, gbs=2 * mbs * n),
              Plan(tp=n, sp=True, ep=n, etp=1, mbs=mbs, gbs=2 * mbs),  # the attention's TP ranks folded into EP
              Plan(tp=n, sp=True, mbs=mbs, gbs=2 * mbs)]  # the experts tensor-parallel (etp = tp, Megatron-Core's default)
    return plans


def parse_plans(text: str) -> list:
    """'tp=2,sp=true,recompute=full;pp=2,schedule=gpipe,gbs=8' -> Plans (one per ';' part)."""
    from perfsim.spec.plan import Plan

    types = {f.name: f.type for f in dataclasses.fields(Plan)}
    plans = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = {}
        for item in part.split(","):
            key, sep, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in types:
                raise PerfsimError(f"--plans: {item.strip()!r} is not FIELD=VALUE with a plan field "
                                   f"({', '.join(types)})")
            kind = types[key]
            try:
                if kind in (int, "int"):
                    fields[key] = int(value)
                elif kind in (bool, "bool"):
                    if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                        raise ValueError
                    fields[key] = value.lower() in ("1", "true", "yes")
                else:
                    fields[key] = value.strip()
            except ValueError:
                raise PerfsimError(f"--plans: {key}={value!r} is not a valid {key}") from None
        if fields.get("schedule") is None and fields.get("vpp", 1) > 1:
            fields["schedule"] = "interleaved"
        plans.append(Plan(**fields))
    if not plans:
        raise PerfsimError("--plans is empty; give plans such as 'tp=2,recompute=full;pp=2,gbs=8'")
    return plans


def plan_label(plan) -> str:
    """Short name of what a plan varies: 'tp2 1d+sp full', 'pp2 interleaved v2', 'dp2 zero3'."""
    parts = []
    if plan.tp > 1:
        parts.append(f"tp{plan.tp} {plan.tp_mode}{'+sp' if plan.sp else ''}")
    if getattr(plan, "cp", 1) > 1:
        parts.append(f"cp{plan.cp}")
    if plan.pp > 1:
        parts.append(f"pp{plan.pp} {plan.schedule}{f' v{plan.vpp}' if plan.vpp > 1 else ''}")
    if plan.dp > 1:
        parts.append(f"dp{plan.dp} zero{plan.zero}")
    if getattr(plan, "ep", 1) > 1:
        parts.append(f"ep{plan.ep}" + (f" etp{plan.etp}" if plan.etp not in (0, plan.tp) else "")
                     + (f" {plan.moe_dispatcher}" if plan.moe_dispatcher != "alltoall" else ""))
    parts.append(f"rc-{plan.recompute} mbs{plan.mbs} m{plan.microbatches}")
    return " ".join(parts)


# What the steps run, revised when a change to validate/ makes a step run differently (its time,
# not only its bookkeeping): a ledger's points of an older revision stay in it, as measured, but
# are not read back for the current one. 1: the harness of the first ledgers; 2: the attention
# core as Megatron's kernels (scale and causal mask on the scores' GEMM, validate.gpt).
HARNESS_REVISION = 2


# Plan fields added after ledgers were written, with the value every earlier point ran with: a
# plan at that value keys as before the field existed, so a ledger's points are still found.
LATER_PLAN_FIELDS = {"attention": "unfused", "dp_overlap": False, "tp_overlap": False, "cp": 1,
                     "first_stage_layers": 0, "last_stage_layers": 0, "pp_layout": "",
                     "ep": 1, "etp": 0, "moe_dispatcher": "alltoall", "ep_overlap": False}


def harness_problems(plan, model=None) -> list:
    """What the harness cannot run as perfsim prices it: plan knobs of today's stacks that
    validate/ does not implement yet (its collectives are issued between the computations).
    Both attention kernels run: unfused as Megatron's kernels, flash as torch's
    scaled_dot_product_attention (validate.gpt). Experts (a `model` with them, or ep > 1) run
    with data parallelism alone (validate.expert_parallel.step_problems)."""
    problems = context_parallel_problems(plan)
    if getattr(plan, "ep", 1) > 1 or (getattr(model, "moe", False) and plan.devices > 1):
        from validate.expert_parallel import step_problems

        problems += step_problems(plan, model)
    for knob in ("dp_overlap", "tp_overlap", "ep_overlap"):
        if getattr(plan, knob, False):
            problems.append(f"the harness issues its collectives between the computations; leave {knob} off")
    if getattr(plan, "first_stage_layers", 0) or getattr(plan, "last_stage_layers", 0) or getattr(plan, "pp_layout", ""):
        problems.append("the harness's pipeline splits the layers evenly over its stages; leave first_stage_layers, "
                        "last_stage_layers and pp_layout out")
    return problems


def context_parallel_problems(plan) -> list:
    """What of a cp > 1 plan the harness's context-parallel step (validate.context_parallel) does
    not run; nothing for cp = 1 (and for a Plan from before the cp field)."""
    if getattr(plan, "cp", 1) == 1:
        return []
    problems = []
    if plan.attention != "flash":
        problems.append("the harness's context parallelism is ring attention, a fused kernel; give --attention flash")
    if plan.pp > 1 or plan.tp_mode != "1d" or plan.sp or plan.zero:
        problems.append("the harness runs context parallelism with 1d tensor parallelism without SP and data "
                        "parallelism with ZeRO 0, without pipelining")
    return problems


def plan_key_fields(plan) -> dict:
    """The plan as its ledger key sees it (LATER_PLAN_FIELDS at their old value left out)."""
    return {k: v for k, v in plan.as_dict().items() if LATER_PLAN_FIELDS.get(k, object()) != v}


def point_key(model_spec: str, plan, dtype: str, steps: int, warmup: int, device: str, nproc: int,
              round_: int = 1, revision: int = HARNESS_REVISION, alone: bool = False) -> str:
    """What identifies one plan's measurement in a ledger; rounds after the first have keys of
    their own (the first round's is what ledgers before rounds hold), and so do harness revisions
    after the first and a one-device plan run alone on each of `nproc` ranks (validate.steps)."""
    fields = [model_spec, plan_key_fields(plan), dtype, steps, warmup, device, nproc] + ([revision] if revision > 1 else []) \
        + (["alone"] if alone else [])
    text = json.dumps(fields, sort_keys=True)
    key = "step:" + hashlib.sha256(text.encode()).hexdigest()[:20]
    return key if round_ == 1 else f"{key}:round{round_}"


def speed_flags(measured: dict) -> list:
    """Which of a measurement's timed steps ran at the profile's speed (validate.speed_probe);
    all of them in records from before the probe."""
    return measured.get("at_speed") or [True] * len(measured["step_times_s"])


def judged(measured: dict, probe_expected_s: float, norm_probe_expected_s: float, tolerance: float) -> dict:
    """`measured` with every timed step judged at speed against this profile's predicted probe
    times and this tolerance, and its step time the median of the steps now at speed. The ranks
    judged against the profile and tolerance of the run that measured: a plan read back from the
    ledger under another profile (one calibrated since) or another --speed-tolerance is judged
    anew, a fresh one the same as the ranks did. Records from before a probe keep its verdict
    (a probe not recorded lets every step count)."""
    probes = measured.get("probe_s")
    if not probes:
        return measured
    norms = measured.get("norm_probe_s") or [None] * len(probes)
    flags = [all_at_speed([p, n], [None if p is None else probe_expected_s, None if n is None else norm_probe_expected_s],
                          tolerance) for p, n in zip(probes, norms)]
    return dict(measured, at_speed=flags, probe_expected_s=probe_expected_s,
                norm_probe_expected_s=norm_probe_expected_s if any(n is not None for n in norms) else None,
                step_time_s=step_time(measured["step_times_s"], flags))


def merge_rounds(measured: list) -> dict:
    """One plan's measurements of several rounds as one: every round's timed steps together and
    the median of those at speed, the largest peak memory; the counts (the same in every round)
    of the first."""
    if len(measured) == 1:
        return measured[0]
    times = [t for m in measured for t in m["step_times_s"]]
    flags = [f for m in measured for f in speed_flags(m)]
    ranks = [m.get("rank_step_times_s") for m in measured]
    probes = [p for m in measured for p in m.get("probe_s") or [None] * len(m["step_times_s"])]
    norms = [p for m in measured for p in m.get("norm_probe_s") or [None] * len(m["step_times_s"])]
    return dict(measured[0], step_times_s=times, at_speed=flags, probe_s=probes, norm_probe_s=norms,
                step_time_s=step_time(times, flags), rank_step_times_s=[r for x in ranks for r in x] if all(ranks) else None,
                rounds=len(measured), peak_memory_bytes=max(m["peak_memory_bytes"] for m in measured))


def harness_system(system, dtype: str, device: str = "cpu"):
    """The profile as the harness trains on a `device` kind (perfsim.calibrate.overheads.as_trained),
    its experts' tokens balanced as validate.moe routes them (moe.imbalance 1: forced_balance)."""
    from perfsim.calibrate.overheads import as_trained

    trained = as_trained(system, dtype, device)
    try:
        from perfsim.spec.system import forced_balance
    except ImportError:  # a perfsim without experts
        return trained
    return forced_balance(trained)


def predicted(model, system, plan, dtype: str) -> dict:
    """What perfsim says the measured quantities are. Memory: the bytes the step's tensors occupy,
    as the allocator's peak counts them: perfsim's total less the profile's reserved_memory_bytes
    (the runtime the ranks hold before the step is built, which the measurement subtracts) and less
    its allocator_overhead_fraction (the caching allocator's slack, which the allocated bytes on
    a GPU and the profiler's on a CPU do not include)."""
    from perfsim.cost.memory import allocated_bytes
    from perfsim.cost.traffic import step_sent_bytes
    from perfsim.predict import predict

    p = predict(model, system, plan, dtype)
    sent = step_sent_bytes(model, system, plan, dtype)
    return {"step_time_s": p.step_time_s, "flops": p.hardware_flops_per_step, "comm_bytes": sent["total"],
            "comm_bytes_by_dimension": {k: sent[k] for k in ("tp", "cp", "pp", "dp", "ep") if k in sent},
            "activation_bytes": p.memory_bytes["activations"],
            "peak_memory_bytes": allocated_bytes(p.memory_bytes["total"], system.framework),
            "time_breakdown_s": p.time_breakdown_s, "memory_bytes": p.memory_bytes}


def measure_plans(jobs: list, model_spec: str, device: str, nproc: int, dtype: str, steps: int, warmup: int,
                  timeout_s: float, threads, speed_tolerance: float = DEFAULT_TOLERANCE,
                  retake_until_s: float | None = None, budget_s: float | None = None, done=None) -> list:
    """Launch the ranks once for all `jobs` (validate.steps.measure's, plans as Plans) and return
    rank 0's results in their order; `done(index, result)` is called with each as soon as the
    ranks wrote it, so that a run stopped or failed keeps the plans it finished. One launch for
    all spares each plan the start of its ranks (seconds of interpreter and torch imports, and on
    a GPU a context and a communicator)."""
    from validate.launcher import launch_ranks

    results = []
    with tempfile.TemporaryDirectory(prefix="perfsim-validate-") as tmp:
        out, jobs_file = os.path.join(tmp, "results.jsonl"), os.path.join(tmp, "jobs.json")
        with open(jobs_file, "w") as fh:
            json.dump([dict(job, plan=job["plan"].as_dict()) for job in jobs], fh)
        argv = ["-m", "validate.steps", out, "--jobs", jobs_file, "--model", model_spec,
                "--device", device, "--dtype", dtype, "--steps", str(steps), "--warmup", str(warmup),
                "--timeout", str(timeout_s), "--speed-tolerance", repr(speed_tolerance)] \
            + (["--threads", str(threads)] if threads else []) \
            + (["--retake-until", repr(retake_until_s)] if retake_until_s is not None else []) \
            + (["--budget", repr(budget_s)] if budget_s is not None else [])

        def take() -> None:  # the whole lines rank 0 wrote since the last look (a few kB: read again each time)
            if not os.path.exists(out):
                return
            with open(out) as fh:
                lines = fh.read().split("\n")
            for line in lines[len(results):-1]:
                results.append(json.loads(line))
                if done is not None:
                    done(len(results) - 1, results[-1])

        def running() -> str:  # the plan a failure is blamed on: the first one without a result
            take()
            return f"validation of {plan_label(jobs[min(len(results), len(jobs) - 1)]['plan'])}:"
        launch_ranks(argv, nproc, device, threads, what=running, on_poll=take,
                     resume="the ledger keeps the plans already measured; run the same command again to resume")
        take()
    return results


def measure_plan(plan, model_spec: str, device: str, nproc: int, dtype: str, steps: int, warmup: int,
                 timeout_s: float, threads, probe_expected_s: float | None = None,
                 speed_tolerance: float = DEFAULT_TOLERANCE, norm_probe_expected_s: float | None = None,
                 reference_probes: bool = False, retake_until_s: float | None = None) -> dict:
    """Launch the ranks for one plan and return rank 0's result."""
    job = {"plan": plan, "probe_expected_s": probe_expected_s, "norm_probe_expected_s": norm_probe_expected_s,
           "reference_probes": reference_probes}
    return measure_plans([job], model_spec, device, nproc, dtype, steps, warmup, timeout_s, threads,
                         speed_tolerance, retake_until_s)[0]


# Why a ledger line is not a usable training-step record (None if it is): perfsim's reader checks
# every field this module reads back on resume (perfsim/ledger.py).
step_record_problem = step_problem


def _entry(plan, prediction: dict, measured: dict) -> dict:
    """The per-plan object of `perfsim validate --json`."""
    def pair(name, other="measured", key=None):
        return {"predicted": prediction[name], other: measured[key or name]}

    # Saved-tensor hooks do not see inside torch's checkpoint (its own hooks keep what the
    # recomputation rebuilds), so under full recomputation the counted side misses the layers.
    from perfsim.calibrate.overheads import rank_spread

    activations = dict(pair("activation_bytes", "counted"), comparable=plan.recompute != "full")
    speed = machine_speed(measured)
    return {"plan": plan.as_dict(), "label": plan_label(plan),
            "step_time_s": pair("step_time_s"), "flops": pair("flops", "counted"),
            "comm_bytes": pair("comm_bytes", "counted"), "activation_bytes": activations,
            "peak_memory_bytes": pair("peak_memory_bytes"),
            "comm_bytes_predicted_by_dimension": prediction["comm_bytes_by_dimension"],
            "comm_bytes_counted_by_kind": measured["comm_bytes_by_kind"],
            "step_times_s": measured["step_times_s"], "time_breakdown_s": prediction["time_breakdown_s"],
            "rank_spread": rank_spread(measured),
            "machine_speed": speed, "machine_matches_profile": machine_matches(speed["steps_at_speed"], speed["steps"]),
            "step_time_error_at_measured_speed": error_at_measured_speed(measured, prediction)}


def error_at_measured_speed(measured: dict, prediction: dict) -> float | None:
    """The step-time error with the prediction moved to the machine's speed in each timed step
    (perfsim.probed_speed), the median over every timed step, at speed or not. It tells a model
    that is off from a machine that drifted (docs/real-steps-timing.md, "Errors at the measured
    speed"). None without a GEMM probe in every step."""
    shifts = speed_shifts(measured, prediction["time_breakdown_s"])
    if shifts is None:
        return None
    return statistics.median((prediction["step_time_s"] + shift) / step_s - 1
                             for step_s, shift in zip(measured["step_times_s"], shifts))


def machine_matches(steps_at_speed: int, steps: int) -> bool:
    """Whether the machine ran as its profile describes, by the speed probes: at least half of the
    timed steps ran at the profile's speed (on a machine as calibrated most do: 3 of 3 to 3 of 5
    at the default tolerance; on another machine, or this one in a slow spell, few or none)."""
    return 2 * steps_at_speed >= steps


def machine_verdict(results: list) -> dict:
    """Over a run's plans (`--json` entries): whether the machine matches the profile
    (machine_matches over all their timed steps), and how fast it ran against it: the median over
    the plans of each probe's time over the profile's (GEMM and LayerNorm; > 1 slower, None
    without that probe)."""
    speeds = [r["machine_speed"] for r in results]
    steps, at_speed = sum(s["steps"] for s in speeds), sum(s["steps_at_speed"] for s in speeds)

    def median(key):
        values = [s[key] for s in speeds if s.get(key)]
        return statistics.median(values) if values else None
    return {"matches": machine_matches(at_speed, steps), "steps": steps, "steps_at_speed": at_speed,
            "gemm_over_profile": median("probe_over_profile"), "norm_over_profile": median("norm_probe_over_profile")}


def _pace(ratio: float | None, tolerance: float) -> str | None:
    """'57x slower' or '2.1x faster' for a probe's measured over predicted time; None within the
    tolerance or without the probe."""
    if ratio is None or 1 / (1 + tolerance) <= ratio <= 1 + tolerance:
        return None
    factor = ratio if ratio > 1 else 1 / ratio
    amount = f"{factor:.0f}" if factor >= 10 else f"{factor:.1f}"
    return f"{amount}x {'slower' if ratio > 1 else 'faster'}"


def mismatch_warning(verdict: dict, system_name: str, tolerance: float, calibrate_command: str,
                     validate_command: str) -> str:
    """What `perfsim validate` says above and below its results when the machine does not match
    the profile (machine_verdict): by how much, by each probe, and the commands that calibrate
    this machine and validate again."""
    paces = [f"{what} {pace}" for what, ratio in (("GEMMs", verdict["gemm_over_profile"]),
                                                  ("element-wise kernels", verdict["norm_over_profile"]))
             if (pace := _pace(ratio, tolerance))]
    runs = (f"runs {' and '.join(paces)} than profile {system_name} describes (by the speed probes)" if paces
            else f"does not run at the speed profile {system_name} describes")
    return (f"WARNING: this machine {runs}: {verdict['steps_at_speed']} of {verdict['steps']} timed steps ran "
            f"within {100 * tolerance:.0f}% of the profile's speed (at least half must), so the step-time errors "
            f"test the profile against this machine, not perfsim's model. Another machine, or this one in a slow "
            f"spell: calibrate it, then validate against that profile:\n  {calibrate_command}\n  {validate_command}")


def machine_speed(measured: dict) -> dict:
    """What the speed probes saw over a plan's timed steps: how many ran at the profile's speed, the
    median over all steps of the step time and of each probe's time over the profile's (None
    before that probe existed)."""
    def over_profile(times, expected):
        times = [p for p in measured.get(times) or [] if p is not None]
        expected = measured.get(expected)
        return statistics.median(times) / expected if times and expected else None
    flags = speed_flags(measured)
    return {"steps": len(flags), "steps_at_speed": sum(flags),
            "step_time_all_steps_s": statistics.median(measured["step_times_s"]),
            "probe_over_profile": over_profile("probe_s", "probe_expected_s"),
            "norm_probe_over_profile": over_profile("norm_probe_s", "norm_probe_expected_s")}


def step_record(key: str, model_spec: str, plan, dtype: str, steps: int, warmup: int, measured: dict,
                prediction: dict, system) -> dict:
    """The ledger record of one plan's measured step and its prediction: the local run (run_plans)
    and the Slurm jobs (validate.slurm.record_result) write the same, so either one resumes from the other's ledger."""
    return {"key": key, "suite": "step", "op": "training_step", "dtype": dtype, "model": model_spec,
            "plan": plan.as_dict(), "steps": steps, "warmup": warmup, "harness_revision": HARNESS_REVISION,
            "measured": measured, "predicted": prediction, "system": system.name}


def run_plans(plans, model_spec: str, system_name: str, device: str, nproc: int, dtype: str = "bf16",
              steps: int = 3, warmup: int = 1, ledger_path: str | None = None, timeout_s: float = 300.0,
              threads=None, progress=None, rounds: int = 1, speed_tolerance: float = DEFAULT_TOLERANCE,
              budget_s: float | None = None, alone: bool = False) -> list:
    """Measure (or read back from the ledger) and predict every plan; the `--json` list. With
    `rounds` > 1 the whole list is run that many times, one plan after the other each time, and a
    plan's step time is the median over all its rounds' steps at the profile's speed
    (validate.speed_probe, within `speed_tolerance`): a machine whose speed drifts over minutes
    then weighs on every plan alike. `budget_s`: seconds the measuring may take; each plan retakes
    steps off the profile's speed only within its share (speed_probe.retake_seconds, worked out by the
    ranks before each plan). `alone`: one-device plans, each run on every one of the `nproc` ranks
    at once, a copy per rank (validate.steps; their step time is the slowest rank's)."""
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import plan_problems
    from perfsim.spec.system import load_system
    from validate.ledger import Ledger
    from validate.speed_probe import probe_expectations

    progress = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    model = load_model(model_spec)
    system = harness_system(load_system(system_name), dtype, device)
    for plan in plans:
        problems = plan_problems(plan, model, 1 if alone else nproc) + harness_problems(plan, model)
        if problems:
            raise PerfsimError(f"plan {plan_label(plan)}: {'; '.join(problems)}")
    ledger_path = ledger_path or f"validation-{device}.jsonl"
    keys = [[point_key(model_spec, plan, dtype, steps, warmup, device, nproc, r, alone=alone) for plan in plans]
            for r in range(1, rounds + 1)]
    if _unmeasured(ledger_path, keys):
        from validate.device import check_available

        check_available(device, "perfsim validate")
    predictions = [predicted(model, system, plan, dtype) for plan in plans]
    measured = [[] for _ in plans]

    def report(r: int, i: int, got: dict, source: str, probe, norm) -> None:
        got = judged(got, probe, norm, speed_tolerance)
        measured[i].append(got)
        real, pred = got["step_time_s"], predictions[i]["step_time_s"]
        where = f"round {r}/{rounds} " if rounds > 1 else ""
        speed = machine_speed(got)
        off = "" if machine_matches(speed["steps_at_speed"], speed["steps"]) else "".join(
            f", {name} probe {speed[key]:.2g}x the profile's time" for name, key in
            (("GEMM", "probe_over_profile"), ("LayerNorm", "norm_probe_over_profile")) if speed[key])
        progress(f"{where}[{i + 1}/{len(plans)}] {plan_label(plans[i])}: {source} {real:.3f} s, "
                 f"predicted {pred:.3f} s ({100 * (pred / real - 1):+.1f}%); "
                 f"{speed['steps_at_speed']} of {speed['steps']} steps at the profile's speed{off}")

    def from_ledger(r: int, i: int, record: dict) -> None:
        got = record["measured"]
        # judged against the kernels its probes timed (records before the reference kernels
        # timed the model's), whatever this profile would probe with now
        probe, norm, _ = probe_expectations(system, dtype, model, plans[i], got.get("reference_probes", False))
        report(r, i, got, "from the ledger", probe, norm)

    with Ledger(ledger_path, {"device_kind": device, "world_size": nproc}, check=step_record_problem) as ledger:
        earlier = dict(ledger.records)
        order = [(r, i, keys[r - 1][i]) for r in range(1, rounds + 1) for i in range(len(plans))]
        todo, seen = [], set()  # what to measure: a plan listed twice in one round only once
        for r, i, key in order:
            if key not in earlier and key not in seen:
                todo.append((r, i, key))
                seen.add(key)
        for r, i, key in order:
            if key in earlier:
                from_ledger(r, i, earlier[key])
        jobs = []
        for r, i, key in todo:
            probe, norm, reference = probe_expectations(system, dtype, model, plans[i])
            jobs.append({"plan": plans[i], "probe_expected_s": probe, "norm_probe_expected_s": norm,
                         "reference_probes": reference, **({"alone": True} if alone else {})})

        def finished(n: int, got: dict) -> None:
            r, i, key = todo[n]
            earlier[key] = ledger.append(step_record(key, model_spec, plans[i], dtype, steps, warmup, got,
                                                     predictions[i], system))
            cut = (budget_s is not None and len(got["step_times_s"]) < MAX_STEPS_FACTOR * steps
                   and not steps_settled(got["step_times_s"], speed_flags(got), steps, speed_tolerance))
            report(r, i, got, "measured" + (" (its retakes cut short by --budget)" if cut else ""),
                   jobs[n]["probe_expected_s"], jobs[n]["norm_probe_expected_s"])
        if jobs:
            measure_plans(jobs, model_spec, device, nproc, dtype, steps, warmup, timeout_s, threads, speed_tolerance,
                          budget_s=budget_s, done=finished)
        # the plans listed again, measured once above
        first = {key: (r, i) for r, i, key in todo}
        for r, i, key in order:
            if key in first and first[key] != (r, i):
                from_ledger(r, i, earlier[key])
    return [_entry(plan, prediction, merge_rounds(m)) for plan, prediction, m in zip(plans, predictions, measured)]


def ledger_keys(ledger_path: str) -> set:
    """The keys of the usable step records in the ledger (none if there is no ledger yet)."""
    from perfsim.ledger import read_ledger

    return {r["key"] for r in read_ledger(ledger_path, step_problem)[0]} if os.path.exists(ledger_path) else set()


def _unmeasured(ledger_path: str, keys: list) -> bool:
    """Whether any of `keys` (a list per round) is not in the ledger yet."""
    have = ledger_keys(ledger_path)
    return any(k not in have for row in keys for k in row)


def _error(pred, real):
    return None if not real else pred / real - 1


def summary(results: list) -> dict:
    """Mean absolute relative error of each compared quantity over the plans."""
    out = {}
    for name, other in (("step_time_s", "measured"), ("peak_memory_bytes", "measured"), ("flops", "counted"),
                        ("comm_bytes", "counted"), ("activation_bytes", "counted")):
        errors = [abs(e) for r in results if r[name].get("comparable", True)
                  and (e := _error(r[name]["predicted"], r[name][other])) is not None]
        out[name] = sum(errors) / len(errors) if errors else None
    every = [abs(r["step_time_s"]["predicted"] / r["machine_speed"]["step_time_all_steps_s"] - 1) for r in results]
    out["step_time_all_steps"] = sum(every) / len(every) if every else None
    scaled = [abs(e) for r in results if (e := r.get("step_time_error_at_measured_speed")) is not None]
    out["step_time_at_measured_speed"] = sum(scaled) / len(scaled) if scaled else None
    return out


def format_table(results: list) -> str:
    def pct_of(e):
        return "     -" if e is None else f"{100 * e:+6.1f}%"

    def pct(pred, real):
        return pct_of(_error(pred, real))

    def spread(r):
        x = r.get("rank_spread")
        return "-" if x is None else f"{100 * x['cv']:.1f}%"

    head = (f"{'plan':<34}{'step s':>8}{'pred':>8}{'err':>8}{'speed':>7}{'@speed':>8}{'ranks':>7}  {'peak MB':>8}{'pred':>8}{'err':>8}"
            f"  {'flops':>7}{'comm':>7}{'saved':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        st, mem, speed = r["step_time_s"], r["peak_memory_bytes"], r["machine_speed"]
        lines.append(
            f"{r['label']:<34}{st['measured']:>8.3f}{st['predicted']:>8.3f}{pct(st['predicted'], st['measured']):>8}"
            f"{speed['steps_at_speed']:>4}/{speed['steps']:<2}"
            f"{pct_of(r.get('step_time_error_at_measured_speed')):>8}{spread(r):>7}"
            f"  {mem['measured'] / 1e6:>8.1f}{mem['predicted'] / 1e6:>8.1f}{pct(mem['predicted'], mem['measured']):>8}"
            f"  {pct(r['flops']['predicted'], r['flops']['counted']):>7}"
            f"{pct(r['comm_bytes']['predicted'], r['comm_bytes']['counted']):>7}"
            f"{pct(r['activation_bytes']['predicted'], r['activation_bytes']['counted']) if r['activation_bytes']['comparable'] else '      -':>7}")
    s = summary(results)
    fmt = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    lines.append("")
    lines.append(f"mean |error| over {len(results)} plans: step time {fmt(s['step_time_s'])} (over every timed "
                 f"step, at the profile's speed or not: {fmt(s['step_time_all_steps'])}; at each step's measured "
                 f"speed: {fmt(s['step_time_at_measured_speed'])}), peak memory "
                 f"{fmt(s['peak_memory_bytes'])}, FLOPs {fmt(s['flops'])}, bytes sent {fmt(s['comm_bytes'])}, "
                 f"saved activations {fmt(s['activation_bytes'])} (full recomputation left out: the hooks do not "
                 "see inside torch's checkpoint)")
    lines.append("speed: timed steps whose GEMM and LayerNorm probes ran within the tolerance of the profile's prediction "
                 "(only those make a plan's step time, if any did); @speed: the error with the prediction moved to "
                 "each step's speed by its probes (compute by the GEMM probe, optimizer and overheads by the LayerNorm "
                 "probe, communication as predicted), the median over every timed step; ranks: the spread of the "
                 "ranks' own step times, their coefficient of variation about each step's mean (perfsim.calibrate."
                 "overheads.rank_spread: ranks that meet at collectives spread only in what follows the last one)")
    return "\n".join(lines)
