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

from perfsim.cost.columns import FULL, NONE


# Dispatched ATen ops of one layer's forward and backward in eager PyTorch (validate.gpt's GPT layer,
# one micro-batch on one device), with the unfused or the fused (flash) attention core, without,
# with selective and with full recomputation; counted on torch 2.13's CPU build (tests/
# test_gpu_step_model.py counts them again). layer_overhead_s is measured on the calibration model's
# layer (unfused, no recomputation): the host's time per layer scales with these counts (docs/
# equations.md 8.2). A fused kernel replaces a chain of ops; recomputation replays the forward's ops,
# and checkpointing adds its own, in backward (a Llama-shaped layer dispatches about twice as many
# ops in each variant, in nearly the same ratios: 227, 251, 341 and 190, 197, 286).
HARNESS_LAYER_OPS = {"unfused": (116, 132, 189), "flash": (93, 100, 156)}


def _op_share(c, recompute):
    """HARNESS_LAYER_OPS of each plan's attention under `recompute` (codes, numbers or arrays) over
    the calibration layer's (unfused, no recomputation)."""
    unfused, flash = (np.array(HARNESS_LAYER_OPS[k], float) for k in ("unfused", "flash"))
    index = np.asarray(recompute).astype(int)  # a search's columns hold codes as floats
    return np.where(c.flash, flash[index], unfused[index]) / unfused[0]


def layer_host_overhead(system, c):
    """Host seconds one layer's forward and backward of a micro-batch pay beyond their kernels and
    collectives, recomputation aside: the profile's layer_overhead_s (any plan: autograd and module
    dispatch, docs/equations.md 8.2) scaled by the ops the plan's attention dispatches, plus what a
    tensor-parallel implementation adds, tp_layer_overhead_s (sp_layer_overhead_s with SP) in 1d
    with t > 1 (Megatron-LM's layers and the 2d/2.5d/3d ones add none, 8.1)."""
    fw = system.framework
    per_layer = np.where(c.sp, fw.sp_layer_overhead_s, fw.tp_layer_overhead_s)
    return (np.where((c.tp_mode == "1d") & (c.tp > 1), per_layer, 0.0)
            + fw.layer_overhead_s * _op_share(c, NONE + 0 * c.recompute))


def recompute_host_overhead(system, c, host):
    """Host seconds recomputation adds to one layer's backward: the loop's by the extra ops the
    plan's recomputation dispatches (HARNESS_LAYER_OPS), and with full recomputation a third of
    the tensor-parallel implementation's, whose forward runs again (`host`: layer_host_overhead)."""
    fw = system.framework
    loop = fw.layer_overhead_s * _op_share(c, NONE + 0 * c.recompute)
    extra = fw.layer_overhead_s * (_op_share(c, c.recompute) - _op_share(c, NONE + 0 * c.recompute))
    return extra + np.where(c.recompute == FULL, (host - loop) / 3, 0.0)


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
