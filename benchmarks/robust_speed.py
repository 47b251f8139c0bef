"""How fast the uncertainty commands run (issue 16 item 7), each as the command a user types:

    python benchmarks/robust_speed.py [--runs 3] [--only space,smng,predict]

- space: `perfsim search --robust` over the whole space of GPT-3 175B on 1024 SMNG-P2 tiles, global
  batch 1536, under 1000 posterior draws (target: under 30 s);
- smng: `perfsim search --robust` on the SMNG-P2 175B case, 16 nodes, global batch 300, default
  draws (target: under 30 s);
- predict: `perfsim predict --uncertainty --json` (the default case) warm (the Sobol design and the
  posterior cached on disk; target: under 1 s) and cold (an empty cache: scipy.stats imported, the
  observations conditioned), beside plain `perfsim predict --json`.

Each row prints the median wall time over --runs, the median of a plain `perfsim predict --json`
timed right after each run, and their ratio: this VM's speed drifts by 2x within minutes, so
compare ratios across runs. The posterior cache is warmed (untimed) before each row; it lives in a
temporary folder.
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
        cases = [(f"search --robust ({name})", CASES[name], lambda i: warm) for name in ("space", "smng") if name in chosen]
        if "predict" in chosen:
            cases += [("predict --uncertainty, warm", PREDICT, lambda i: warm),
                      ("predict --uncertainty, cold", PREDICT, lambda i: os.path.join(folder, f"cold{i}"))]
        print(f"{'command':<32} {'median':>8} {'plain':>7} {'ratio':>7}  runs (each beside a plain predict --json)")
        for name, argv, cache in cases:
            timed(argv, warm)  # the posterior for this draw count, conditioned once
            walls, plains = [], []
            for i in range(args.runs):
                walls.append(timed(argv, cache(i)))
                plains.append(timed(PLAIN, warm))
            median, plain = statistics.median(walls), statistics.median(plains)
            print(f"{name:<32} {median:>7.2f}s {plain:>6.2f}s {median / plain:>7.2f}  "
                  + " ".join(f"{w:.2f}" for w in walls), flush=True)


if __name__ == "__main__":
    main()
