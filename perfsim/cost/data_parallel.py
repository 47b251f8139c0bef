"""Data-parallel gradient traffic by ZeRO stage, and the optimizer step (docs/equations.md, section 6).

Per step, for N parameters on a device and a data-parallel group of d:
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
The framework's dp_overlap says what share of a gradient reduction hides behind the backward pass
that produces it (ZeRO 0-2); the weight all-gather follows the optimizer step and never hides.
"""

from __future__ import annotations

import numpy as np

from perfsim.cost.columns import FULL, Columns
from perfsim.cost.layer import BF16
from perfsim.cost.memory import OPTIMIZER_BYTES_PER_PARAM
from perfsim.cost.tensor_parallel import weight_shard
from perfsim.spec.system import System


def step_reduction_time(system: System, comm, c: Columns, params):
    """Once per step, after the last micro-batch: (gradient reduction that may overlap the last
    backward pass, weight all-gather that cannot)."""
    grads = system.framework.grad_bytes_per_param * params
    stride = c.strides["dp"]
    reduction = np.where(c.zero == 0, comm.all_reduce(grads, c.dp, stride),
                         np.where(c.zero == 1, comm.reduce_scatter(grads, c.dp, stride), 0.0))
    gather = np.where((c.zero == 1) | (c.zero == 2), comm.all_gather(BF16 * params, c.dp, stride), 0.0)
    return reduction, gather


def zero3_units(model, c: Columns, stage: str):
    """Modules ZeRO-3 gathers and reduces one at a time on a device of a pipeline stage ("first",
    "middle" or "last"): its layers, and the word embedding and the head (with the final norm) as
    modules of their own on the stages that hold them."""
    edges = np.where(c.pp == 1, 2, {"first": 1, "middle": 0, "last": 1}[stage])
    return model.layers / c.pp + edges


def microbatch_reduction_time(system: System, comm, c: Columns, params, busy, backward, units=1):
    """Exposed data-parallel time of one micro-batch: ZeRO-2's gradient reduce-scatter less the
    dp_overlap share, which can hide only behind the micro-batch's `backward` time; ZeRO-3's
    gathers and reduce-scatters, one per module of the `units` the stage has, less the
    zero3_overlap share of them that hides behind the `busy` compute time."""
    stride = c.strides["dp"]
    scatter = comm.reduce_scatter(system.framework.grad_bytes_per_param * params, c.dp, stride)
    zero2 = scatter - np.minimum(system.framework.dp_overlap * scatter, backward)
    scatters, gather = zero_microbatch_times(system, comm, c, params, units)
    gathers = (2 + np.where(c.recompute == FULL, 1, 0)) * gather
    zero3 = gathers + scatters - np.minimum(system.framework.zero3_overlap * (gathers + scatters), busy)
    return np.where(c.zero == 2, zero2, np.where(c.zero == 3, zero3, 0.0))


def zero_microbatch_times(system: System, comm, c: Columns, params, units=1):
    """Raw time of the per-micro-batch collectives of ZeRO-2 and ZeRO-3 on `params` parameters
    in `units` modules of equal size, one call each (1: a single call, ZeRO-2's bucket), nothing
    hidden: (gradient reduce-scatters, one all-gather of the bf16 weights). The event simulator
    overlaps them itself; `microbatch_reduction_time` gives what the closed form exposes."""
    stride = c.strides["dp"]
    scatter = units * comm.reduce_scatter(system.framework.grad_bytes_per_param * params / units, c.dp, stride)
    return scatter, units * comm.all_gather(BF16 * params / units, c.dp, stride)


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
    writes fp32 master, momentum and variance, and writes the bf16 weight."""
    dev = system.device
    updated = params / np.where(c.zero >= 1, c.dp, 1)
    per_param = 2 * system.framework.grad_bytes_per_param + 2 * OPTIMIZER_BYTES_PER_PARAM + BF16
    return updated * per_param / (dev.memory_bandwidth_Bps * dev.memory_efficiency) + 2 * dev.kernel_overhead_s
