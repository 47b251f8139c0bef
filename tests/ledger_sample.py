"""A small measurement ledger for the chart tests and benchmarks (no pytest needed)."""

from __future__ import annotations

import json

import numpy as np


def synthetic_ledger(path, system, error=0.05, seed=3):
    """A ledger as validate/ writes it, with times perfsim's own cost functions give for `system`
    times a known error, so the chart's numbers can be checked."""
    from perfsim.cost.layer import Gemm, MemoryOp, gemm_time, memory_time
    from perfsim.cost.topology import TopologyCommModel

    rng = np.random.default_rng(seed)
    rows, truth = [], []
    for n, (m, k) in enumerate([(256, 256), (1024, 512), (2048, 2048), (4096, 1024)]):
        t = float(gemm_time(system.device, system.device.peak_flops_bf16, Gemm("g", 1, m, m, k)))
        rows.append({"suite": "gemm", "op": "matmul", "dtype": "bf16", "shape": {"count": 1, "m": m, "n": m, "k": k}})
        truth.append(t)
    for e in (16, 20, 24):
        nbytes = 3 * 4 * (1 << e)
        rows.append({"suite": "memory", "op": "add", "dtype": "fp32", "shape": {"rows": 1 << (e - 10), "cols": 1024},
                     "nbytes": nbytes})
        truth.append(float(memory_time(system.device, MemoryOp("add", nbytes))))
    comm = TopologyCommModel(system)
    for e in (20, 24):
        rows.append({"suite": "collective", "op": "all_reduce", "dtype": "bf16", "shape": {"nbytes": 1 << e},
                     "group": [4, 1], "nbytes": 1 << e})
        truth.append(float(comm.all_reduce(float(1 << e), 4, 1)))
    rows.append({"suite": "attention", "op": "sdpa", "dtype": "bf16",
                 "shape": {"batch": 1, "heads": 8, "seq": 512, "head_dim": 64}})
    truth.append(None)
    with open(path, "w") as fh:
        for i, (row, t) in enumerate(zip(rows, truth)):
            measured = (t if t is not None else 1e-3) * (1 + error * (1 if i % 2 else -1)) * float(rng.uniform(0.99, 1.01))
            fh.write(json.dumps({"schema": 1, "key": f"k{i}", **row, "stats": {"median_s": measured}}) + "\n")
        fh.write('{"schema": 1, "key": "broken", "suite": "gemm"\n')  # a line cut short by a kill
    return [t for t in truth if t is not None]
