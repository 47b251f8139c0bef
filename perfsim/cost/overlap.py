"""Communication issued in pieces beside the compute that produces or needs them: what stays exposed
(docs/equations.md 6.1). Data-parallel buckets (dp_overlap) and tensor-parallel chunks (tp_overlap)
use `overlapped_exposure`; ring attention (context parallelism) `ring_exposure`. Both take the
profile's collectives.overlap_efficiency (eta): the share of the shorter of (communication, the
compute beside it) that running the two together hides; 1 hides it all, less charges the rest
(contention for the core, memory or copy engines that the two share)."""

from __future__ import annotations

import numpy as np


def overlapped_exposure(total, window, pieces, efficiency=1.0):
    """Exposed seconds of `total` seconds of communication issued in `pieces` equal pieces, each
    as soon as a compute phase of `window` seconds has produced it (or, mirrored, needed before
    that phase reaches it), one after another on a stream of their own: the last piece always,
    whatever does not fit behind the window, and the 1 - `efficiency` share of what does."""
    ideal = np.maximum(total / pieces, total - window * (pieces - 1) / pieces)
    if np.ndim(efficiency) == 0 and efficiency == 1.0:  # a profile without the number (the search's usual case)
        return ideal
    return ideal + (1.0 - efficiency) * (total - ideal)


def ring_exposure(transfer, block, steps, efficiency=1.0):
    """Exposed seconds of a ring that passes `steps` blocks, each transfer of `transfer` seconds
    issued as a compute block of `block` seconds starts and needed when the next one starts (ring
    attention, docs/equations.md 11.4): every step waits for what its transfer outlasts its block,
    and for the 1 - `efficiency` share of the shorter of the two."""
    if np.ndim(efficiency) == 0 and efficiency == 1.0:
        return steps * np.maximum(transfer - block, 0.0)
    return steps * (np.maximum(transfer - block, 0.0) + (1.0 - efficiency) * np.minimum(transfer, block))
