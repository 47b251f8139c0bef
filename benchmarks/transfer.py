"""Does one calibration transfer? For each of several "machines" made from this box by the
environment (instruction sets, threads), from scratch: `perfsim calibrate`, then `perfsim validate`
against that profile on a model the calibration never saw (issue 15's acceptance loop).

    python benchmarks/transfer.py [--settings avx2,generic,...] [--quick] [--plan-aware] [--out DIR]

Each setting gets DIR/<setting>/ with its calibration ledger (and its -overheads ledger), the
calibrated profile and the validation ledger; all are appended to and resumed, so a run that is
stopped goes on where it stopped. The table printed (and written to DIR/transfer.md) has one row
per setting: calibrate and validate wall time, held-out kernel MAPE by kind, and the validation's
step-time MAPE and max, peak-memory mean and max, over the plans, and the step-time MAPE over
the plans measured while the machine ran at the profile's speed (half their timed steps or more,
by validate's speed probes), and over all the plans with each prediction moved to the speed its
steps' probes measured (validate.timing.error_at_measured_speed). --quick runs the smoke-test
sizes (calibrate --quick without the tp_overhead suite, a smaller validation model, two plans, one
timed step): a minute or two per setting, for CI (tests/test_transfer_quick.py), which checks that
the loop runs from scratch on another "machine", not how accurate it is. --plan-aware calibrates for
the validation model and its plans instead (`perfsim calibrate --model M --plans P1;P2;...`, the
issue's second case): each setting's row is then named <setting>-plan and its files go to
DIR/<setting>-plan/. --minutes (default 15, the issue's target) gives validate what calibrate left of
them as its --budget: past its share a plan stops retaking steps off the profile's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# The machines. Each changes kernel speeds on the same CPU by the margin (docs/calibration.md,
# "Transfer"): ATEN_CPU_CAPABILITY=default takes the vectorised element-wise kernels away (GeLU,
# softmax, LayerNorm 2-14x slower on the project's AVX2 VM); one rank with two threads halves a
# GEMM's time and leaves no collective to wait for; MKL's conditional numerical reproducibility
# mode COMPATIBLE runs its SSE2 code path, fp32 GEMMs 3.1x slower (26 against 81 GFLOP/s for
# 1024^3 on one core; MKL_ENABLE_INSTRUCTIONS=SSE4_2 and ONEDNN_MAX_CPU_ISA=SSE41 leave them at
# 78 there), element-wise kernels unchanged.
SETTINGS = {
    "avx2": {"env": {}, "nproc": 2, "threads": 1},
    "generic": {"env": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, "nproc": 2, "threads": 1},
    "threads2": {"env": {}, "nproc": 1, "threads": 2},
    "mkl-compat": {"env": {"MKL_CBWR": "COMPATIBLE"}, "nproc": 2, "threads": 1},
}
VALIDATION_MODEL = "layers=4,hidden=512,heads=8,seq=256,vocab=8192,tied_embeddings=false,dropout=false"
# --quick (the CI test): the loop's plumbing in a minute or two, not its accuracy. A smaller model,
# still of another shape than the calibration's (hidden 1024 GEMMs; the overhead runs' hidden 256),
# and no tp_overhead suite (its DTensor layers take a minute even at smoke-test sizes).
QUICK_MODEL = "layers=2,hidden=384,heads=6,seq=192,vocab=4096,tied_embeddings=false,dropout=false"
QUICK_SUITES = "gemm,memory,attention,collective,overheads"
QUICK_PLANS = {2: "dp=2,mbs=2,gbs=4;tp=2,mbs=2,gbs=4", 1: "mbs=2,gbs=4;mbs=2,gbs=4,recompute=full"}


def perfsim(args: list, env: dict, log) -> tuple:
    """(exit code, stdout, seconds) of one perfsim command, its stderr streamed to `log`."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "perfsim.cli", *args], env={**os.environ, **env},
                          stdout=subprocess.PIPE, stderr=log, text=True)
    return proc.returncode, proc.stdout, time.perf_counter() - start


