"""Data-parallel gradient traffic by ZeRO stage, and the optimizer step (docs/equations.md, section 6).

Per step, for N parameters on a device and a data-parallel group of d (data and context
parallelism together, Megatron-Core's dp-cp group: context-parallel ranks hold the same weights
and their gradients are reduced, and ZeRO-sharded, with the data-parallel replicas'):
- ZeRO-0 (DDP): all-reduce of the gradients (grad_bytes x N);
- ZeRO-1: reduce-scatter of the gradients after the last micro-batch, then all-gather of the
  updated bf16 weights;
- ZeRO-2: the gradients are kept only as shards, so every micro-batch reduce-scatters its
  gradients (as DeepSpeed does); the weights are all-gathered once after the step;
- ZeRO-3: every micro-batch all-gathers the bf16 weights for forward, again for backward (and
  again for a fully recomputed forward), and reduce-scatters its gradients, one module at a time
  (DeepSpeed and FSDP gather and reduce each layer apart; `zero3_units`), so each of those calls
  pays its latency once per layer, and per embedding and head. The gathers are
  prefetched, so only what exceeds the micro-batch's compute is exposed; the framework's optional
  zero3_overlap (default 1) says what share can hide at all (0 where communication has no core
  or stream of its own, as for CPU ranks on one core each).
Without overlap (plan field dp_overlap false) a reduction starts when the backward pass has ended
and the weight all-gather after the optimizer step. With it (Megatron-Core's --overlap-grad-reduce
and --overlap-param-gather, DeepSpeed's overlap_comm) both run bucket by bucket, one bucket per
layer, beside the compute that produces or needs them: only the last bucket, and what does not fit
behind that compute, is exposed (`overlapped_exposure`).

With framework.zero_implementation = "fsdp2" (torch's fully_shard, section 6.2) ZeRO-2 also
reduce-scatters and gathers one module at a time, ZeRO-3 gathers twice per micro-batch even under
full recomputation (the recomputed forward runs inside a block whose backward has gathered it), and
every gather and reduce-scatter copies its tensors through flat communication buffers on the
compute stream (`fsdp2_copy_times`).
"""

from __future__ import annotations

import numpy as np

from perfsim.cost import pipeline
from perfsim.cost.columns import FULL, Columns, stage_layer_count
from perfsim.cost.contention import overlap_efficiency
from perfsim.cost.layer import MemoryOp, memory_time
from perfsim.cost.memory import OPTIMIZER_BYTES_PER_PARAM
from perfsim.cost.overlap import overlapped_exposure
from perfsim.cost.tensor_parallel import weight_shard
from perfsim.spec.system import System


def is_fsdp2(system: System) -> bool:
    """Whether the profile runs ZeRO-2/3 as torch's FSDP2 (section 6.2), not as DeepSpeed."""
    return system.framework.zero_implementation == "fsdp2"


def zero3_gathers(system: System, c: Columns):
    """Weight all-gathers of ZeRO-3 per micro-batch: forward and backward, and again for a fully
    recomputed forward (DeepSpeed), which FSDP2 runs inside the block its backward has gathered."""
    return 2 + np.where((c.recompute == FULL) & (not is_fsdp2(system)), 1, 0)


def step_reduction_time(system: System, comm, c: Columns, params, units=1):
    """Once per step, after the last micro-batch: (gradient reduction that may overlap the last
    backward pass, weight all-gather that cannot). FSDP2's ZeRO-2 gathers the weights one module
    of the `units` at a time, with its buffer copies (it does so in the step's first forward; the
    time is the same where nothing hides it)."""
    grads = system.framework.grad_bytes_per_param * params
    group, stride = c.dp_cp, c.strides["dp_cp"]
    reduction = np.where(c.zero == 0, comm.all_reduce(grads, group, stride),
                         np.where(c.zero == 1, comm.reduce_scatter(grads, group, stride), 0.0))
    calls = np.where((c.zero == 2) & is_fsdp2(system), units, 1)
    gather = calls * comm.all_gather(c.element * params / calls, group, stride)
    if is_fsdp2(system):
        gather = gather + np.where((c.zero == 2) & (group > 1), fsdp2_copy_times(system, c, params)[0], 0.0)
    return reduction, np.where((c.zero == 1) | (c.zero == 2), gather, 0.0)


def zero3_units(model, c: Columns, stage: str):
    """Modules ZeRO-3 (and FSDP2's ZeRO-2) gathers and reduces one at a time on a device of a
    pipeline stage ("first", "middle", "last" or a layout's "stage i"): its layers (MTP layers
    too), and the word embedding and the head (with the final norm) as modules of their own on the
    stages that hold them."""
    edges = pipeline.embedding_count(c, stage) + pipeline.loss_count(c, stage) + pipeline.mtp_count(c, stage)
    return stage_layer_count(model, c, stage) + edges


