"""The rate of SM-bound kernels inside a multi-GPU training job, against the rates the profile's
kernels were measured at on one GPU (docs/equations.md 8.5).

A profile's GEMM and attention rates are what one GPU reaches with its kernels timed alone
(device.gemm_efficiency and the measured tables: hwprofiles/ledgers/h200-2026-11). Two factors
scale them on a plan of more than one GPU, both on the SM-bound part of every kernel (GEMMs and
fused attention, whose rate is the SM clock times the work per clock); element-wise kernels run at
the memory's clock, which the SM clock does not set, and keep their time:

- device.sustained_clock_ratio, the clock a GPU holds in a job over the clock of its kernel rates.
  A Hopper GPU under matmuls sits at its power limit (H. He, "Strangely, matrix multiplications
  on GPUs run faster when given 'predictable' data", 2024: the same H100 matmul runs faster on
  zeros than on random data, the switching power setting the clock); in a job every GPU of the
  node heats the air and boards the others breathe (eight 700 W GPUs in one chassis); synchronous
  data, tensor and pipeline parallelism wait for the slowest GPU of the job at every collective,
  and GPUs of one 8-GPU node differ by 5% and more in sustained matmul rate (S. Bekman,
  ml-engineering, compute/accelerator, "Not all accelerators are created equal"); and the room's
  temperature moves the clocks through the day (Llama 3, arXiv 2407.21783, section 3.3.4: 1-2%
  of throughput). The profiles give it as the product of those causes, each with its range.
- device.unattributed_at_scale_ratio, no mechanism: what a multi-GPU step loses beyond every named
  term, where a published table says it does (dgx-h100: fitted on the Megatron-LM table's fitted
  rows, perfsim.reproduce.H100_FITTED). It is priced the way the clock is, on the SM-bound kernels
  of multi-GPU plans; where the loss really sits is not known, and the profile says so.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np

from perfsim.cost.layer import Work, fp8_cast_times, work


def devices_of(c):
    """GPUs a plan of Columns `c` runs on."""
    return c.tp * c.cp * c.pp * c.dp


def clock_ratio(system, c):
    """The rate of SM-bound kernels on a plan of Columns `c` over the profile's kernel rates:
    device.sustained_clock_ratio x device.unattributed_at_scale_ratio on more than one GPU (each 1
    where the profile leaves it out), 1 on one GPU (the kernel rates' own conditions)."""
    device = system.device
    ratio = 1.0
    for factor in (device.sustained_clock_ratio, device.unattributed_at_scale_ratio):
        if factor is not None:
            ratio = ratio * factor
    if np.ndim(ratio) == 0 and ratio == 1.0:
        return 1.0
    return np.where(devices_of(c) > 1, ratio, 1.0)


def at_clock(total: Work, memory: Work, ratio) -> Work:
    """`total` with its SM-bound part, all of it but the element-wise kernels of `memory` (the same
    ops' Work without GEMMs and fused attention), stretched by 1 / `ratio`."""
    if np.ndim(ratio) == 0 and ratio == 1.0:
        return total
    stretched = {f.name: getattr(memory, f.name) + (getattr(total, f.name) - getattr(memory, f.name)) / ratio
                 for f in fields(Work) if f.name not in ("flops", "core_flops")}
    return Work(flops=total.flops, core_flops=total.core_flops, **stretched)


def clocked_work(ratio, device, peak_flops: float, gemms: list, memory_ops: list, flash=0, fp8=0,
                 sm_bound: Work | None = None) -> Work:
    """layer.work of these ops, with `sm_bound` (more SM-bound time: attention_dropout) added, at the
    clock `ratio` (clock_ratio): the SM-bound kernels stretched by 1 / `ratio`, the element-wise
    ones (and FP8's casts, streaming passes too) as they are."""
    total = work(device, peak_flops, gemms, memory_ops, flash, fp8)
    if sm_bound is not None:
        total = Work(**{f.name: getattr(total, f.name) + getattr(sm_bound, f.name) for f in fields(Work)})
    if np.ndim(ratio) == 0 and ratio == 1.0:
        return total
    memory = work(device, peak_flops, [], memory_ops, flash)
    if fp8:
        forward, backward = fp8_cast_times(device, gemms)
        memory.time_s, memory.backward_s = memory.time_s + forward, memory.backward_s + backward
        memory.curve_s = memory.curve_s + forward + backward
    return at_clock(total, memory, ratio)