def held_out(report: str) -> dict:
    """Held-out MAPE by kind from calibrate's report rows (or a profile's header): GEMMs and the
    flash-attention kernels from their tables where one was kept (else the curve's row),
    element-wise kernels and collectives from their tables, and the framework overheads."""
    from perfsim.cost.measured import FLASH_KERNELS
    from perfsim.spec.system import OPERATIONS

    out: dict = {}
    for line in report.splitlines():
        text = line.lstrip("# ").strip()
        if "held-out" not in text:
            continue
        value = text.split("held-out")[1].split()[0].rstrip("%")  # "12.3%", or "-" where none was held out
        if value == "-":
            continue
        words = text.split()
        if text.startswith("table "):
            kind = ("gemm" if words[1] == "gemm" else "attention" if words[1] in FLASH_KERNELS
                    else "collectives" if words[1] in OPERATIONS else "elementwise")
        elif text.startswith("gemm fp32"):
            kind = "gemm curve"
        elif text.startswith("flash attention"):
            kind = "attention curve " + words[2]
        elif text.startswith("framework overheads"):
            kind = "overheads"
        else:
            continue
        out.setdefault(kind, []).append(float(value))
    if "gemm" not in out and "gemm curve" in out:
        out["gemm"] = out["gemm curve"]
    out.pop("gemm curve", None)
    stripped = [line.lstrip("# ").strip() for line in report.splitlines()]
    tabled = {text.split()[1] for text in stripped if text.startswith("table flash")}
    for kernel in FLASH_KERNELS:  # a kernel without a table is priced by its curve
        curve = out.pop(f"attention curve {kernel}", None)
        if curve and kernel not in tabled:
            out.setdefault("attention", []).extend(curve)
    return {k: sum(v) / len(v) for k, v in out.items()}


def validation_plans(nproc: int, model_spec: str) -> str:
    """The plans `perfsim validate` runs by default on `nproc` ranks for `model_spec`, as --plans text
    (each plan's fields that differ from a default Plan's)."""
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan
    from validate.timing import default_plans

    default = Plan().as_dict()
    text = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
    return ";".join(",".join(f"{k}={text(v)}" for k, v in plan.as_dict().items() if v != default[k])
                    for plan in default_plans(nproc, load_model(model_spec)))


def run_setting(name: str, setting: dict, out: str, quick: bool, log, plan_aware: bool = False,
                minutes: float = 0.0) -> dict:
    model = QUICK_MODEL if quick else VALIDATION_MODEL
    if plan_aware:
        name += "-plan"
    where = os.path.join(out, name)
    os.makedirs(where, exist_ok=True)
    env = {**setting["env"], "OMP_NUM_THREADS": str(setting["threads"])}
    nproc, threads = setting["nproc"], setting["threads"]
    profile = os.path.join(where, f"cpu-{name}.toml")
    calibrate = ["calibrate", "--device", "cpu", "--nproc", str(nproc), "--threads", str(threads), "--dtypes", "fp32",
                 "--system", "cpu-example", "--ledger", os.path.join(where, "calibration.jsonl"), "--out", profile,
                 "--name", f"cpu-{name}"] + (["--quick", "--suites", QUICK_SUITES] if quick else [])
    if plan_aware:
        plans = QUICK_PLANS[nproc] if quick else validation_plans(nproc, model)
        calibrate += ["--model", model, "--plans", plans]
    code, report, cal_s = perfsim(calibrate, env, log)
    if code:
        return {"setting": name, "error": f"calibrate exited {code}"}
    validate = ["validate", "--device", "cpu", "--nproc", str(nproc), "--threads", str(threads), "--dtype", "fp32",
                "--system", profile, "--model", model,
                "--ledger", os.path.join(where, "validation.jsonl"),
                "--json"] + (["--plans", QUICK_PLANS[nproc], "--steps", "1"] if quick else [])
    if minutes:  # validate gets what calibrate left of the setting's minutes (at least one)
        validate += ["--budget", f"{max(1.0, minutes - cal_s / 60):.2f}"]
    code, text, val_s = perfsim(validate, env, log)
    if code:
        return {"setting": name, "error": f"validate exited {code}"}
    results = json.loads(text)
    step = [r["step_time_s"]["predicted"] / r["step_time_s"]["measured"] - 1 for r in results]
    # the plans measured while the machine ran at the profile's speed (at least half their timed
    # steps, by the speed probes): what the model is accountable for on a machine that drifts
    steady = [e for e, r in zip(step, results)
              if 2 * r["machine_speed"]["steps_at_speed"] >= r["machine_speed"]["steps"]]
    # every plan's error with its prediction moved to the speed its steps' probes measured
    scaled = [abs(e) for r in results if (e := r.get("step_time_error_at_measured_speed")) is not None]
    memory = [r["peak_memory_bytes"]["predicted"] / r["peak_memory_bytes"]["measured"] - 1 for r in results]
    return {"setting": name, "env": env, "nproc": nproc, "plans": len(results), "calibrate_s": cal_s,
            "validate_s": val_s, "held_out": held_out(report),
            "step_mape": sum(map(abs, step)) / len(step), "step_max": max(map(abs, step)),
            "step_mean_signed": sum(step) / len(step),
            "plans_at_speed": len(steady), "step_mape_at_speed": sum(map(abs, steady)) / len(steady) if steady else None,
            "step_mape_at_measured_speed": sum(scaled) / len(scaled) if scaled else None,
            "memory_mean": sum(map(abs, memory)) / len(memory), "memory_max": max(map(abs, memory)),
            "at_speed": sum(r["machine_speed"]["steps_at_speed"] for r in results),
            "steps": sum(r["machine_speed"]["steps"] for r in results)}


