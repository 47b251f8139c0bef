"""Do a GEMM's two backward products take 2 x its forward? perfsim prices each at its own shape
(perfsim.cost.layer.backward_gemms, docs/equations.md 3.8); this times them on this machine:

    python benchmarks/backward_gemms.py [--model SPEC] [--plan tp=2,mbs=2] [--rounds 15] [--dtype fp32]

For every distinct GEMM of one layer and of the logits head on one device, as perfsim issues them
(validate.microbench.plan_gemms), each round times the forward as the calibration's microbenchmark
does (A[m, k] @ B[k, n]), as a training step runs it (F.linear, x @ W^T), and the two backward
products torch's linear runs (dX = dY @ W, dW = dY^T @ X), one right after the other. The table has
the medians of each round's ratios to the microbenchmark's forward: the machine's drift weighs on
all four alike. One thread (torch.set_num_threads(1)), as the CPU ranks of perfsim validate.
"""

from __future__ import annotations

import argparse
import statistics
import time


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    import torch
    import torch.nn.functional as F

    from perfsim.spec.model import load_model
    from validate.microbench import plan_gemms
    from validate.timing import DEFAULT_MODEL, parse_plans

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--plan", default="tp=1,mbs=2,gbs=2")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    plan = parse_plans(args.plan)[0]
    print("| GEMM | m x n x k | forward (ms) | F.linear / forward | dX / forward | dW / forward | backward / (2 x forward) |")
    print("|---|---|---|---|---|---|---|")
    for name, count, m, n, k in plan_gemms(load_model(args.model), plan):
        if count != 1:
            continue  # the attention core's batched products: not a linear layer's
        x, w, dy = (torch.randn(*shape, dtype=dtype) for shape in ((m, k), (n, k), (m, n)))
        wt, out = w.t().contiguous(), torch.empty(m, n, dtype=dtype)
        kernels = {"forward": lambda: torch.matmul(x, wt, out=out), "linear": lambda: F.linear(x, w),
                   "dx": lambda: dy @ w, "dw": lambda: dy.t() @ x}
        for fn in kernels.values():
            fn()
        rounds = [{key: _seconds(fn) for key, fn in kernels.items()} for _ in range(args.rounds)]

        def ratio(key):
            return statistics.median(r[key] / r["forward"] for r in rounds)
        backward = statistics.median((r["dx"] + r["dw"]) / (2 * r["forward"]) for r in rounds)
        print(f"| {name} | {m} x {n} x {k} | {1e3 * statistics.median(r['forward'] for r in rounds):.2f} | "
              f"{ratio('linear'):.2f} | {ratio('dx'):.2f} | {ratio('dw'):.2f} | {backward:.2f} |")


if __name__ == "__main__":
    main()
