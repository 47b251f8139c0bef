"""How long the event simulation of one step takes (issue 7's targets).

    python benchmarks/simulate_speed.py [--runs 5] [--no-files]

Cases:
- 175B on 128 SMNG-P2 tiles: TP 8, PP 16, 100 micro-batches (the SMNG-P2 authors' plan, the built-in
  case of `perfsim predict`); target under 1 s.
- 1T (gpt-1t) on 3072 DGX A100 GPUs, SC21's plan: TP 8, PP 64, DP 6, batch 3072, interleaved with 2
  chunks per stage, micro-batch 1, full recomputation (the plan perfsim.reproduce picks for SC21's
  Table 1 row: 512 micro-batches per pipeline); target under 5 s.

Times `perfsim.schedule.simulator.simulate` in-process (cost evaluation, building the task graph,
running it, summarising: everything `perfsim simulate` does after its imports): median and range of
wall time over the runs, and the median CPU time of the process (what to compare on a shared, loaded
machine), with the number of tasks. Unless --no-files, it also writes the Chrome trace and the HTML
chart once per case and reports their sizes and how long writing them took.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from perfsim.schedule.simulator import simulate  # noqa: E402
from perfsim.spec.plan import Plan  # noqa: E402

CASES = (
    ("175B, 128 tiles smng-p2, TP8 PP16, 100 micro-batches", "gpt3-175b", "smng-p2",
     Plan(tp=8, pp=16, dp=1, zero=1, mbs=3, gbs=300, recompute="full"), 1.0),
    ("1T, 3072 GPUs dgx-a100, TP8 PP64 DP6, interleaved v=2 (SC21)", "gpt-1t", "dgx-a100",
     Plan(tp=8, pp=64, dp=6, vpp=2, schedule="interleaved", mbs=1, gbs=3072, recompute="full"), 5.0),
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-files", action="store_true", help="skip writing the trace and the chart")
    args = parser.parse_args()
    for name, model, system, plan, target in CASES:
        simulate(model, system, plan)  # warm the routing caches and imports once
        times, cpu = [], []
        for _ in range(args.runs):
            start, start_cpu = time.perf_counter(), time.process_time()
            sim = simulate(model, system, plan)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        r = sim.result
        verdict = "meets" if statistics.median(times) < target else "MISSES"
        print(f"{name}\n  {r.tasks:,} tasks, step {r.step_time_s:.3f} s simulated "
              f"(closed form {sim.analytic.step_time_s:.3f} s)\n"
              f"  simulate(): median {statistics.median(times):.3f} s wall, range {min(times):.3f}-{max(times):.3f} s, "
              f"median {statistics.median(cpu):.3f} s CPU, over {args.runs} runs; {verdict} the {target:g} s target")
        if args.no_files:
            continue
        from perfsim.schedule.timeline import write_html, write_trace

        with tempfile.TemporaryDirectory() as tmp:
            for kind, write in (("trace", write_trace), ("html", write_html)):
                path = os.path.join(tmp, f"step.{'json' if kind == 'trace' else 'html'}")
                start = time.perf_counter()
                note = write(r, path)
                took = time.perf_counter() - start
                size = os.path.getsize(path) / 1e6
                print(f"  {kind}: {size:.1f} MB in {took:.2f} s" + (f" ({note})" if note else ""))


if __name__ == "__main__":
    main()
