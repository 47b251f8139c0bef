"""`perfsim search --dtype bf16,fp8` / `--dtype any`: plans of several training precisions ranked
together (issue 17: the search explores fp8 where the profile has it)."""

from __future__ import annotations

import json

import pytest

from perfsim.errors import PerfsimError
from perfsim.search import precisions, search, search_precisions
from perfsim.spec.model import load_model
from perfsim.spec.system import load_system

MODEL = "gpt3-1.3b"


def test_any_means_bf16_and_fp8_where_the_profile_has_an_fp8_peak():
    assert precisions(load_system("dgx-h100"), ("any",)) == ("bf16", "fp8")
    assert precisions(load_system("smng-p2"), ("any",)) == ("bf16",)  # Max 1550: no FP8
    assert precisions(load_system("dgx-h100"), ("fp8", "bf16", "fp8")) == ("fp8", "bf16")


def test_plans_of_both_precisions_are_ranked_together():
    model, system = load_model(MODEL), load_system("dgx-h100")
    both = search_precisions(model, system, 8, 64, ("bf16", "fp8"), top=40)
    alone = {d: search(model, system, 8, 64, top=40, dtype=d) for d in ("bf16", "fp8")}
    union = sorted((p for r in alone.values() for p in r.plans), key=lambda p: p.tokens_per_s, reverse=True)[:40]
    assert [(p.dtype, p.tokens_per_s) for p in both.plans] == [(p.dtype, p.tokens_per_s) for p in union]
    assert both.plans[0].dtype == "fp8"  # on an H100 the FP8 GEMMs win
    assert alone["bf16"].plans[0].tokens_per_s < both.plans[0].tokens_per_s
    assert both.evaluated == sum(r.evaluated for r in alone.values())
    for p in both.pareto:  # nothing on the front is both faster and smaller than another point of it
        assert not any(q.tokens_per_s > p.tokens_per_s and q.memory_bytes["total"] < p.memory_bytes["total"]
                       for q in both.pareto)


def test_fp8_asked_of_a_device_without_it_is_an_error():
    with pytest.raises(PerfsimError, match="peak_flops_fp8"):
        search_precisions(load_model(MODEL), load_system("smng-p2"), 8, 64, ("fp8",))


def test_the_command_line(run_cli):
    r = run_cli("search", "--model", MODEL, "--system", "dgx-h100", "--devices", "8", "--gbs", "64", "--dtype", "any",
                "--top", "40", "--json", "--quiet")
    assert r.code == 0, r.err
    plans = json.loads(r.out)["plans"]
    assert plans[0]["dtype"] == "fp8" and {p["dtype"] for p in plans} <= {"bf16", "fp8"}
    table = run_cli("search", "--model", MODEL, "--system", "dgx-h100", "--devices", "8", "--gbs", "64",
                    "--dtype", "bf16,fp8", "--quiet")
    assert table.code == 0 and ", fp8" in table.out
    bad = run_cli("search", "--model", MODEL, "--system", "dgx-h100", "--devices", "8", "--gbs", "64",
                  "--dtype", "bf16,fp9")
    assert bad.code == 2 and "fp9" in bad.err
    robust = run_cli("search", "--model", MODEL, "--system", "dgx-h100", "--devices", "8", "--gbs", "64",
                     "--dtype", "any", "--robust")
    assert robust.code == 2 and "one --dtype" in robust.err
