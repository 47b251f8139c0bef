"""Tensor-parallel collectives of one micro-batch (docs/equations.md, section 4).

1D (Megatron): per layer one all-reduce of the [b, s, h] activation after attention and one
after the MLP in the forward pass (operator g), and one each in the backward pass (operator f).
With sequence parallelism each all-reduce becomes an all-gather entering the tensor-parallel
region and a reduce-scatter leaving it; the volume is the same.
A recomputed layer (full recomputation) repeats its forward collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfsim.cost.layer import BF16, FP32
from perfsim.spec.model import ModelSpec

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"


@dataclass(frozen=True)
class Collective:
    kind: str
    nbytes: object  # the full tensor's bytes (gathered size for all-gather / reduce-scatter)
    count: object = 1  # how many such collectives (0 where a mode does not issue it)


def sent_bytes(kind: str, nbytes, group_size):
    """Bytes each member sends with ring algorithms."""
    share = (group_size - 1) / group_size
    return 2 * share * nbytes if kind == ALL_REDUCE else share * nbytes


def _boundary(activation_bytes, sp, count):
    """`count` tensor-parallel region boundaries: all-reduces, or all-gather + reduce-scatter with SP."""
    return [Collective(ALL_REDUCE, activation_bytes, np.where(sp, 0, count)),
            Collective(ALL_GATHER, activation_bytes, np.where(sp, count, 0)),
            Collective(REDUCE_SCATTER, activation_bytes, np.where(sp, count, 0))]


def layer_collectives(model: ModelSpec, b, sp) -> tuple[list, list]:
    """(forward, backward) collectives of one layer; recompute repeats the forward list."""
    activation = BF16 * b * model.seq * model.hidden
    return _boundary(activation, sp, 2), _boundary(activation, sp, 2)


def embedding_collectives(model: ModelSpec, b, sp) -> tuple[list, list]:
    """Vocabulary-parallel embedding: its partial outputs are summed (all-reduce), or
    reduce-scattered into the sequence-parallel region, whose backward is an all-gather."""
    activation = BF16 * b * model.seq * model.hidden
    forward = [Collective(ALL_REDUCE, activation, np.where(sp, 0, 1)),
               Collective(REDUCE_SCATTER, activation, np.where(sp, 1, 0))]
    return forward, [Collective(ALL_GATHER, activation, np.where(sp, 1, 0))]


def head_collectives(model: ModelSpec, b, sp) -> tuple[list, list]:
    """Logits input enters the tensor-parallel region (identity forward / all-reduce backward,
    or all-gather / reduce-scatter with SP); the vocabulary-parallel cross-entropy all-reduces
    the max, the target logit and the sum of exponentials, [b, s] in fp32 each."""
    activation = BF16 * b * model.seq * model.hidden
    forward = [Collective(ALL_GATHER, activation, np.where(sp, 1, 0)),
               Collective(ALL_REDUCE, FP32 * b * model.seq, 3)]
    backward = [Collective(ALL_REDUCE, activation, np.where(sp, 0, 1)),
                Collective(REDUCE_SCATTER, activation, np.where(sp, 1, 0))]
    return forward, backward


def collectives_time(comm, collectives: list, group_size, stride):
    total = 0.0
    for c in collectives:
        op = comm.all_reduce if c.kind == ALL_REDUCE else comm.all_gather
        total = total + c.count * op(c.nbytes, group_size, stride)
    return total


def collectives_sent_bytes(collectives: list, group_size):
    return sum(c.count * sent_bytes(c.kind, c.nbytes, group_size) for c in collectives)
