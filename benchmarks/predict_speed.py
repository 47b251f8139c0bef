"""How long `perfsim predict --json` takes as a whole process, imports included.

    python benchmarks/predict_speed.py [--runs 21] [-- extra predict flags]

Prints the median and spread of wall time over the runs, and, for scale, the same for a bare
`python -c pass` on this machine in the same run (compare the ratio, not absolute numbers, on a
shared machine). Target: median under 0.15 s. One untimed run first writes Python's bytecode cache
(__pycache__/), as installing perfsim does, even where PYTHONDONTWRITEBYTECODE is set: without a
cache every run compiles each module it imports, which takes longer than the rest of the run.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time


def wall_times(cmd, runs, env=None):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        times.append(time.perf_counter() - start)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("extra", nargs="*", help="flags passed to perfsim predict")
    args = parser.parse_args()
    exe = shutil.which("perfsim")
    cmd = [exe] if exe else [sys.executable, "-m", "perfsim.cli"]
    cmd += ["predict", "--json", *args.extra]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)  # writes the bytecode cache
    baseline = wall_times([sys.executable, "-c", "pass"], args.runs, env)
    predict = wall_times(cmd, args.runs, env)
    for name, times in (("python -c pass", baseline), (" ".join(["perfsim"] + cmd[1:]), predict)):
        q = statistics.quantiles(times, n=4)
        print(f"{name:40} median {statistics.median(times) * 1e3:7.1f} ms  "
              f"quartiles {q[0] * 1e3:6.1f}-{q[2] * 1e3:6.1f} ms  ({args.runs} runs)")
    verdict = "meets" if statistics.median(predict) < 0.15 else "MISSES"
    print(f"{verdict} the 0.15 s target")


if __name__ == "__main__":
    main()
