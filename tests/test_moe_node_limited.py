"""Node-limited routing and the flex (DeepEP) dispatcher (issue 31, item 3; docs/equations.md 12.3):
the closed form of the nodes and ranks a token reaches against a Monte-Carlo count, DeepSeek-V3's
dispatch on 8 nodes by hand, the model key and its Hugging Face fields, the plan's rules and the
bytes a step sends."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from perfsim.cost import experts
from perfsim.cost.columns import columns_of
from perfsim.cost.topology import TopologyCommModel
from perfsim.cost.traffic import ep_all_to_all_bytes, step_sent_bytes
from perfsim.errors import PerfsimError
from perfsim.predict import predict
from perfsim.spec.model import build_model, load_model
from perfsim.spec.plan import Plan, plan_problems
from perfsim.spec.presets import PRESETS
from perfsim.spec.system import forced_balance, load_system

# DeepSeek-V3 on 128 DGX H100 nodes, its own EP 64 (8 nodes a group, 32 experts a node, 4 a rank)
PLAN = dict(tp=2, sp=True, pp=16, dp=32, first_stage_layers=4, last_stage_layers=1, ep=64, etp=1, mbs=1, gbs=1024,
            zero=1, recompute="full", attention="flash")


def _monte_carlo(experts_total, per_rank, ranks_per_node, nodes, reach, topk, draws=200_000, seed=0):
    """(copies to other nodes, NVLink forwards, EP ranks reached) per token by sampling: the
    token's source rank uniform, `reach` of the nodes chosen uniformly, topk experts drawn
    without replacement from theirs; experts numbered node by node, rank by rank."""
    rng = np.random.default_rng(seed)
    per_node = per_rank * ranks_per_node
    chosen = np.argsort(rng.random((draws, nodes)), axis=1)[:, :reach]  # the nodes a token may reach
    picks = np.argsort(rng.random((draws, reach * per_node)), axis=1)[:, :topk]  # among their experts
    node = np.take_along_axis(chosen, picks // per_node, axis=1)
    rank = node * ranks_per_node + (picks % per_node) // per_rank
    source = rng.integers(0, nodes * ranks_per_node, draws)
    nodes_hit = [set(row) for row in node.tolist()]
    ranks_hit = [set(row) for row in rank.tolist()]
    off = np.mean([len(h - {s // ranks_per_node}) for h, s in zip(nodes_hit, source.tolist())])
    # the forwarder of each node is the rank with the source's local index; it keeps its own copy
    local = source % ranks_per_node
    forwarded = np.mean([sum(1 for r in h if r % ranks_per_node != l) for h, l in zip(ranks_hit, local.tolist())])
    return off, forwarded, np.mean([len(h) for h in ranks_hit])


@pytest.mark.parametrize("reach", [4, 8])
def test_closed_form_against_monte_carlo(reach):
    """DeepSeek-V3's 256 experts over EP 64 on 8 nodes, top 8, limited to 4 nodes and not:
    experts.flex_spread's closed form within 1% of 200,000 sampled tokens."""
    model = load_model("deepseek-v3") if reach == 4 else _unlimited()
    spread = experts.flex_spread(load_system("dgx-h100"), model, columns_of(Plan(**PLAN)))
    off, forwarded, ranks = _monte_carlo(256, 4, 8, 8, reach, 8)
    assert float(spread["nodes"]) == 8
    assert float(spread["network"]) == pytest.approx(off, rel=0.01)
    assert float(spread["nvlink"]) == pytest.approx(forwarded, rel=0.01)
    assert float(spread["ranks"]) == pytest.approx(ranks, rel=0.01)


def test_expected_bins_by_hand():
    """(pool / bin) (1 - C(pool - bin, k) / C(pool, k)): 4 nodes of 32 experts, top 8."""
    hand = 4 * (1 - math.comb(96, 8) / math.comb(128, 8))
    assert experts.expected_bins_hit(128, 32, 8) == pytest.approx(hand, rel=1e-12)
    assert experts.expected_bins_hit(8, 1, 8) == 8  # every bin of one item hit
    assert experts.expected_bins_hit(256, 256, 8) == 1


def test_deepseek_dispatch_on_eight_nodes_by_hand():
    """One flex dispatch of a rank's 2048 tokens (mbs 1, seq 4096, tp 2 + SP) on dgx-h100: 3.175
    copies a token leave the node (4 nodes reached of 8, 7/8 of them another) over the NIC share
    50e9 x 0.94, 6.44 forwarded over NVLink 450e9 x 0.82; the network's 5 us. The all-to-all
    dispatcher sends 8 x 7/8 = 7 copies a token over the network, whatever the limit."""
    system = forced_balance(load_system("dgx-h100"))
    model = load_model("deepseek-v3")
    c = columns_of(Plan(**PLAN, moe_dispatcher="flex"))
    network = 4 * (1 - math.comb(96, 8) / math.comb(128, 8)) * 7 / 8
    nvlink = 32 * (1 - math.comb(124, 8) / math.comb(128, 8)) * 7 / 8
    tokens = 2 * 7168 * 2048
    one = max(tokens * network / (50e9 * 0.94), tokens * nvlink / (450e9 * 0.82)) + 5e-6
    assert float(experts.flex_time(system, tokens, experts.flex_spread(system, model, c))) == pytest.approx(one, rel=1e-12)
    comm = TopologyCommModel(system)
    assert float(experts.dispatch_times(system, comm, model, c)) == pytest.approx(2 * one, rel=1e-12)
    # the limit changes nothing under the all-to-all dispatcher (a copy per routed expert)
    free = _unlimited()
    a2a = columns_of(Plan(**PLAN))
    assert float(experts.dispatch_times(system, comm, model, a2a)) == float(experts.dispatch_times(system, comm, free, a2a))
    # and is most of flex's gain: unlimited, a token reaches 5.29 nodes, 4.63 of them another
    assert float(experts.flex_spread(system, free, c)["network"]) == pytest.approx(
        8 * (1 - math.comb(224, 8) / math.comb(256, 8)) * 7 / 8, rel=1e-12)


