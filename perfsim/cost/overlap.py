"""Communication issued in pieces beside the compute that produces or needs them: what stays exposed
(docs/equations.md 6.1). Data-parallel buckets (dp_overlap) and tensor-parallel chunks (tp_overlap)
use `overlapped_exposure`; ring attention (context parallelism) `ring_exposure`."""

from __future__ import annotations

import numpy as np


def overlapped_exposure(total, window, pieces):
    """Exposed seconds of `total` seconds of communication issued in `pieces` equal pieces, each
    as soon as a compute phase of `window` seconds has produced it (or, mirrored, needed before
    that phase reaches it), one after another on a stream of their own: the last piece always,
    and whatever does not fit behind the window."""
    return np.maximum(total / pieces, total - window * (pieces - 1) / pieces)


def ring_exposure(transfer, block, steps):
    """Exposed seconds of a ring that passes `steps` blocks, each transfer of `transfer` seconds
    issued as a compute block of `block` seconds starts and needed when the next one starts (ring
    attention, docs/equations.md 11.4): every step waits for what its transfer outlasts its block."""
    return steps * np.maximum(transfer - block, 0.0)
