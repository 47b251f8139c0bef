"""Passes over a stage's whole gradient buffer once a step, before its data-parallel reduction
(docs/equations.md 6.5).

Megatron-Core (r0.8, megatron/core/distributed/param_and_grad_buffer.py, Bucket.start_grad_sync)
does two things to every gradient bucket before it reduce-scatters it, on the compute stream:
with --check-for-nan-in-loss-and-grad (the default; --no-check-for-nan-in-loss-and-grad turns it
off) it takes the bucket's norm and asserts it is not NaN (reading the fp32 gradients: 4 bytes a
parameter), and unless the collective averages (--ddp-average-in-collective, default off) it
multiplies the bucket by 1/dp (reading and writing them: 8). That is 12 bytes per parameter of the
stage, not of the shard: framework.grad_buffer_pass_bytes_per_param. perfsim prices them as
streaming passes with the optimizer step that follows them (the `optimizer` part of the
breakdown), in both engines:

    t_pass = N_stage x B / (BW_mem e_mem) + 2 o_k

The bucket norm's host synchronisation (the assert reads the GPU's answer) is not priced.
"""

from __future__ import annotations

import numpy as np


def grad_buffer_pass_time(system, params):
    """Seconds of the once-a-step passes over the gradient buffer of a stage of `params`
    parameters (framework.grad_buffer_pass_bytes_per_param bytes each); 0 where the profile
    names none."""
    per_param = system.framework.grad_buffer_pass_bytes_per_param
    if per_param is None or (np.ndim(per_param) == 0 and per_param == 0):
        return 0.0
    device = system.device
    return params * per_param / (device.memory_bandwidth_Bps * device.memory_efficiency) + 2 * device.kernel_overhead_s
