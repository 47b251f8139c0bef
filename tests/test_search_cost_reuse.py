"""The search prices a batch's distinct layers once and spreads them over its rows (the layer's
time, cost/stage.py; what each stage's memory takes of it, cost/memory.py), and times only the
plans that fit: the numbers are those of pricing every row, bit for bit."""

import numpy as np
import pytest

import perfsim
from perfsim.cost import columns
from perfsim.predict import evaluate
from perfsim.search import PlanSpace, parse_fixes, to_columns


def _flat(result: dict) -> dict:
    out = {}
    for key, value in result.items():
        if isinstance(value, dict):
            out |= {f"{key}.{k}": v for k, v in value.items()}
        else:
            out[key] = value
    return out


def _batches(model, system, devices, gbs, fixes, dtype="bf16"):
    space = PlanSpace(model, devices, gbs, parse_fixes(fixes))
    return [(to_columns(mode, order, cols), dtype) for mode, order, cols in space.valid()]


@pytest.mark.parametrize("model, system, devices, gbs, fixes, dtype", [
    ("qwen3-30b-a3b", "dgx-h100", 16, 256, ["tp=1,2", "mbs=1,2"], "fp8"),
    ("deepseek-v3", "dgx-h100", 256, 1024, ["tp=2", "mbs=1", "cp=1", "ep=8,64"], "bf16"),  # dense layers too
    ("gpt3-13b", "smng-p2", 64, 128, ["mbs=1,2", "order=tp-dp-pp,dp-pp-tp"], "bf16"),
])
def test_distinct_layers_priced_once_give_every_rows_numbers(monkeypatch, model, system, devices, gbs, fixes, dtype):
    model, system = perfsim.load_model(model), perfsim.load_system(system)
    batches = _batches(model, system, devices, gbs, fixes, dtype)
    once = [_flat(evaluate(model, system, c, d)) for c, d in batches]
    monkeypatch.setattr(columns, "_drawn", lambda system: True)  # every row priced as it comes
    every = [_flat(evaluate(model, system, c, d)) for c, d in batches]
    for a, b in zip(once, every):
        for key in b:
            assert np.array_equal(np.asarray(a[key]), np.asarray(b[key])), key


@pytest.mark.parametrize("model, system, devices, gbs, fixes", [
    ("qwen3-30b-a3b", "dgx-h100", 16, 256, ["tp=1,2", "mbs=1,2"]),
    ("gpt3-13b", "smng-p2", 64, 128, ["mbs=1,2,4", "recompute=none,full"]),
])
def test_fitting_only_times_the_plans_that_fit_as_the_whole_batch_does(model, system, devices, gbs, fixes):
    model, system = perfsim.load_model(model), perfsim.load_system(system)
    for c, dtype in _batches(model, system, devices, gbs, fixes):
        whole, some = _flat(evaluate(model, system, c, dtype)), _flat(evaluate(model, system, c, dtype, fitting_only=True))
        fits = whole["fits"]
        assert np.array_equal(fits, some["fits"]) and (0 < fits.sum() < len(fits) or fits.all())
        for key in whole:
            a, b = (np.broadcast_to(x, fits.shape) for x in (whole[key], some[key]))
            assert np.array_equal(a[fits], b[fits]), key
            assert fits.all() or key.split(".")[0] not in ("step_time_s", "time_breakdown_s") or np.isnan(b[~fits]).all()


def test_rows_are_not_merged_under_a_system_drawn_row_by_row():
    """Under draws of a profile's ranges (perfsim.uncertainty) a row's numbers are its draw's: rows
    alike in every column still differ, so nothing is priced once for several of them."""
    import dataclasses

    model, system = perfsim.load_model("qwen3-30b-a3b"), perfsim.load_system("dgx-h100")
    c, _ = _batches(model, system, 16, 256, ["tp=1", "mbs=1"])[0]
    unread = ("pp", "vpp")
    assert columns.distinct_rows_of(c, unread, system=system) is not None
    drawn = dataclasses.replace(system, device=dataclasses.replace(
        system.device, memory_efficiency=np.linspace(0.5, 0.9, len(c.tp))))
    assert columns.distinct_rows_of(c, unread, system=drawn) is None
