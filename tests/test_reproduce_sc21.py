"""SC21 Table 1 on dgx-a100: predicted TFLOP/s per GPU against the reported values.

The dgx-a100 profile takes its efficiencies from independent measurements (hwprofiles/dgx-a100.toml),
not from these rows, so this is a prediction, not a fit."""

import pytest

from perfsim.reproduce import sc21_table


@pytest.fixture(scope="module")
def rows():
    return sc21_table()


def test_every_row_has_a_fitting_plan_with_the_published_shape(rows):
    for row, p in rows:
        assert p is not None and p.fits
        assert (p.plan.tp, p.plan.pp, p.devices, p.plan.gbs) == (row.tp, row.pp, row.gpus, row.batch)
        assert p.plan.recompute == "full"


def test_within_15_percent_on_every_row(rows):
    for row, p in rows:
        assert abs(p.hardware_tflops_per_device / row.tflops_per_gpu - 1) <= 0.15, row.preset


def test_within_10_percent_on_average(rows):
    errors = [abs(p.hardware_tflops_per_device / row.tflops_per_gpu - 1) for row, p in rows]
    assert sum(errors) / len(errors) <= 0.10
