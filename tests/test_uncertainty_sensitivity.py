"""`perfsim sensitivity` (issue 16 item 5, its first half): first-order variance shares, checked on
functions whose shares are known, and on the profiles."""

from __future__ import annotations

import numpy as np
import pytest

from perfsim.spec.system import load_system
from perfsim.uncertainty.sampling import draw
from perfsim.uncertainty.sensitivity import first_order_shares


def test_shares_of_a_known_function():
    rng = np.random.default_rng(0)
    a, b, c = rng.uniform(size=(3, 4096))
    y = 3 * a + b  # Var: 9/12 and 1/12 of 10/12; c does nothing
    assert first_order_shares(a, y) == pytest.approx(0.9, abs=0.03)
    assert first_order_shares(b, y) == pytest.approx(0.1, abs=0.03)
    assert first_order_shares(c, y) < 0.01
    assert first_order_shares(a, np.ones(10)) == 0.0


def test_link_and_device_numbers_are_drawn_independently():
    """Two Sobol designs paired by index track each other dimension by dimension; the draws pair
    them at random, so no device number follows a link number."""
    d = draw(load_system("smng-p2"), 512, comm_points=512)
    ranks = np.argsort(np.argsort(d.values, axis=0), axis=0)
    c = np.corrcoef(ranks.T)
    np.fill_diagonal(c, 0)
    assert np.abs(c).max() < 0.2


def test_smng_p2_step_time_is_moved_by_xe_link(run_cli):
    result = run_cli("sensitivity", "--samples", "128", "--top", "3", "--json")
    assert result.code == 0, result.err
    numbers = result.json()["numbers"]
    assert numbers[0]["number"] == "node.node_link_bandwidth_Bps" and numbers[0]["variance_share"] > 0.5
    assert numbers[0]["p10"] < numbers[0]["p90"] and len(numbers) == 3


def test_dgx_a100_step_time_is_moved_by_gemm_efficiency(run_cli):
    result = run_cli("sensitivity", "--system", "dgx-a100", "--model", "sc21-145.6b", "--devices", "1536", "--tp", "8",
                     "--pp", "8", "--gbs", "2304", "--recompute", "full", "--samples", "128")
    assert result.code == 0, result.err
    first = result.out.splitlines()[3]
    assert first.endswith("device.gemm_efficiency"), result.out
