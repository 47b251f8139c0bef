"""Tensor-parallel communication pipelined with its GEMMs, plan field `tp_overlap` (1d + SP;
Megatron-Core's --tp-comm-overlap; docs/equations.md 4.2).

Each of a layer's all-gathers (before QKV and FC1) and reduce-scatters (after the projection and
FC2) is cut into t chunks that move while the GEMM computes on the chunks already there; with
chunks of C/t seconds beside a GEMM of W seconds the exposed time is what the GEMM cannot cover,
and at least one chunk. Written out chunk by chunk here.
"""

from __future__ import annotations

import pytest

from perfsim.cost.columns import columns_of
from perfsim.cost.layer import gemm_time
from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.stage import stage_costs
from perfsim.cost.topology import TopologyCommModel
from perfsim.predict import predict
from perfsim.schedule.simulator import predict_simulated
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan, plan_problems
from perfsim.spec.system import load_system

from conftest import pieces_exposed as exposed
from profile_toml import without_at_scale_terms

MODEL = load_model("layers=8,hidden=4096,heads=32,seq=4096,vocab=32000")


@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("system", ["dgx-h100", "smng-p2"])
def test_each_collective_hides_behind_its_gemm_but_one_chunk(t, system):
    # chunks and GEMMs alone: the SMs the kernels hold and the clock of a multi-GPU plan are
    # dgx-h100's at-scale terms (docs/equations.md 8.4-8.5), counted in tests/test_at_scale_terms.py
    s = without_at_scale_terms(load_system(system))
    plan = Plan(tp=t, sp=True, mbs=1, gbs=1)
    peak = s.device.peak_flops_bf16
    plain = stage_costs(MODEL, s, columns_of(plan), peak).middle
    over = stage_costs(MODEL, s, columns_of(plan.replace(tp_overlap=True)), peak).middle
    c = columns_of(plan)
    layout = tpc.layout_of(MODEL, c)
    comm = TopologyCommModel(s)
    activation = 2 * MODEL.seq * MODEL.hidden
    ag = float(tpc.collectives_time(comm, layout, [tpc.Collective(tpc.ALL_GATHER, activation)], c.strides["tp"]))
    rs = float(tpc.collectives_time(comm, layout, [tpc.Collective(tpc.REDUCE_SCATTER, activation)], c.strides["tp"]))
    g = {x.name: float(gemm_time(s.device, peak, x)) for x in tpc.layer_gemms(layout, MODEL, 1)}
    fwd = exposed(ag, g["qkv"], t) + exposed(rs, g["proj"], t) + exposed(ag, g["fc1"], t) + exposed(rs, g["fc2"], t)
    bwd = sum(exposed(x, 2 * g[n], t) for x, n in ((ag, "qkv"), (rs, "proj"), (ag, "fc1"), (rs, "fc2")))
    assert float(over.forward_tp) == pytest.approx(MODEL.layers * fwd, rel=1e-9)
    assert float(over.tp_comm) == pytest.approx(MODEL.layers * (fwd + bwd), rel=1e-9)
    assert float(over.tp_comm) < float(plain.tp_comm)
    assert float(over.compute) == float(plain.compute)


def test_full_recomputation_repeats_the_overlapped_forward():
    s = load_system("dgx-h100")
    plan = Plan(tp=4, sp=True, mbs=1, gbs=1, tp_overlap=True)
    peak = s.device.peak_flops_bf16
    none = stage_costs(MODEL, s, columns_of(plan), peak).middle
    full = stage_costs(MODEL, s, columns_of(plan.replace(recompute="full")), peak).middle
    assert float(full.tp_comm - none.tp_comm) == pytest.approx(float(none.forward_tp), rel=1e-9)


def test_needs_sequence_parallel_1d():
    for plan in (Plan(tp=4, tp_overlap=True), Plan(tp=4, tp_mode="2d", mbs=2, gbs=2, tp_overlap=True)):
        assert any("tp_overlap" in r and "--sp" in r for r in plan_problems(plan, MODEL))
    assert not plan_problems(Plan(tp=4, sp=True, tp_overlap=True), MODEL)


def test_both_engines_take_the_same_time_off():
    s = load_system("dgx-h100")
    plan = Plan(tp=8, sp=True, pp=2, mbs=1, gbs=8)
    gains = []
    for engine in (predict, lambda m, sy, p: predict_simulated(m, sy, p)):
        gains.append(engine(MODEL, s, plan).step_time_s - engine(MODEL, s, plan.replace(tp_overlap=True)).step_time_s)
    assert gains[0] > 0
    assert gains[1] == pytest.approx(gains[0], rel=0.05)