def _unlimited():
    """DeepSeek-V3 without node-limited routing."""
    return build_model("v3", {**PRESETS["deepseek-v3"], "routing_nodes": 0}, "test")


def test_step_with_flex_and_the_bytes_it_sends():
    """predict prices ep_comm lower with flex than with alltoall on DeepSeek-V3's EP 64; the bytes
    a step sends (traffic.step_sent_bytes' ep) are every rank's tokens x (network + NVLink copies)
    x hidden x 2 bytes, there and back, forward, backward and the recomputed forward, 58 MoE layers,
    32 micro-batches."""
    system = forced_balance(load_system("dgx-h100"))
    model = load_model("deepseek-v3")
    a2a, flex = (predict(model, system, Plan(**PLAN, moe_dispatcher=d)) for d in ("alltoall", "flex"))
    assert flex.time_breakdown_s["ep_comm"] < 0.5 * a2a.time_breakdown_s["ep_comm"]
    plan = Plan(**PLAN, moe_dispatcher="flex")
    network = 4 * (1 - math.comb(96, 8) / math.comb(128, 8)) * 7 / 8
    nvlink = 32 * (1 - math.comb(124, 8) / math.comb(128, 8)) * 7 / 8
    per_pass = 2 * 2 * 7168 * 2048 * (network + nvlink)
    assert step_sent_bytes(model, system, plan)["ep"] == pytest.approx(64 * 58 * 32 * 3 * per_pass, rel=1e-12)
    assert ep_all_to_all_bytes(model, plan) == 0.0  # no all-to-all


def test_routing_nodes_key_and_hugging_face_groups(tmp_path):
    assert load_model("deepseek-v3").routing_nodes == 4
    with pytest.raises(PerfsimError, match="routing_nodes needs experts"):
        load_model("layers=2,hidden=64,heads=4,seq=32,vocab=128,routing_nodes=2")
    from tests.test_hf_config import DEEPSEEK_V3

    def _write(folder, config, name):
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(json.dumps(config))
        return str(folder / name / "config.json")

    assert load_model(_write(tmp_path, DEEPSEEK_V3, "a")).routing_nodes == 4
    assert load_model(_write(tmp_path, {**DEEPSEEK_V3, "topk_group": 8}, "b")).routing_nodes == 0  # every group open
    with pytest.raises(PerfsimError, match="n_group 7 must divide n_routed_experts 256"):
        load_model(_write(tmp_path, {**DEEPSEEK_V3, "n_group": 7}, "c"))
    with pytest.raises(PerfsimError, match="topk_group 1 groups hold num_experts_per_tok 64"):
        load_model(_write(tmp_path, {**DEEPSEEK_V3, "topk_group": 1, "num_experts_per_tok": 64}, "d"))


def test_flex_plan_rules():
    model = load_model("qwen3-30b-a3b")
    assert any("flex (DeepEP) needs etp x ep of 2" in r
               for r in plan_problems(Plan(dp=2, ep=1, gbs=2, moe_dispatcher="flex"), model))
    assert not any("ep_overlap" in r for r in plan_problems(Plan(dp=8, ep=8, gbs=8, moe_dispatcher="flex",
                                                                 ep_overlap=True), model))
    assert any("ep_overlap" in r for r in plan_problems(Plan(dp=8, ep=8, gbs=8, moe_dispatcher="allgather",
                                                             ep_overlap=True), model))


def test_search_tries_flex():
    """The search's candidates hold flex (etp x ep > 1, overlapped or not) and read back as flex plans."""
    from perfsim.search import candidates, plan_at

    fixes = {"tp": {1}, "pp": {1}, "mbs": {1}, "recompute": {"none"}, "attention": {"flash"}, "zero": {1}}
    (mode, cols), = candidates(load_model("qwen3-30b-a3b"), 8, 8, fixes)
    flex = np.flatnonzero(cols["flex"])
    assert {cols["ep"][i] for i in flex} == {2, 4, 8} and {cols["ep_overlap"][i] for i in flex} == {0, 1}
    plans = [plan_at(mode, "tp-dp-pp", cols, i) for i in range(len(cols["flex"]))]
    assert {p.moe_dispatcher for p in plans} == {"alltoall", "allgather", "flex"}
    assert all((p.moe_dispatcher == "flex") == bool(f) for p, f in zip(plans, cols["flex"]))
