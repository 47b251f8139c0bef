"""Data-parallel traffic by ZeRO stage: what the closed form exposes."""

import dataclasses

import pytest

import perfsim
from perfsim.cost.columns import columns_of
from perfsim.cost.data_parallel import microbatch_reduction_time, zero_microbatch_times
from perfsim.cost.topology import TopologyCommModel


@pytest.fixture
def case():
    system = perfsim.load_system("smng-p2")
    system = dataclasses.replace(system, framework=dataclasses.replace(system.framework, dp_overlap=1.0))
    c = columns_of(perfsim.Plan(tp=4, pp=4, dp=4, zero=2, mbs=1, gbs=32))
    return system, TopologyCommModel(system), c


def test_zero2_overlap_hides_no_more_than_the_backward_pass(case):
    system, comm, c = case
    params = 1e9
    scatter, _ = zero_microbatch_times(system, comm, c, params)
    for backward in (0.0, 0.25 * float(scatter), 10 * float(scatter)):
        exposed = microbatch_reduction_time(system, comm, c, params, busy=0.0, backward=backward)
        assert float(exposed) == pytest.approx(max(float(scatter) - backward, 0.0))


def test_zero1_exposes_nothing_per_micro_batch(case):
    system, comm, c = case
    c = columns_of(perfsim.Plan(tp=4, pp=4, dp=4, zero=1, mbs=1, gbs=32))
    assert float(microbatch_reduction_time(system, comm, c, 1e9, busy=0.0, backward=0.0)) == 0.0


def test_zero3_gathers_and_reduces_one_module_at_a_time():
    """ZeRO-3 per micro-batch: per module (every layer, the embedding, the head) one all-gather for
    forward, one for backward and one reduce-scatter, each of the module's share of the bytes: the
    bandwidth terms of one whole-stage call, the latency (and any step overhead) once per module."""
    from perfsim.cost.data_parallel import zero3_units
    from perfsim.cost.layer import BF16
    from perfsim.cost.memory import stage_params
    from perfsim.cost.topology import TopologyCommModel
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan
    from perfsim.spec.system import load_system

    model = load_model("layers=6,hidden=256,heads=4,seq=128,vocab=1024")
    base = load_system("cpu-calibrated")
    system = dataclasses.replace(base, framework=dataclasses.replace(base.framework, zero3_overlap=0.0))
    comm = TopologyCommModel(system)
    for plan, stage, units in ((Plan(dp=2, zero=3, mbs=1, gbs=2), "first", 8),
                               (Plan(dp=2, pp=2, zero=3, mbs=1, gbs=4), "middle", 3),
                               (Plan(dp=2, pp=2, zero=3, mbs=1, gbs=4), "last", 4)):
        c = columns_of(plan)
        assert float(zero3_units(model, c, stage)) == units
        n = float(stage_params(model, c, stage))
        grad = system.framework.grad_bytes_per_param
        by_hand = units * (2 * float(comm.all_gather(BF16 * n / units, 2, 1))
                           + float(comm.reduce_scatter(grad * n / units, 2, 1)))
        got = microbatch_reduction_time(system, comm, c, n, 0.0, 0.0, zero3_units(model, c, stage))
        assert float(got) == pytest.approx(by_hand, rel=1e-12)
        one_call = microbatch_reduction_time(system, comm, c, n, 0.0, 0.0)
        assert float(got) > float(one_call)  # the latency and step overhead are paid per module
