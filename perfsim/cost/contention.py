"""Communication kernels that hold SMs while the compute they overlap runs (docs/equations.md 8.4).

A collective overlapped with compute is no free lunch on a GPU: NCCL runs each channel as one
thread block that keeps an SM for the whole call (NVIDIA/nccl issues #1424, #1656: "NCCL CTAs won't
share an SM with compute kernels"), and Transformer Engine's userbuffers kernels take SMs of their
own for the tensor-parallel reduce-scatters and bulk gathers they pipeline with the GEMMs. For the
time such a kernel runs beside a GEMM, the GEMM has `S - s` of the device's `S` SMs: it slows by
the share `f = s / S` of that time. DeepSeek-V3 (arXiv 2412.19437, section 3.2.2) sets 20 of an
H800's 132 SMs aside for its all-to-all for the same reason.

perfsim already prices what overlapped communication exposes with the profile's
collectives.overlap_efficiency eta: of the part of a collective that runs beside compute, the
1 - eta share shows (cost/overlap.py). Compute slowed by `f` for the `C - X` seconds a
collective runs beside it (X exposed of C) takes `f (C - X)` longer: the same form with
1 - eta = f. Both causes together hide eta (1 - f):

    eta_kind = eta x (1 - s_kind / S)

per kind of overlapped communication (tensor-parallel chunks, data-parallel buckets and gathers,
the context-parallel ring), each with the SMs its kernels take (framework.tp_comm_sms,
dp_comm_sms, cp_comm_sms) out of device.sm_count. A profile without those keys gets eta, as
before. Where eta was measured on the GPU itself (perfsim calibrate's collectives beside
compute), it holds the SMs' share already: such a profile leaves the SM keys out.
"""

from __future__ import annotations

import numpy as np

KINDS = ("tp", "dp", "cp")


def sm_share(system, kind: str):
    """The share of the device's SMs the communication kernels of `kind` ("tp", "dp" or "cp")
    hold while they run beside compute; 0 where the profile names no SM count for them or the
    device."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind of overlapped communication {kind!r}; one of {', '.join(KINDS)}")
    held = getattr(system.framework, f"{kind}_comm_sms")
    total = system.device.sm_count
    if held is None or total is None:
        return 0.0
    return np.minimum(np.asarray(held, float) / total, 1.0)


def overlap_efficiency(system, kind: str):
    """What running `kind`'s overlapped communication beside compute hides of the shorter of the
    two (docs/equations.md 6.1): the profile's collectives.overlap_efficiency less the share of
    it the SMs its kernels hold take from the compute."""
    eta = system.collectives.overlap_or_perfect()
    share = sm_share(system, kind)
    if np.ndim(share) == 0 and share == 0:
        return eta  # no SM keys: exactly the profile's eta (a plain number, as before)
    return eta * (1.0 - share)
