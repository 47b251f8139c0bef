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
