"""Latent attention under 1d TP + SP (issue 31; docs/equations.md 4.2): Megatron-Core keeps the
down projections and their norms whole on every TP rank (TELinear, parallel_mode "duplicated"),
each rank's gradient its own tokens' part, summed over TP once a step; its bytes and time by hand."""

from __future__ import annotations

import pytest

from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.columns import columns_of
from perfsim.cost.topology import TopologyCommModel
from perfsim.cost.traffic import step_sent_bytes
from perfsim.predict import predict
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

BASE = dict(tp=2, sp=True, pp=16, dp=32, ep=64, etp=1, mbs=1, gbs=1024, zero=1, recompute="full", attention="flash")
SPLIT = Plan(**BASE, first_stage_layers=4, last_stage_layers=1)
# DeepSeek-V3: q_down 7168 x 1536 and its RMSNorm 1536, kv_down 7168 x (512 + 64) and its RMSNorm 512
REPLICATED = 7168 * 1536 + 1536 + 7168 * 576 + 512


def test_replicated_parameters_by_hand():
    model = load_model("deepseek-v3")
    assert tpc.replicated_grad_params(model, columns_of(SPLIT)) == REPLICATED == 15_140_864
    assert tpc.replicated_grad_params(model, columns_of(Plan(tp=2, dp=4, gbs=4))) == 0  # no SP: gradients agree
    assert tpc.replicated_grad_params(model, columns_of(Plan(dp=8, gbs=8))) == 0  # no TP
    assert tpc.replicated_grad_params(load_model("qwen3-30b-a3b"), columns_of(SPLIT)) == 0  # no latents


def _without(monkeypatch):
    import perfsim.schedule.analytic as analytic

    monkeypatch.setattr(tpc, "replicated_grad_params", lambda model, c: 0.0)
    monkeypatch.setattr(analytic, "replicated_grad_params", lambda model, c: 0.0)


def test_time_and_bytes_by_hand(monkeypatch):
    """The slowest stage's all-reduce: a middle stage's 4 layers x 15.1 M fp32 gradients (242 MB)
    over TP 2 inside a node, 2 x 1/2 x 242 MB at 450 GB/s x 0.82 = 0.66 ms more tp_comm; every
    rank of every stage sends its 2 x 1/2 x 4 bytes x its layers' parameters: 64 ranks x 61 layers."""
    model, system = load_model("deepseek-v3"), load_system("dgx-h100")
    with_grads = predict(model, system, SPLIT)
    sent = step_sent_bytes(model, system, SPLIT)["tp"]
    ring = TopologyCommModel(system).all_reduce(4 * 4 * REPLICATED, 2, 1)
    assert float(ring) == pytest.approx(4 * 4 * REPLICATED / (450e9 * 0.82), rel=0.05)
    _without(monkeypatch)
    without = predict(model, system, SPLIT)
    assert with_grads.time_breakdown_s["tp_comm"] - without.time_breakdown_s["tp_comm"] == pytest.approx(float(ring),
                                                                                                        rel=1e-9)
    assert sent - step_sent_bytes(model, system, SPLIT)["tp"] == pytest.approx(64 * 4 * REPLICATED * 61, rel=1e-12)


def test_the_simulator_draws_it(monkeypatch):
    from perfsim.schedule.simulator import simulate

    model, system = load_model("deepseek-v3"), load_system("dgx-h100")
    with_grads = simulate(model, system, SPLIT).prediction.step_time_s
    ring = float(TopologyCommModel(system).all_reduce(4 * 4 * REPLICATED, 2, 1))
    _without(monkeypatch)
    without = simulate(model, system, SPLIT).prediction.step_time_s
    assert with_grads - without == pytest.approx(ring, rel=0.3)  # after the data-parallel reduction
