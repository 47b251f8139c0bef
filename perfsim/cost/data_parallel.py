"""Data-parallel gradient traffic by ZeRO stage, and the optimizer step (docs/equations.md, section 6).

Per step, for N parameters on a device and a data-parallel group of d:
- ZeRO-0 (DDP): all-reduce of the gradients (grad_bytes x N);
- ZeRO-1 and 2: reduce-scatter of the gradients, then all-gather of the updated bf16 weights;
- ZeRO-3: every micro-batch all-gathers the bf16 weights for forward, again for backward (and
  again for a fully recomputed forward), and reduce-scatters its gradients. The gathers are
  prefetched, so only what exceeds the micro-batch's compute is exposed.
ZeRO 0-2 reduce once after the last micro-batch; the framework's dp_overlap says what share of that
hides behind the last micro-batch's backward pass.
"""

from __future__ import annotations

import numpy as np

from perfsim.cost.columns import FULL, Columns
from perfsim.cost.layer import BF16
from perfsim.cost.memory import OPTIMIZER_BYTES_PER_PARAM
from perfsim.spec.system import System


def step_reduction_time(system: System, comm, c: Columns, params):
    """ZeRO 0-2: gradient reduction (and weight gathering) once per step, not yet overlapped."""
    grads = system.framework.grad_bytes_per_param * params
    stride = c.strides["dp"]
    zero0 = comm.all_reduce(grads, c.dp, stride)
    zero12 = comm.reduce_scatter(grads, c.dp, stride) + comm.all_gather(BF16 * params, c.dp, stride)
    return np.where(c.zero == 0, zero0, np.where(c.zero <= 2, zero12, 0.0))


def zero3_microbatch_time(system: System, comm, c: Columns, params):
    """ZeRO-3 traffic of one micro-batch (weights gathered per pass, gradients scattered)."""
    stride = c.strides["dp"]
    gathers = 2 + np.where(c.recompute == FULL, 1, 0)
    gather = comm.all_gather(BF16 * params, c.dp, stride)
    scatter = comm.reduce_scatter(system.framework.grad_bytes_per_param * params, c.dp, stride)
    return np.where(c.zero == 3, gathers * gather + scatter, 0.0)


def optimizer_time(system: System, c: Columns, params):
    """Adam on the device's share of the parameters (sharded from ZeRO-1 on): memory-bound.

    Per parameter it reads the gradient twice (norm for clipping, then the update), reads and
    writes fp32 master, momentum and variance, and writes the bf16 weight."""
    dev = system.device
    updated = params / np.where(c.zero >= 1, c.dp, 1)
    per_param = 2 * system.framework.grad_bytes_per_param + 2 * OPTIMIZER_BYTES_PER_PARAM + BF16
    return updated * per_param / (dev.memory_bandwidth_Bps * dev.memory_efficiency) + 2 * dev.kernel_overhead_s
