"""Profile numbers as ranges (issue 16 item 1): explicit ranges, causes, default widths by
provenance, and that none of it moves a point prediction."""

from __future__ import annotations

import math

import numpy as np
import pytest

from perfsim.predict import predict
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system, parse_system
from perfsim.uncertainty.ranges import DEFAULT_WIDTHS, FIXED_KEYS
from perfsim.uncertainty.sampling import profile_ranges
from perfsim.uncertainty.sampling import draw

from profile_toml import load_raw

SMNG_175B = Plan(tp=8, pp=16, dp=1, mbs=3, gbs=300, zero=1, recompute="full")


def test_smng_p2_ranges_come_from_the_hardware_facts():
    ranges = load_system("smng-p2").ranges
    gemm = ranges["device.gemm_efficiency"]
    assert (gemm.lo, gemm.hi) == (0.61, 0.835)  # Aurora's 256 TF to Intel's 350 TF full-tile reference, / 419.4
    assert gemm.lo * 419.4 == pytest.approx(256, abs=1) and gemm.hi * 419.4 == pytest.approx(350, abs=1)
    xe = ranges["node.node_link_bandwidth_Bps"]
    assert xe.distribution == "loguniform" and xe.hi / load_system("smng-p2").node.node_link_bandwidth_Bps > 14
    assert ranges["collectives.operation_step_overhead_s.all_reduce"].lo == 0.0


def test_network_efficiency_is_the_product_of_named_causes():
    r = load_system("smng-p2").ranges["collectives.network_efficiency"]
    assert {c.name for c in r.causes} == {"hdr_transfer", "nic_across_socket", "host_staging", "fp32_gradients"}
    assert r.lo == pytest.approx(math.prod(c.lo for c in r.causes)) and r.hi == pytest.approx(0.96)
    assert all(c.source.strip() for c in r.causes)
    d = draw(load_system("smng-p2"), 64)
    j = d.keys.index("collectives.network_efficiency")
    product = np.prod([d.factors[f"collectives.network_efficiency.causes.{c.name}"] for c in r.causes], axis=0)
    assert np.allclose(d.values[:, j], product)
    assert (d.values[:, j] >= r.lo - 1e-12).all() and (d.values[:, j] <= r.hi + 1e-12).all()


def test_default_widths_follow_provenance():
    s = load_system("dgx-a100")
    ranges = profile_ranges(s)
    # dgx-a100 names ranges for its memory runtime alone (docs/equations.md 7.6): the others are defaults
    assert set(s.ranges) == {"framework.reserved_memory_bytes", "framework.allocator_overhead_fraction"}
    spec = ranges["device.memory_bandwidth_Bps"]  # spec: +-2%
    assert (spec.lo, spec.hi) == pytest.approx((2.039e12 * 0.98, 2.039e12 * 1.02))
    measured = ranges["device.gemm_efficiency"]  # measured elsewhere: +-15%
    assert (measured.lo, measured.hi) == pytest.approx((0.87 * 0.85, 1.0))  # kept at most 1 (a fraction)
    assumed = ranges["device.kernel_overhead_s"]  # assumed: x/÷ 2, log-uniform
    assert (assumed.lo, assumed.hi) == pytest.approx((2.5e-6, 10e-6)) and assumed.distribution == "loguniform"
    assert not FIXED_KEYS & set(ranges)  # counts, switches, capacity stay fixed
    assert set(DEFAULT_WIDTHS) == {"spec", "measured", "derived", "assumed", "calibrated"}


def test_widening_keeps_allowed_values():
    s = load_system("dgx-a100")
    wide = profile_ranges(s, widen=2.0)
    narrow = profile_ranges(s)
    for key, r in wide.items():
        assert r.lo <= narrow[key].lo and r.hi >= narrow[key].hi, key
    assert wide["collectives.node_efficiency"].hi <= 1.0 and wide["device.memory_bandwidth_Bps"].lo > 0


def test_draws_stay_inside_their_ranges_and_repeat_by_seed():
    s = load_system("smng-p2")
    ranges = profile_ranges(s)
    d = draw(s, 256, seed=3)
    for j, key in enumerate(d.keys):
        assert (d.values[:, j] >= ranges[key].lo * (1 - 1e-12)).all() and (d.values[:, j] <= ranges[key].hi * (1 + 1e-12)).all()
        assert np.ptp(d.values[:, j]) > 0.5 * (ranges[key].hi - ranges[key].lo), key  # the range is covered
    assert np.array_equal(draw(s, 256, seed=3).values, d.values)
    assert not np.array_equal(draw(s, 256, seed=4).values, d.values)


def _without_ranges(data: dict) -> dict:
    """A raw profile with every range, distribution, cause and the observations key removed."""
    out = {k: v for k, v in data.items() if k != "observations"}
    for section, table in out.items():
        if isinstance(table, dict):
            out[section] = {k: _strip(v) for k, v in table.items()}
    return out


def _strip(entry):
    if isinstance(entry, dict):
        return {k: _strip(v) for k, v in entry.items() if k not in ("range", "distribution", "causes")}
    return entry


def test_ranges_do_not_move_the_point_prediction():
    raw = load_raw("smng-p2")
    with_ranges = parse_system(raw, "smng-p2")
    without = parse_system(_without_ranges(raw), "smng-p2 without ranges")
    assert with_ranges.ranges and not without.ranges
    a, b = predict("gpt3-175b", with_ranges, SMNG_175B), predict("gpt3-175b", without, SMNG_175B)
    assert a.step_time_s == b.step_time_s and a.memory_bytes == b.memory_bytes
    assert a.time_breakdown_s == b.time_breakdown_s


def test_measured_tables_are_not_numbers_to_draw():
    """A calibrated profile's measured kernel tables carry provenance but are no single number."""
    import dataclasses

    from perfsim.cost.measured import KernelTable

    s = load_system("cpu-calibrated")
    table = KernelTable("gemm", "bf16", ((1, 64, 64, 64, 1e-5), (1, 128, 128, 128, 5e-5)))
    s = dataclasses.replace(s, device=dataclasses.replace(s.device, measured=(table,)),
                            provenance=s.provenance | {"device.measured.gemm.bf16": ("measured", "a test")})
    ranges = profile_ranges(s)
    assert "device.measured.gemm.bf16" not in ranges and "device.gemm_efficiency" in ranges
    assert draw(s, 16).n == 16
