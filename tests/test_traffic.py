"""perfsim.cost.traffic.step_sent_bytes against hand counts (docs/equations.md section 10)."""

from __future__ import annotations

import pytest

from perfsim.cost.traffic import step_sent_bytes
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

# h 64, s 32, 2 layers, vocab 512 (a multiple of 128 x 4: no padding at t <= 4)
MODEL = load_model("layers=2,hidden=64,heads=4,seq=32,vocab=512,tied_embeddings=false,dropout=false")
SYSTEM = load_system("cpu-example")  # grad_bytes_per_param 4
B, S, H, V, L = 2, 32, 64, 512, 2
A = 2 * B * S * H  # bf16 activation of a micro-batch


def test_1d_tensor_parallel_counts_every_boundary():
    # per micro-batch and member: 4 all-reduces a layer (2 forward, 2 backward) of A, 2 (t-1)/t A
    # each; the embedding's forward all-reduce and the head's backward all-reduce of A; the loss's
    # three fp32 all-reduces of [b s]
    t, m = 2, 3
    plan = Plan(tp=t, mbs=B, gbs=B * m)
    share = 2 * (t - 1) / t
    member = (4 * L + 2) * share * A + 3 * share * 4 * B * S
    got = step_sent_bytes(MODEL, SYSTEM, plan)
    assert got["tp"] == pytest.approx(m * t * member)
    assert got["pp"] == got["dp"] == 0


def test_full_recompute_repeats_the_forward_collectives():
    t = 2
    base = step_sent_bytes(MODEL, SYSTEM, Plan(tp=t, mbs=B, gbs=B))["tp"]
    full = step_sent_bytes(MODEL, SYSTEM, Plan(tp=t, mbs=B, gbs=B, recompute="full"))["tp"]
    assert full - base == pytest.approx(t * L * 2 * (2 * (t - 1) / t) * A)


@pytest.mark.parametrize("p,v,sp,t", [(2, 1, False, 1), (4, 1, False, 1), (2, 2, False, 1), (2, 1, False, 2),
                                      (2, 1, True, 2)])
def test_pipeline_hops(p, v, sp, t):
    m = 4
    plan = Plan(pp=p, vpp=v, schedule="interleaved" if v > 1 else "1f1b", tp=t, sp=sp, mbs=B, gbs=B * m)
    regather = t * (t - 1) / t * A if t > 1 and not sp else 0
    assert step_sent_bytes(MODEL, SYSTEM, plan)["pp"] == pytest.approx(m * 2 * (p * v - 1) * (A + regather))


def _params():
    # untied: layers (12 h^2 + 13 h), word and position embeddings, final norm, head
    return L * (12 * H * H + 13 * H) + V * H + S * H + 2 * H + V * H


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_by_zero_stage(zero):
    d, m, n = 2, 3, _params()
    g, share = 4 * n, (d - 1) / d
    per_device = {0: 2 * share * g, 1: share * g + share * 2 * n, 2: m * share * g + share * 2 * n,
                  3: m * (2 * share * 2 * n + share * g)}[zero]
    got = step_sent_bytes(MODEL, SYSTEM, Plan(dp=d, zero=zero, mbs=B, gbs=B * d * m))
    assert got["dp"] == pytest.approx(d * per_device)
    assert got["total"] == pytest.approx(got["tp"] + got["pp"] + got["dp"])
