"""A mixture of experts' first dense_layers on the stages that hold them (issue 31; docs/equations.md
12.6): DeepSeek-V3's 3 dense layers on PP 16, by an uneven split and by a layout, counted by hand
in both engines and in memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from perfsim.cost import experts, pipeline
from perfsim.cost.columns import columns_of
from perfsim.cost.memory import stage_params
from perfsim.cost.stage import chunk_times, dense_variant, stage_costs
from perfsim.predict import predict
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

BASE = dict(tp=2, sp=True, pp=16, dp=32, ep=64, etp=1, mbs=1, gbs=1024, zero=1, recompute="full", attention="flash")
SPLIT = Plan(**BASE, first_stage_layers=4, last_stage_layers=1)  # 4 + 14 x 4 + 1 layers: the dense 3 on stage 0
LAYOUT = Plan(**BASE, vpp=2, schedule="interleaved", pp_layout="Et*3|(tt|)*29,m|L")  # stage 0: Ettt and tt
PEAK = 989e12


def _costs(model, plan):
    return stage_costs(model, load_system("dgx-h100"), columns_of(plan), PEAK)


def test_where_the_dense_layers_lie():
    model = load_model("deepseek-v3")
    c = columns_of(SPLIT)
    assert [pipeline.dense_count(model, c, p) for p in ("first", "middle", "last")] == [3, 0, 0]
    # one layer on the first stage: it holds 1 dense layer, stage 1 the other 2 (priced as the middle
    # stages, all MoE: docs/equations.md 12.6)
    c1 = columns_of(Plan(**BASE, first_stage_layers=1))
    assert [pipeline.dense_count(model, c1, p) for p in ("first", "middle", "last")] == [1, 0, 0]
    c2 = columns_of(LAYOUT)
    assert pipeline.chunk_dense(model, c2, "stage 0") == [3, 0]
    assert all(pipeline.dense_count(model, c2, f"stage {i}") == 0 for i in range(1, 16))
    assert float(experts.stage_share(model, c, "first")) == 0.25 and experts.stage_share(model, c, "middle") == 1.0
    assert experts.stage_share(load_model("qwen3-30b-a3b"), c, "first") == 1.0  # no dense layers: unchanged


def test_stage_times_by_hand():
    """Per layer from the model of MoE layers alone and of its dense layer alone (their middle
    stages hold 4 layers): stage 0 of the split is 3 dense layers, 1 MoE layer and the
    embedding; a middle stage 4 MoE layers, where the average of 58/61 put 4 x 58/61 MoE layers
    and 4 x 3/61 dense ones on every stage."""
    model = load_model("deepseek-v3")
    moe, dense = _costs(replace(model, dense_layers=0), SPLIT), _costs(dense_variant(model), SPLIT)
    got = _costs(model, SPLIT)
    ep_layer, tp_moe, tp_dense = moe.middle.ep_comm / 4, moe.middle.tp_comm / 4, dense.middle.tp_comm / 4
    assert dense.middle.ep_comm == 0
    assert got.first.ep_comm == pytest.approx(ep_layer, rel=1e-12)
    assert got.middle.ep_comm == pytest.approx(4 * ep_layer, rel=1e-12)
    assert got.last.ep_comm == pytest.approx(ep_layer, rel=1e-12)
    embedding_tp = moe.first.tp_comm - 4 * tp_moe
    assert got.first.tp_comm == pytest.approx(embedding_tp + tp_moe + 3 * tp_dense, rel=1e-12)
    assert got.middle.compute == pytest.approx(moe.middle.compute, rel=1e-12)  # no dense layer there


def test_step_and_both_engines():
    """The pipeline's pace is a middle stage of 4 MoE layers: ep_comm is 32 micro-batches x 4 MoE
    layers' all-to-alls (the average priced 4 x 58/61 of them); the simulator agrees."""
    from perfsim.schedule.simulator import simulate

    model, system = load_model("deepseek-v3"), load_system("dgx-h100")
    moe = _costs(replace(model, dense_layers=0), SPLIT)
    closed = predict(model, system, SPLIT)
    assert closed.time_breakdown_s["ep_comm"] == pytest.approx(32 * moe.middle.ep_comm, rel=1e-12)
    sim = simulate(model, system, SPLIT)
    assert sim.prediction.time_breakdown_s["ep_comm"] == pytest.approx(closed.time_breakdown_s["ep_comm"], rel=1e-9)
    assert sim.prediction.step_time_s == pytest.approx(closed.step_time_s, rel=0.02)


def test_layout_chunks_by_hand():
    """Stage 0 of the layout: chunk 0 the embedding and the 3 dense layers (no all-to-all), chunk 1
    two MoE layers; the simulator draws each chunk's own."""
    from perfsim.schedule.simulator import simulate

    model, system = load_model("deepseek-v3"), load_system("dgx-h100")
    c = columns_of(LAYOUT)
    costs = stage_costs(model, system, c, PEAK)
    moe = _costs(replace(model, dense_layers=0), LAYOUT)
    ep_layer = moe.by_position["stage 1"][0].ep_comm / 4
    zero, one = chunk_times(model, c, costs, "stage 0")
    assert zero.ep_comm == 0 and one.ep_comm == pytest.approx(2 * ep_layer, rel=1e-12)
    assert costs.by_position["stage 0"][0].ep_comm == pytest.approx(2 * ep_layer, rel=1e-12)
    closed = predict(model, system, LAYOUT)
    sim = simulate(model, system, LAYOUT)
    assert sim.prediction.step_time_s == pytest.approx(closed.step_time_s, rel=0.03)


def test_memory_of_the_stage_holding_them():
    """Stage 0 holds 3 dense layers and 1 MoE layer (tp 2, EP 64: 4 routed experts a rank) and the
    embedding: its parameters and routed-expert parameters by hand; a middle stage 4 MoE layers."""
    model = load_model("deepseek-v3")
    c = columns_of(SPLIT)
    other, routed = experts.moe_layer_params_per_rank(model, c)
    dense = experts.dense_layer_params_per_rank(model, c)
    embedding = model.padded_vocab(2) * model.hidden / 2
    assert float(stage_params(model, c, "first")) == pytest.approx(3 * dense + other + routed + embedding, rel=1e-12)
    assert float(stage_params(model, c, "middle")) == pytest.approx(4 * (other + routed), rel=1e-12)
    assert float(experts.stage_expert_params(model, c, 4, experts.stage_share(model, c, "first"))) == \
        pytest.approx(routed, rel=1e-12)
    assert routed == 4 * 3 * 7168 * 2048  # 256 / 64 experts of SwiGLU 7168 x 2048, whole (etp 1)
