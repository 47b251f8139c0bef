"""The command line's plan defaults for today's stack knobs come from the profile
(framework.attention, framework.dp_overlap, framework.tp_overlap); flags override them."""

from __future__ import annotations

import json

import pytest

from perfsim import cli

CASE = ["predict", "--model", "gpt3-13b", "--devices", "32", "--tp", "8", "--gbs", "64", "--json"]


def plan_of(capsys, *argv) -> dict:
    assert cli.main([*CASE, *argv]) == 0
    return json.loads(capsys.readouterr().out)["plan"]


def test_a_2024_profile_runs_flash_and_overlaps_by_default(capsys):
    plan = plan_of(capsys, "--system", "dgx-h100", "--sp")
    assert (plan["attention"], plan["dp_overlap"], plan["tp_overlap"]) == ("flash", True, True)
    plan = plan_of(capsys, "--system", "dgx-h100")  # no SP: nothing for tp_overlap to pipeline
    assert (plan["attention"], plan["dp_overlap"], plan["tp_overlap"]) == ("flash", True, False)


def test_an_sc21_era_profile_keeps_its_stack(capsys):
    plan = plan_of(capsys, "--system", "dgx-a100", "--sp")
    assert (plan["attention"], plan["dp_overlap"], plan["tp_overlap"]) == ("unfused", False, False)


@pytest.mark.parametrize("flags, want", [(["--attention", "unfused"], ("unfused", True, True)),
                                          (["--no-dp-overlap", "--no-tp-overlap"], ("flash", False, False)),
                                          (["--attention", "flash"], ("flash", True, True))])
def test_flags_override_the_profile(capsys, flags, want):
    plan = plan_of(capsys, "--system", "dgx-h100", "--sp", *flags)
    assert (plan["attention"], plan["dp_overlap"], plan["tp_overlap"]) == want


def test_tp_overlap_without_sp_is_a_one_line_error(capsys):
    assert cli.main([*CASE, "--system", "dgx-h100", "--tp-overlap"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("perfsim: error:") and "--sp" in err and err.count("\n") == 1
