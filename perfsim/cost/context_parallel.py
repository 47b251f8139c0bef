"""Context parallelism: ring attention over the sequence (docs/equations.md section 11).

cp ranks share each sequence. With causal load balancing (Megatron-Core, Transformer Engine) the
sequence is cut into 2 cp chunks and rank i holds chunks i and 2cp-1-i, so every rank has s/cp
tokens and an equal 1/cp of the causal attention work. The linears, norms and element-wise ops
run on the rank's tokens alone; attention needs every earlier key and value, so the ranks pass
their key/value blocks around a ring of cp: per layer, forward, cp-1 steps each sending a block of
(s/cp) tokens x (kv heads / tp) x head_dim, keys and values, in bf16 (GQA sends only the key/value
heads), while the rank computes attention with the block it already has; backward (Transformer
Engine's schedule) passes the blocks again and their gradients one step behind them: cp transfers,
the first a block, the middle ones a block and a gradient, the last a gradient, each beside a
step's blocks (twice the forward's bytes).
A step's transfer hides behind its block of attention; what it outlasts it by is exposed
(`overlap.ring_exposure`). The cp groups sit right after tp in the rank order (spec.plan.ranks_order).
"""

from __future__ import annotations

import numpy as np

from perfsim.cost.counts import head_widths
from perfsim.cost.layer import BF16
from perfsim.cost.overlap import ring_exposure
from perfsim.spec.model import ModelSpec


def kv_block_bytes(model: ModelSpec, mbs, cp, tp, element=BF16):
    """Bytes of one key/value block a rank passes on: keys and values of its s/cp tokens of each
    of the mbs sequences, for the tp-th share of the key/value heads, `element` bytes each (latent
    attention: every head's key, qk_nope_dim + qk_rope_dim wide, and value, v_head_dim)."""
    if model.mla:
        qk, v = head_widths(model)
        return element * mbs * model.seq / cp * model.heads * (qk + v) / tp
    return 2 * element * mbs * model.seq / cp * model.kv_hidden / tp


def ring_step_times(comm, model: ModelSpec, c) -> tuple:
    """(one block, two blocks) seconds of a ring step's transfer: every rank sends to its
    neighbour in its cp group and receives from the other, all groups at once, priced as the
    point-to-point exchange it is (CommModel.send, as a pipeline's hops: the profile's send line
    and, where it has one, its measured table); the backward's middle steps send a block and a
    gradient."""
    block = kv_block_bytes(model, c.mbs, c.cp, c.tp, c.element)
    return comm.send(block, c.cp, c.strides["cp"]), comm.send(2 * block, c.cp, c.strides["cp"])


def ring_attention_times(comm, model: ModelSpec, c, core_forward_s, core_backward_s, efficiency=1.0) -> tuple:
    """(forward, backward) exposed seconds of one layer's ring attention per micro-batch on one
    device: cp-1 transfers forward and cp backward, each beside 1/cp of the attention core's forward (backward)
    time (`core_forward_s`, `core_backward_s`: the rank's whole attention core, all blocks), each
    step hiding the `efficiency` share of the shorter of transfer and block (overlap.ring_exposure);
    0 without context parallelism."""
    if not np.any(np.asarray(c.cp) > 1):  # a batch without cp (the search's usual one) sends nothing
        return 0.0, 0.0
    one, two = ring_step_times(comm, model, c)
    forward = ring_exposure(one, core_forward_s / c.cp, c.cp - 1, efficiency)
    # backward: the first step's block and the last step's gradient alone, a block and a gradient between
    block = core_backward_s / c.cp
    backward = ring_exposure(one, block, 2, efficiency) + ring_exposure(two, block, np.maximum(c.cp - 2, 0), efficiency)
    return np.where(c.cp > 1, forward, 0.0), np.where(c.cp > 1, backward, 0.0)
