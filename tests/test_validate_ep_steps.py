"""`perfsim validate` on a model with experts: its default plan sets hold expert-parallel plans at 2
and 4 ranks (validate.timing.expert_plans), and the timed steps of those at 2 ranks
(validate.steps -> validate.expert_parallel, bf16 on gloo; EP over data-parallel ranks and folded
into the attention's tensor-parallel ones) count what perfsim predicts: FLOPs
exactly, the all-to-all bytes exactly (the probabilities' beside the tokens), every byte the step
sends exactly on the dp plans (perfsim.cost.traffic: the all-to-alls and the experts' reduction
over expert-DP), memory near it. tests/test_validate_moe.py checks the
layer and the step rank by rank against a single-process run."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from perfsim.spec.model import load_model  # noqa: E402
from perfsim.spec.plan import Plan  # noqa: E402
from validate import timing  # noqa: E402

MOE = ("layers=2,hidden=64,heads=4,kv_heads=2,ffn=160,activation=swiglu,norm=rmsnorm,bias=false,"
       "learned_positions=false,seq=32,vocab=512,tied_embeddings=false,dropout=false,"
       "experts=4,topk=2,expert_ffn=32,shared_expert_ffn=64")
EXPERTS = "ep" in Plan.__dataclass_fields__


@pytest.mark.skipif(not EXPERTS, reason="a perfsim without expert parallelism")
def test_default_plan_sets_of_a_model_with_experts_hold_expert_parallel_plans():
    model = load_model(MOE)
    two = [(p.tp, p.dp, p.ep, p.expert_tp, p.moe_dispatcher, p.recompute) for p in timing.default_plans(2, model)]
    assert two == [(1, 2, 2, 1, "alltoall", "none"), (1, 2, 2, 1, "allgather", "none"),
                   (1, 2, 2, 1, "alltoall", "selective"), (1, 2, 1, 1, "alltoall", "none"),
                   (2, 1, 2, 1, "alltoall", "none"), (2, 1, 1, 2, "alltoall", "none")]
    four = [(p.dp, p.ep, p.moe_dispatcher) for p in timing.default_plans(4, model)]
    assert (4, 4, "alltoall") in four and (4, 2, "alltoall") in four and (4, 4, "allgather") in four
    assert all(not timing.harness_problems(p, model) for p in timing.default_plans(4, model))
    dense = load_model(MOE.split(",experts=")[0])
    assert all(p.ep == 1 for p in timing.default_plans(2, dense) + timing.default_plans(4, dense))
    assert timing.harness_problems(Plan(tp=2, sp=True, dp=2, ep=2, etp=1), model)  # tp beside dp: not run
    assert not timing.harness_problems(Plan(tp=2, sp=True), model)  # etp = tp: tensor-parallel experts
    assert timing.harness_problems(Plan(tp=2, sp=True, moe_dispatcher="allgather"), model)


@pytest.mark.multiprocess
@pytest.mark.skipif(not EXPERTS, reason="a perfsim without expert parallelism")
def test_perfsim_validate_times_a_model_with_experts_default_plans(run_cli, tmp_path):
    from perfsim.cost.columns import columns_of
    from perfsim.cost.experts import alltoall_bytes_sent
    from validate.moe_check import named_differences

    model = load_model(MOE)
    r = run_cli("validate", "--device", "cpu", "--nproc", "2", "--model", MOE, "--steps", "1",
                "--speed-tolerance", "inf", "--ledger", str(tmp_path / "l.jsonl"), "--json")
    assert r.code == 0, r.err
    entries = r.json()
    assert len(entries) == 6
    for e in entries:
        plan = Plan(**e["plan"])
        assert e["flops"]["counted"] == e["flops"]["predicted"], e["label"]
        if plan.ep > 1 and plan.moe_dispatcher == "alltoall":  # both ranks' sends, bf16
            one = 2 * 2 * float(alltoall_bytes_sent(model, columns_of(plan))) * model.layers * plan.microbatches
            probabilities = one / 2 / model.hidden  # an element a copy, there only, each pass
            assert named_differences(model, plan, 2)["all_to_all_bytes"] == 0
            assert e["comm_bytes_counted_by_kind"]["all_to_all"] == 2 * (one + probabilities), e["label"]
        # every collective the step sends, the all-to-alls and the experts' reduction over expert-DP
        # included; over tp 2 + SP less the all-reduce of the gradients of the weights SP replicates,
        # which perfsim leaves out: the norms' (2 a layer and the final one, h each) and the routers'
        # (h x experts a MoE layer), bf16, each of the 2 ranks sending 2 (2-1)/2 of them: 1280 + 2048
        norms = 2 * (2 * model.layers + 1) * model.hidden * 2
        router = 2 * model.moe_layers * model.hidden * model.experts * 2
        assert e["comm_bytes"]["counted"] - e["comm_bytes"]["predicted"] == (norms + router if plan.tp > 1 else 0), \
            e["label"]
        assert e["activation_bytes"]["counted"] == pytest.approx(e["activation_bytes"]["predicted"], rel=0.10), e["label"]
        assert e["peak_memory_bytes"]["measured"] == pytest.approx(e["peak_memory_bytes"]["predicted"], rel=0.10), \
            e["label"]


def test_the_host_ops_table_reads_back_from_its_ledgers(tmp_path, monkeypatch, capsys):
    """docs/real-steps-experts.md, "The MoE layer's host time": the committed calibration fitted
    again and the committed validation read back (nothing measured) give the table's errors."""
    import json
    import shutil
    from pathlib import Path

    from perfsim.cli import main

    ledgers = Path(__file__).parent.parent / "hwprofiles" / "ledgers" / "experts-cpu-2026-11" / "host-ops"
    for name in ("cal.jsonl", "cal-overheads.jsonl"):
        shutil.copy(ledgers / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "--fit", "cal.jsonl", "--system", "cpu-calibrated", "--device", "cpu",
                 "--out", "host-ops.toml"]) == 0
    assert "layer overhead 0.75 ms" in capsys.readouterr().out
    tables = {}
    for ledger in ("validation-2.jsonl", "validation-2-again.jsonl"):
        shutil.copy(ledgers / ledger, tmp_path / ledger)
        assert main(["validate", "--device", "cpu", "--nproc", "2", "--model", MOE, "--system", "host-ops.toml",
                     "--ledger", ledger, "--rounds", "3", "--json"]) == 0
        rows = {r["label"]: r["step_time_s"] for r in json.loads(capsys.readouterr().out)}
        tables[ledger] = [round(100 * (t["predicted"] / t["measured"] - 1), 1) for t in rows.values()]
    # dp2 ep2, dp2 ep2 allgather, dp2 ep2 selective, dp2 ep1, tp2 + SP ep2 etp1, tp2 + SP ep1
    assert tables == {"validation-2.jsonl": [-4.4, 11.3, -3.7, 9.9, 59.0, 43.9],
                      "validation-2-again.jsonl": [1.9, 16.0, -4.0, 5.2, 75.5, 56.4]}
