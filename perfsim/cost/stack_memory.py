"""What the training stack allocates beside model states and saved activations (docs/equations.md 7.5).

Each term is one named allocation of Megatron-Core and Transformer Engine (TE), sized from their
source (the file and line of each is in docs/equations.md 7.5); a profile switches on those of its
stack through optional `framework` keys, so a profile without them (the CPU harness, the SC21-era
stacks) predicts what it did before they existed.

- Userbuffers (`--tp-comm-overlap`, the plan's `tp_overlap`): TE's initialize_ub makes one
  communicator per overlapped GEMM of a layer type (12 by default), each with a buffer of the
  global [seq x micro-batch / cp, hidden] activation, in the activation dtype, or uint8 under FP8
  for the eight all-gather ones. Mapped with cuMemCreate / cudaMalloc: outside torch's caching
  allocator, so beside `reserved_memory_bytes`, not under the allocator's fragmentation.
- GEMM workspace (`framework.workspace_bytes`): TE's cuBLAS workspace (32 MiB + 1 KiB from Hopper
  on), repeated once per userbuffers stream (3) where tensor-parallel communication overlaps.
- Bucket padding (`framework.buffer_alignment_elements`): Megatron-Core's distributed optimizer
  starts each parameter in its contiguous parameter and gradient buffers at a multiple of 64
  elements and ends each bucket at a multiple of lcm(dp, 128) elements; perfsim adds the most
  that can take (a bound: which parameters share a bucket depends on the stage's layout).
"""

from __future__ import annotations

import numpy as np

from perfsim.cost.layer import FP8

UB_COMMUNICATORS = 12  # TE initialize_ub's default methods: 4 ring_exchange, 2 pipeline, 4 bulk, 2 external
UB_FP8_BUFFERS = 8  # of them, the all-gathers (layers_all_gather_overlap), uint8 buffers under FP8
UB_STREAMS = 3  # TE's _NUM_MAX_UB_STREAMS: the cuBLAS workspace is repeated once per stream
BUCKET_ALIGNMENT = 128  # elements: a distributed-optimizer bucket ends at a multiple of lcm(dp, 128)
BUCKET_PARAMS = 40_000_000  # Megatron-Core's default bucket: max(40M, 1M x dp) parameters
BUCKET_PARAMS_PER_RANK = 1_000_000


def userbuffer_bytes(model, c):
    """Bytes of TE's userbuffers on a device whose plan overlaps tensor-parallel communication
    (c.tp_overlap): UB_COMMUNICATORS buffers of the layer's global activation, [s x mbs / cp, h],
    `c.element` bytes an element, or 1 for the UB_FP8_BUFFERS all-gather ones under FP8."""
    elements = model.seq * c.mbs / c.cp * model.hidden
    per_element = np.where(np.asarray(c.fp8) > 0, UB_FP8_BUFFERS * FP8 + (UB_COMMUNICATORS - UB_FP8_BUFFERS) * c.element,
                           UB_COMMUNICATORS * c.element)
    return np.where(np.asarray(c.tp_overlap) > 0, elements * per_element, 0.0)


def workspace_bytes(framework, c):
    """The GEMM library's workspace in the allocator: framework.workspace_bytes, once per
    userbuffers stream where the plan overlaps tensor-parallel communication (0 if unset)."""
    if framework.workspace_bytes is None:
        return 0.0
    return framework.workspace_bytes * np.where(np.asarray(c.tp_overlap) > 0, UB_STREAMS, 1)


def parameter_tensors(model, layers, first, last):
    """Parameter tensors a stage's buffers hold: per layer the four weights, their biases and the
    norms' scales (and shifts), and the embedding and head's (word and position embedding; final
    norm and output layer; both counted where a flag is uncertain, as a bound)."""
    norm = 2 if model.norm == "layernorm" else 1
    per_layer = 4 + (4 if model.bias else 0) + 2 * norm
    return layers * per_layer + np.where(first, 2, 0) + np.where(last, norm + 1, 0)


def bucket_padding_elements(framework, c, params, tensors):
    """At most how many padding elements Megatron-Core's distributed optimizer puts in a stage's
    parameter and gradient buffers (each as long): every parameter's start aligned to
    framework.buffer_alignment_elements, every bucket's end to lcm(dp, 128); buckets of
    max(40M, 1M x dp) parameters, and one more per virtual stage (each model chunk has buffers of
    its own). 0 without the distributed optimizer (ZeRO 0) or where the profile does not name it."""
    alignment = framework.buffer_alignment_elements
    if alignment is None:
        return 0.0
    dp = np.asarray(c.dp_cp, dtype=np.int64)
    bucket = np.maximum(BUCKET_PARAMS, BUCKET_PARAMS_PER_RANK * dp)
    buckets = np.ceil(params / bucket) + c.vpp
    padding = tensors * (alignment - 1) + buckets * (np.lcm(dp, BUCKET_ALIGNMENT) - 1)
    return np.where(np.asarray(c.zero) >= 1, padding, 0.0)
