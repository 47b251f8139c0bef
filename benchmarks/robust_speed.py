"""How fast the uncertainty commands run (issue 16 item 7), each as the command a user types:

    python benchmarks/robust_speed.py [--runs 3] [--only space,smng,predict]

- space: `perfsim search --robust` over the whole space of GPT-3 175B on 1024 SMNG-P2 tiles, global
  batch 1536, under 1000 posterior draws (target: under 30 s);
- smng: `perfsim search --robust` on the SMNG-P2 175B case, 16 nodes, global batch 300, default
  draws (target: under 30 s);
- predict: `perfsim predict --uncertainty --json` (the default case) warm (the Sobol design and the
  posterior cached on disk; target: under 1 s) and cold (an empty cache: scipy.stats imported, the
  observations conditioned), beside plain `perfsim predict --json`.

Each row prints the median wall time over --runs and its ratio to plain `perfsim predict --json`
timed in the same run: this VM's speed drifts by 2x within minutes, so compare ratios across runs.
The posterior cache is warmed (untimed) before the warm rows; it lives in a temporary folder.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CASES = {
    "space": ["search", "--model", "gpt3-175b", "--system", "smng-p2", "--devices", "1024", "--gbs", "1536",
              "--robust", "--samples", "1000", "--quiet", "--json"],
    "smng": ["search", "--model", "gpt3-175b", "--system", "smng-p2", "--nodes", "16", "--gbs", "300",
             "--robust", "--quiet", "--json"],
}
PREDICT = ["predict", "--uncertainty", "--json"]
PLAIN = ["predict", "--json"]


def timed(argv, cache: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "perfsim.cli", *argv], check=True, stdout=subprocess.DEVNULL,
                   env=os.environ | {"PERFSIM_CACHE_DIR": cache})
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default="space,smng,predict", help="comma-separated: space, smng, predict")
    args = parser.parse_args()
    chosen = args.only.split(",")
    with tempfile.TemporaryDirectory() as folder:
        warm = os.path.join(folder, "warm")
        rows = []
        for name in [c for c in ("space", "smng") if c in chosen]:
            timed(CASES[name], warm)  # conditioning for this draw count, once
            rows.append((f"search --robust ({name})", [timed(CASES[name], warm) for _ in range(args.runs)]))
        if "predict" in chosen:
            timed(PREDICT, warm)
            rows.append(("predict --uncertainty, warm", [timed(PREDICT, warm) for _ in range(args.runs)]))
            rows.append(("predict --uncertainty, cold", [timed(PREDICT, os.path.join(folder, f"cold{i}"))
                                                         for i in range(args.runs)]))
        plain = statistics.median(timed(PLAIN, warm) for _ in range(args.runs))
    print(f"{'command':<32} {'median':>8} {'x plain predict':>16}  runs")
    print(f"{'predict --json (plain)':<32} {plain:>7.2f}s {1.0:>16.2f}")
    for name, walls in rows:
        median = statistics.median(walls)
        print(f"{name:<32} {median:>7.2f}s {median / plain:>16.2f}  " + " ".join(f"{w:.2f}" for w in walls))


if __name__ == "__main__":
    main()
