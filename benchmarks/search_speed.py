"""How fast `perfsim search` evaluates plans: the issue's case, GPT-3 175B on 1024 SMNG-P2 tiles,
global batch 1536, the full space.

    python benchmarks/search_speed.py [--model gpt3-175b] [--system smng-p2] [--devices 1024] [--gbs 1536] [--runs 3]

Prints candidates, valid plans evaluated, plans that fit, wall time and rates per run (median),
on one core (numpy's own threads aside: set OMP_NUM_THREADS=1 to be strict). Targets (issue 6):
at least 1,000,000 plans per second and under 20 s. Calculon's ~50 plans per second per core is
its 12 million candidates over 65 core-hours, so the comparable perfsim rate is candidates per
second (every candidate classified, each valid one costed: its peak memory, and its step time
where it fits, as the search ranks only plans that fit); the rate of valid plans is printed too.
"""

import argparse
import statistics
import time

import perfsim
from perfsim.search import search


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3-175b")
    parser.add_argument("--system", default="smng-p2")
    parser.add_argument("--devices", type=int, default=1024)
    parser.add_argument("--gbs", type=int, default=1536)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    model, system = perfsim.load_model(args.model), perfsim.load_system(args.system)
    walls, rates, candidate_rates = [], [], []
    for _ in range(args.runs):
        start = time.perf_counter()
        result = search(model, system, args.devices, args.gbs)
        wall = time.perf_counter() - start
        walls.append(wall)
        rates.append(result.evaluated / result.seconds)
        candidate_rates.append(result.candidates / result.seconds)
        print(f"{result.candidates:,} candidates, {result.evaluated:,} valid plans evaluated, {result.feasible:,} fit; "
              f"{wall:.2f} s wall, {result.evaluated / result.seconds:,.0f} evaluated plans/s, "
              f"{result.candidates / result.seconds:,.0f} candidates/s")
    rate, wall = statistics.median(rates), statistics.median(walls)
    candidates = statistics.median(candidate_rates)
    # Calculon's ~50 plans/s is 12 million candidates over 65 core-hours: a rate over candidates.
    print(f"median: {wall:.2f} s ({'meets' if wall < 20 else 'MISSES'} 20 s); "
          f"{candidates:,.0f} candidates/s, the unit of Calculon's ~50/s ({candidates / 50:,.0f}x; "
          f"{'meets' if candidates >= 1e6 else 'MISSES'} 1,000,000/s); "
          f"{rate:,.0f} valid plans/s through the cost model (memory; step time where they fit)")

if __name__ == "__main__":
    main()
