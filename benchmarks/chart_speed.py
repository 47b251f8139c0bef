"""How long each chart takes to build, and how big its page is: `perfsim chart KIND` on the
built-in case (GPT-3 175B on 16 SMNG-P2 nodes, global batch 300, the SMNG-P2 authors' plan), and
`perfsim report` on the same case.

    python benchmarks/chart_speed.py [--runs 3] [--kinds whatif,heatmap,...] [--ledger FILE.jsonl] [--uncertainty]

Each kind runs in a fresh process (imports, profile loading and the topology caches count, as
they do for a user), through the command line, writing its page to a temporary folder. Prints
per kind the median wall time, the CPU time of that run (wall time above CPU time means other
processes had the machine), and the page size. Targets (issue 8): under 5 s per chart, pages
under 10 MB. The validation chart needs a ledger: without --ledger, a small synthetic one
(times from the smng-p2 profile, +-5%) is written first. The report shows the uncertainty by
default; --uncertainty gives it to every chart too (bands, error bars, the what-if's P(best)). The
draws are conditioned on smng-p2's observations once and cached ($PERFSIM_CACHE_DIR): one run
outside the timing warms that cache, as a user's second chart finds it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

KINDS = ("whatif", "heatmap", "scaling", "memory", "breakdown", "timeline", "validation", "report")

RUNNER = """
import resource, sys, time
start = time.perf_counter()
from perfsim import cli
code = cli.main(sys.argv[1:])
wall = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
print("BENCH", code, wall, usage.ru_utime + usage.ru_stime, file=sys.stderr)
"""


def synthetic_ledger(path: str) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from ledger_sample import synthetic_ledger as write

    from perfsim.spec.system import load_system

    write(path, load_system("smng-p2"))


def run(kind: str, folder: str, ledger: str, extra: tuple = ()) -> tuple:
    out = os.path.join(folder, f"{kind}.html")
    if kind == "report":
        argv = ["report", "--ledger", ledger, "--out", out]
    elif kind == "validation":
        argv = ["chart", "validation", "--system", "smng-p2", "--ledger", ledger, "--out", out]
    else:
        argv = ["chart", kind, "--out", out, *extra]
    proc = subprocess.run([sys.executable, "-c", RUNNER, *argv], capture_output=True, text=True)
    line = next((l for l in proc.stderr.splitlines() if l.startswith("BENCH")), None)
    if proc.returncode or line is None or line.split()[1] != "0":
        raise SystemExit(f"{kind} failed:\n{proc.stderr}")
    _, _, wall, cpu = line.split()
    return float(wall), float(cpu), os.path.getsize(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--ledger", help="ledger for the validation chart (default: a synthetic one)")
    parser.add_argument("--uncertainty", action="store_true", help="charts with --uncertainty (the report has it anyway)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        ledger = args.ledger or os.path.join(folder, "ledger.jsonl")
        if not args.ledger:
            synthetic_ledger(ledger)
        extra = ("--uncertainty",) if args.uncertainty else ()
        if args.uncertainty or "report" in kinds:
            run("report", folder, ledger)  # warms the posterior cache
        for kind in kinds:
            runs = [run(kind, folder, ledger, extra if kind not in ("report", "validation") else ()) for _ in range(args.runs)]
            walls = [r[0] for r in runs]
            median = statistics.median(walls)
            cpu = runs[walls.index(median)][1] if median in walls else statistics.median(r[1] for r in runs)
            rows[kind] = {"wall_s": median, "cpu_s": cpu, "page_bytes": runs[-1][2], "runs": len(runs)}
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'kind':<11} {'wall (median)':>14} {'cpu':>7} {'page':>9}   targets: < 5 s per chart, < 10 MB")
    for kind, r in rows.items():
        print(f"{kind:<11} {r['wall_s']:>12.2f} s {r['cpu_s']:>5.2f} s {r['page_bytes'] / 1e6:>6.2f} MB")
    print(f"{args.runs} runs each, fresh process per run; load average now {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
