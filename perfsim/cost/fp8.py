"""What FP8 training adds once per step and in memory (docs/equations.md 3.11).

With `--dtype fp8` (Transformer Engine's delayed-scaling recipe, as Megatron-Core runs it) each
transformer layer's four weight GEMMs run in FP8; their per-micro-batch casts are priced with the
layer (perfsim.cost.layer.gemm_rate, fp8_cast_times). Beside the bf16 weights and the fp32 master
copy Transformer Engine keeps, per GEMM weight, an FP8 copy and its transpose (Hopper's FP8 GEMMs
take one layout only, and the backward's data-gradient product needs the transpose), cast once
per step after the optimizer has updated the weights (the copy is cached over the micro-batches),
and per GEMM module the scaling state: an fp32 scale, inverse scale and amax history for each of
its three forward tensors (input, weight, output) and two backward ones (output and input
gradient). With framework.fp8_param_gather (Megatron-Core's --fp8-param-gather, as NVIDIA's FP8
recipes run) the FP8 weight is the parameter itself and no bf16 weight is kept. The embedding and
the logits GEMM stay in bf16: Megatron-Core's output layer is not a Transformer Engine module. What
the FP8 layers keep for backward (FP8 copies of the linears' inputs) is perfsim.cost.memory's.
"""

from __future__ import annotations

import numpy as np

from perfsim.cost import counts
from perfsim.cost.layer import FP8, FP8_CAST_BYTES, FP32
from perfsim.cost.tensor_parallel import layer_linears, weight_shard

FP8_COPIES = 2  # the FP8 weight and its transpose
# a layer's GEMMs (tensor_parallel.layer_linears): Transformer Engine's QKV (LayerNormLinear), projection,
# FC1 and FC2 (LayerNormMLP's two); latent attention's down and up projections in place of QKV
SCALED_TENSORS = 5  # per GEMM: input, weight, output forward; output and input gradient backward
AMAX_HISTORY = 1024  # Transformer Engine's DelayedScaling default amax_history_len
SCALING_BYTES_PER_GEMM = SCALED_TENSORS * (2 + AMAX_HISTORY) * FP32  # scale, inverse scale, history


def stage_linear_weights(model, c, layers):
    """Weight elements of the `layers` layers' GEMMs one device holds (its tensor-parallel shard;
    a ZeRO-3 shard of them over the data- and context-parallel group, as its bf16 weights)."""
    held = layers * counts.linear_weight_params(model) / weight_shard(c.tp_mode, c.tp, c.tp_depth)
    return held / np.where(c.zero >= 3, c.dp_cp, 1)


def weight_copy_bytes(model, c, layers, param_gather=None):
    """Bytes FP8 training adds to a device holding `layers` layers: the FP8 weight copies and
    their transposes, and the scaling state of the layers' GEMM modules (0 unless c.fp8). With
    `param_gather` (framework.fp8_param_gather: Megatron-Core's --fp8-param-gather, TE's FP8
    primary weights) the FP8 weight is the parameter itself, its bf16 weight not kept: the
    layers' linear weights cost their FP8 data and transpose, `c.element` bytes less each."""
    held = stage_linear_weights(model, c, layers)
    copies = FP8_COPIES * FP8 * held - (param_gather or 0) * c.element * held
    return c.fp8 * (copies + layers * len(layer_linears(model)) * SCALING_BYTES_PER_GEMM)


def weight_cast_time(model, system, c, layers):
    """Seconds a step spends casting the `layers` layers' updated bf16 weights to FP8 (and their
    transposes), once, after the optimizer step: a streaming pass of FP8_CAST_BYTES per weight
    element, one kernel per GEMM (0 unless c.fp8)."""
    dev = system.device
    elements = stage_linear_weights(model, c, layers)
    seconds = FP8_CAST_BYTES * elements / (dev.memory_bandwidth_Bps * dev.memory_efficiency)
    return c.fp8 * (seconds + layers * len(layer_linears(model)) * dev.kernel_overhead_s)