def table(rows: list) -> str:
    head = ("| setting | environment | ranks x threads | calibrate + validate | held-out GEMM | held-out element-wise | "
            "held-out attention | held-out collectives | overheads held-out | plans | step MAPE | step max | step signed | "
            "plans at speed | their step MAPE | step MAPE at measured speed | memory mean | memory max |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setting']} | {r['error']} |")
            continue
        env = " ".join(f"{k}={v}" for k, v in r["env"].items() if k != "OMP_NUM_THREADS") or "(none)"
        h = r["held_out"]
        lines.append(f"| {r['setting']} | {env} | {r['nproc']} x {r['env']['OMP_NUM_THREADS']} | "
                     f"{(r['calibrate_s'] + r['validate_s']) / 60:.1f} min | "
                     + " | ".join(pct(h[k] / 100) if k in h else "-"
                                  for k in ("gemm", "elementwise", "attention", "collectives", "overheads"))
                     + f" | {r['plans']} | "
                     f"{pct(r['step_mape'])} | {pct(r['step_max'])} | {pct(r['step_mean_signed'])} | "
                     f"{r.get('plans_at_speed', '-')} | {pct(r.get('step_mape_at_speed'))} | "
                     f"{pct(r.get('step_mape_at_measured_speed'))} | "
                     f"{pct(r['memory_mean'])} | {pct(r['memory_max'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes")
    parser.add_argument("--plan-aware", action="store_true",
                        help="calibrate for the validation model and plans (calibrate --model --plans)")
    parser.add_argument("--out", default="transfer-runs", help="folder of the ledgers, profiles and table")
    parser.add_argument("--minutes", type=float, default=15.0,
                        help="minutes a setting may take, calibrate and validate (issue 15's target): validate gets "
                             "what calibrate left as its --budget (default 15; 0: no budget)")
    args = parser.parse_args(argv)
    names = [s for s in args.settings.split(",") if s]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting {unknown[0]!r}; one of {', '.join(SETTINGS)}")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with open(os.path.join(args.out, "transfer.log"), "a") as log:
        for name in names:
            print(f"[{len(rows) + 1}/{len(names)}] {name} ...", file=sys.stderr, flush=True)
            rows.append(run_setting(name, SETTINGS[name], args.out, args.quick, log, args.plan_aware, args.minutes))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    with open(os.path.join(args.out, "transfer.md"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(args.out, "transfer.json"), "w") as fh:
        json.dump(rows, fh, indent=2)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