def microbatch_reduction_time(system: System, comm, c: Columns, params, busy, backward, units=1, buckets=1):
    """Exposed data-parallel time of one micro-batch: ZeRO-2's gradient reduce-scatter, overlapped
    with the micro-batch's `backward` in `buckets` pieces when the plan overlaps; ZeRO-3's
    gathers and reduce-scatters, one per module of the `units` the stage has, less the
    zero3_overlap share of them that hides behind the `busy` compute time; FSDP2's buffer copies,
    which run on the compute stream and never hide."""
    scatter2, _ = zero_microbatch_times(system, comm, c, params, units if is_fsdp2(system) else 1)
    eta = overlap_efficiency(system, "dp")  # less the SMs NCCL's channels hold beside the compute
    zero2 = np.where(c.dp_overlap, overlapped_exposure(scatter2, backward, buckets, eta), scatter2)
    scatters, gather = zero_microbatch_times(system, comm, c, params, units)
    gathers = zero3_gathers(system, c) * gather
    zero3 = gathers + scatters - np.minimum(system.framework.zero3_overlap * (gathers + scatters), busy)
    exposed = np.where(c.zero == 2, zero2, np.where(c.zero == 3, zero3, 0.0))
    return exposed + fsdp2_microbatch_copies(system, c, params)


def zero_microbatch_times(system: System, comm, c: Columns, params, units=1):
    """Raw time of the per-micro-batch collectives of ZeRO-2 and ZeRO-3 on `params` parameters
    in `units` modules of equal size, one call each (1: a single call, ZeRO-2's bucket), nothing
    hidden: (gradient reduce-scatters, one all-gather of the weights, c.element bytes each). The event simulator
    overlaps them itself; `microbatch_reduction_time` gives what the closed form exposes."""
    group, stride = c.dp_cp, c.strides["dp_cp"]
    scatter = units * comm.reduce_scatter(system.framework.grad_bytes_per_param * params / units, group, stride)
    return scatter, units * comm.all_gather(c.element * params / units, group, stride)


def gradient_accumulation_time(system: System, c: Columns, params):
    """Seconds per micro-batch, averaged over the step's m, of adding a micro-batch's gradients of
    `params` parameters to those the earlier ones left (m - 1 passes of the framework's
    grad_accumulation_bytes_per_param, docs/equations.md 6.4); FSDP2's ZeRO-2 and 3 accumulate
    their shards themselves (fsdp2_copy_times)."""
    nbytes = (system.framework.grad_accumulation_bytes_per_param or 0.0) * params
    if not np.any(nbytes):
        return 0.0
    m = c.microbatches
    each = memory_time(system.device, MemoryOp("gradient_accumulation", nbytes))
    return np.where(is_fsdp2(system) & (c.zero >= 2) & (c.dp_cp > 1), 0.0, (m - 1) / m * each)


def fsdp2_copy_times(system: System, c: Columns, params):
    """Seconds of FSDP2's copies through its communication buffers for `params` parameters (0 for
    DeepSpeed's ZeRO), as element-wise passes at the device's streaming bandwidth:
    (one weight all-gather: its shard copied in, the gathered buffer copied out to the parameters;
    one gradient reduce-scatter: the gradients copied into the flat input; adding a reduce-scatter's
    output to the gradient shard of an earlier micro-batch)."""
    if not is_fsdp2(system):
        return 0.0, 0.0, 0.0
    d, grad = c.dp_cp, system.framework.grad_bytes_per_param
    device = system.device

    def copy(name, nbytes):
        return memory_time(device, MemoryOp(name, nbytes))
    gather = copy("fsdp2_copy_in", 2 * c.element * params / d) + copy("fsdp2_copy_out", 2 * c.element * params)
    return gather, copy("fsdp2_scatter_copy_in", 2 * grad * params), copy("fsdp2_accumulate", 3 * grad * params / d)


def fsdp2_microbatch_copies(system: System, c: Columns, params):
    """FSDP2's buffer copies in one micro-batch (an average one: the gradient shards accumulate
    from the second micro-batch of the step on): ZeRO-3's gathers, and the reduce-scatter's copy of
    ZeRO-2 and 3. ZeRO-2's one gather per step is in step_reduction_time."""
    if not is_fsdp2(system):
        return 0.0
    gather, scatter, accumulate = fsdp2_copy_times(system, c, params)
    m = c.microbatches
    per_microbatch = scatter + accumulate * (m - 1) / m + np.where(c.zero == 3, zero3_gathers(system, c) * gather, 0.0)
    return np.where((c.zero >= 2) & (c.dp_cp > 1), per_microbatch, 0.0)


def tied_embedding_time(model, system: System, comm, c: Columns):
    """All-reduce of the word-embedding gradient between the first and the last pipeline stage,
    which hold the two copies of a tied embedding (docs/equations.md, section 9.2); 0 without."""
    word = model.padded_vocab(c.tp) * model.hidden / weight_shard(c.tp_mode, c.tp, c.tp_depth) \
        * system.framework.grad_bytes_per_param
    tied = model.tied_embeddings & (c.pp > 1)
    return np.where(tied, comm.all_reduce(word, 2, c.strides["pp"] * np.maximum(c.pp - 1, 1)), 0.0)


def optimizer_time(system: System, c: Columns, params):
    """Adam on the device's share of the parameters (sharded from ZeRO-1 on): memory-bound.

    Per parameter it reads the gradient twice (norm for clipping, then the update), reads and
    writes fp32 master, momentum and variance, and writes the weight (c.element bytes); or moves
    the framework's optimizer_bytes_per_param where the profile states them."""
    dev = system.device
    fw = system.framework
    updated = params / np.where(c.zero >= 1, c.dp_cp, 1)
    per_param = (2 * fw.grad_bytes_per_param + 2 * OPTIMIZER_BYTES_PER_PARAM + c.element
                 if fw.optimizer_bytes_per_param is None else fw.optimizer_bytes_per_param)
    return updated * per_param / (dev.memory_bandwidth_Bps * dev.memory_efficiency) + 2 * dev.kernel_overhead_s
