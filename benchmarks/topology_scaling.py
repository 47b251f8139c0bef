"""How the topology model's cost grows with the machine: group shapes of a plan on 1 vs 1024 nodes.

    python benchmarks/topology_scaling.py [--system smng-p2] [--repeats 50]

For each machine size it times a fresh TopologyCommModel (cold caches: every shape routed and its
flows counted) answering the collectives a plan asks for (tensor, data and pipeline dimensions),
then the same calls again (warm: numbers from the per-shape cache), and times a whole
perfsim.predict of GPT-3 175B on both machines. Also prints the one-off import
cost of perfsim.cost.topology and whether networkx got imported. Target (issue 3): 1024 nodes cost
no more than twice one node.
"""

import argparse
import statistics
import subprocess
import sys
import time

import perfsim
from perfsim.cost.topology import TopologyCommModel, clear_caches
from perfsim.spec.system import load_system

# (tp, pp, dp) per machine size, 8 devices per node: TP inside the node, then DP, then PP.
PLANS = {1: (8, 1, 1), 1024: (8, 16, 64)}


def plan_calls(model, tp, pp, dp):
    strides = {"tp": 1, "dp": tp, "pp": tp * dp}
    for n in (1e6, 1e8):
        model.all_reduce(n, tp, strides["tp"])
        model.all_gather(n, tp, strides["tp"])
        model.reduce_scatter(n, dp, strides["dp"])
        model.all_gather(n, dp, strides["dp"])
        model.all_reduce(n, dp, strides["dp"])
        model.send(n, pp, strides["pp"])
        model.all_reduce(n, 2, strides["pp"] * max(pp - 1, 1))  # tied embeddings, first and last stage


def timed(system, plan, repeats):
    cold, warm = [], []
    for _ in range(repeats):
        clear_caches()
        start = time.perf_counter()
        model = TopologyCommModel(system)
        plan_calls(model, *plan)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        plan_calls(model, *plan)
        warm.append(time.perf_counter() - start)
    return statistics.median(cold), statistics.median(warm)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", default="smng-p2")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    system = load_system(args.system)
    code = ("import time, sys; t = time.perf_counter(); import perfsim.spec.system; t1 = time.perf_counter();"
            "import perfsim.cost.topology as T; t2 = time.perf_counter();"
            "m = T.TopologyCommModel(perfsim.spec.system.load_system(sys.argv[1])); m.all_reduce(1e8, 8, 1); t3 = time.perf_counter();"
            "print(f'import perfsim.cost.topology (after perfsim.spec.system) {1e3 * (t2 - t1):.1f} ms,"
            " first all_reduce incl. profile load {1e3 * (t3 - t2):.1f} ms, networkx imported: {\"networkx\" in sys.modules}')")
    print(subprocess.run([sys.executable, "-c", code, args.system], check=True, capture_output=True, text=True).stdout.strip())
    results = {}
    for nodes, plan in PLANS.items():
        cold, warm = timed(system, plan, args.repeats)
        results[nodes] = cold
        print(f"{nodes:5d} nodes, tp/pp/dp = {plan}: cold {cold * 1e3:7.2f} ms, warm {warm * 1e3:7.3f} ms")
    ratio = results[1024] / results[1]
    print(f"ratio 1024 nodes / 1 node (cold) = {ratio:.2f}: {'meets' if ratio <= 2 else 'MISSES'} the 2x target")

    # The whole prediction (perfsim.predict of GPT-3 175B), cold topology caches each time.
    whole = {}
    for nodes, (tp, pp, dp) in PLANS.items():
        plan = perfsim.Plan(tp=tp, pp=pp, dp=dp, mbs=1, gbs=64 * dp, zero=1, recompute="full")
        times = []
        for _ in range(args.repeats):
            clear_caches()
            start = time.perf_counter()
            perfsim.predict("gpt3-175b", system, plan)
            times.append(time.perf_counter() - start)
        whole[nodes] = statistics.median(times)
        print(f"{nodes:5d} nodes: perfsim.predict {whole[nodes] * 1e3:7.2f} ms (cold topology caches)")
    ratio = whole[1024] / whole[1]
    print(f"ratio 1024 nodes / 1 node, whole prediction = {ratio:.2f}: {'meets' if ratio <= 2 else 'MISSES'} the 2x target")


if __name__ == "__main__":
    main()
