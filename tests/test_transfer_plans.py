"""benchmarks/transfer.py --plan-aware: the calibration is asked for exactly the plans that
`perfsim validate` then runs (issue 15's plan-aware case), one campaign per distinct kernel set."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def transfer_module():
    spec = importlib.util.spec_from_file_location("transfer_benchmark", ROOT / "benchmarks" / "transfer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_plans_text_round_trips_to_validates_default_plans(nproc):
    from perfsim.spec.model import load_model
    from validate.timing import default_plans, parse_plans

    transfer = transfer_module()
    text = transfer.validation_plans(nproc, transfer.VALIDATION_MODEL)
    assert parse_plans(text) == default_plans(nproc, load_model(transfer.VALIDATION_MODEL))


def test_calibrate_runs_one_campaign_per_kernel_set_of_those_plans():
    from perfsim.commands.calibrate import PLAN_KEYS, given_plans

    transfer = transfer_module()
    args = SimpleNamespace(plans=transfer.validation_plans(2, transfer.VALIDATION_MODEL), **{k: None for k in PLAN_KEYS})
    campaigns = given_plans(args)
    layouts = sorted((c["tp"], c["sp"], c["pp"], c["cp"]) for c in campaigns)
    # tp 2 with and without sequence parallelism, pp 2, dp 2 (tp = pp = cp = 1), cp 2: recompute,
    # ZeRO, schedules and flash attention change no kernel shape a campaign measures
    assert layouts == [(1, False, 1, 1), (1, False, 1, 2), (1, False, 2, 1), (2, False, 1, 1), (2, True, 1, 1)]
