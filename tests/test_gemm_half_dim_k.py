"""The reduction dimension's own half-dim in the GEMM efficiency model (device.gemm_half_dim_k,
docs/equations.md 3.1; issue 29): its formula against a hand count, a fit on synthetic GEMMs made
from known numbers finds them back, shapes that cannot tell k from m and n leave it out, and a
profile without it prices every GEMM exactly as before."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from perfsim.calibrate.compute import fit_gemms
from perfsim.cost.layer import Gemm, gemm_efficiency, gemm_pass_times, gemm_time
from perfsim.predict import peak_flops, predict
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

H100 = load_system("dgx-h100")


def _device(**fields):
    return dataclasses.replace(H100.device, measured=(), **fields)


def test_k_has_its_own_half_dim_by_hand():
    """0.8 x 64/(64+64) x 192/(192+64) x 384/(384+128) = 0.8 x 0.5 x 0.75 x 0.75 = 0.225; without
    gemm_half_dim_k k takes gemm_half_dim: 0.8 x 0.5 x 0.75 x 384/448."""
    dev = _device(gemm_efficiency=0.8, gemm_half_dim=64.0, gemm_half_dim_k=128.0)
    assert gemm_efficiency(dev, 64, 192, 384) == pytest.approx(0.225, rel=1e-12)
    assert gemm_efficiency(_device(gemm_efficiency=0.8, gemm_half_dim=64.0), 64, 192, 384) == pytest.approx(
        0.8 * 0.5 * 0.75 * 384 / 448, rel=1e-12)
    # m and n are interchangeable, k is not: the backward products of one GEMM differ
    assert gemm_efficiency(dev, 192, 64, 384) == gemm_efficiency(dev, 64, 192, 384)
    assert gemm_efficiency(dev, 384, 192, 64) < gemm_efficiency(dev, 64, 192, 384)
    forward, _, first, second, _ = gemm_pass_times(dev, 989e12, Gemm("fc1", 1, 8192, 8192, 512))
    assert first < forward and second < forward  # k = 8192 there, 512 forward


def test_without_the_key_every_time_is_as_before():
    """Absent (the shipped profiles): the product form with one half-dim, bit for bit, and each
    backward product the forward's time (no measured table)."""
    dev = _device()
    assert dev.gemm_half_dim_k is None
    m, n, k = (np.array([128.0, 2048.0, 8192.0, 50304.0]),) * 3
    half = dev.gemm_half_dim
    expected = dev.gemm_efficiency * (m / (m + half)) * (n[::-1] / (n[::-1] + half)) * (k / (k + half))
    assert np.array_equal(gemm_efficiency(dev, m, n[::-1], k), expected)
    forward, share, first, second, backward_share = gemm_pass_times(dev, 989e12, Gemm("fc1", 1, 8192, 8192, 512))
    assert first == second == forward and backward_share == share == 1.0
    # a whole step on the shipped profile: the same with the key set to None explicitly
    model, plan = load_model("gpt3-1.3b"), Plan(tp=2, dp=4, mbs=2, gbs=64)
    explicit = dataclasses.replace(H100, device=dataclasses.replace(H100.device, gemm_half_dim_k=None))
    assert predict(model, H100, plan).step_time_s == predict(model, explicit, plan).step_time_s


def _records(device, dims, peak):
    return [{"suite": "gemm", "op": "matmul", "dtype": "bf16", "shape": {"count": 1, "m": m, "n": n, "k": k},
             "_t": float(gemm_time(device, peak, Gemm("g", 1, m, n, k)))} for m, n, k in dims]


def test_a_fit_finds_the_three_numbers_back():
    truth = _device(gemm_efficiency=0.78, gemm_half_dim=40.0, gemm_half_dim_k=150.0)
    system = dataclasses.replace(H100, device=_device())
    peak = peak_flops(system, "bf16")
    dims = list(itertools.product((256, 512, 1024, 2048, 4096, 8192), repeat=3))
    values, quality, notes, fitted = fit_gemms(_records(truth, dims, peak), system, "cuda", "synthetic.jsonl")
    assert values["device.gemm_efficiency"].value == pytest.approx(0.78, rel=1e-3)
    assert values["device.gemm_half_dim"].value == pytest.approx(40.0, rel=1e-2)
    assert values["device.gemm_half_dim_k"].value == pytest.approx(150.0, rel=1e-2)
    assert fitted.device.gemm_half_dim_k == pytest.approx(150.0, rel=1e-2)
    assert quality[0].held_mape < 1e-3 and "reduction dimension" in values["device.gemm_half_dim_k"].source


def test_shapes_that_never_vary_k_alone_leave_it_out():
    """Cubes and m = n = k / 4 only: k never changes with m and n held, so the fit keeps one
    half-dim (and the base profile's k half-dim, where it has one), with a note."""
    truth = _device(gemm_efficiency=0.78, gemm_half_dim=40.0)
    peak = peak_flops(H100, "bf16")
    dims = [(d, d, d) for d in (256, 512, 1024, 2048, 4096, 8192)] + [(d, d, 4 * d) for d in (256, 512, 1024, 2048)]
    for base_k in (None, 99.0):
        system = dataclasses.replace(H100, device=_device(gemm_half_dim_k=base_k))
        values, _, notes, fitted = fit_gemms(_records(truth, dims, peak), system, "cuda", "synthetic.jsonl")
        assert "device.gemm_half_dim_k" not in values and fitted.device.gemm_half_dim_k == base_k
        assert any("one half-dim for m, n and k" in note for note in notes)
