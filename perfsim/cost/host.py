"""The host's own time in a step and how much of it shows (docs/equations.md 8.1-8.3).

Beyond its kernels and collectives a step spends host time: per layer and micro-batch (autograd and
module dispatch, and a DTensor layer's redistributions), per micro-batch (the loop, the loss) and
per step (the optimizer's Python, zero_grad). Where the host runs the kernels itself (a CPU rank)
that time adds to the kernels'. Where it queues kernels for a device that runs them on its own (a
GPU: framework.host_overlap = 1), the two run side by side and a stretch of work takes the longer
of the host's time and the device's: the host's shows only where it exceeds the device's. The
harness waits for the device after every micro-batch (it reads the loss), so the comparison is
per micro-batch of a stage, and for the step's own host time against the optimizer's kernels.
"""

from __future__ import annotations

import numpy as np


def layer_host_overhead(system, c):
    """Host seconds one layer's forward and backward of a micro-batch pay beyond their kernels and
    collectives: the profile's layer_overhead_s (any plan: autograd and module dispatch, docs/
    equations.md 8.2), plus what a tensor-parallel implementation adds, tp_layer_overhead_s
    (sp_layer_overhead_s with SP) in 1d with t > 1 (Megatron-LM's layers and the 2d/2.5d/3d ones
    add none, 8.1)."""
    fw = system.framework
    per_layer = np.where(c.sp, fw.sp_layer_overhead_s, fw.tp_layer_overhead_s)
    return np.where((c.tp_mode == "1d") & (c.tp > 1), per_layer, 0.0) + fw.layer_overhead_s


def shown_share(host, device, overlap):
    """The share of `host` seconds that shows beside `device` seconds of kernels and communication:
    all of it without host_overlap; with it, only what exceeds the device's time."""
    host = np.asarray(host, float)
    shown = np.where(bool(overlap), np.maximum(host - device, 0.0), host)
    return np.divide(shown, host, out=np.ones_like(shown * host), where=host > 0)


def shown_step_overhead(system, optimizer):
    """framework.step_overhead_s as it shows after a step's optimizer kernels of `optimizer`
    seconds: beside them with host_overlap (the host's step work is the optimizer's issue), after
    them without."""
    fw = system.framework
    return fw.step_overhead_s * shown_share(fw.step_overhead_s, optimizer, fw.host_overlap)
