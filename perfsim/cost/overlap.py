"""Communication issued in pieces beside the compute that produces or needs them: what stays exposed
(docs/equations.md 6.1). Data-parallel buckets (dp_overlap) and tensor-parallel chunks (tp_overlap)
both use it."""

from __future__ import annotations

import numpy as np


def overlapped_exposure(total, window, pieces):
    """Exposed seconds of `total` seconds of communication issued in `pieces` equal pieces, each
    as soon as a compute phase of `window` seconds has produced it (or, mirrored, needed before
    that phase reaches it), one after another on a stream of their own: the last piece always,
    and whatever does not fit behind the window."""
    return np.maximum(total / pieces, total - window * (pieces - 1) / pieces)
