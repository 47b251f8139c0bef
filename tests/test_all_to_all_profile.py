"""The all-to-all as one of the profile's collective operations (docs/equations.md 12.3): its
price with and without the profile's all_to_all factors, the fit recovering known factors from
synthetic points, and the bytes expert parallelism sends in a step (docs/equations.md 10.4)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from perfsim.cost import experts
from perfsim.cost.columns import columns_of
from perfsim.cost.topology import TopologyCommModel, all_to_all_line, clear_caches
from perfsim.cost.traffic import ep_all_to_all_bytes, step_sent_bytes
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

MOE = ("layers=2,hidden=64,heads=4,kv_heads=2,ffn=160,activation=swiglu,norm=rmsnorm,bias=false,"
       "learned_positions=false,seq=32,vocab=512,tied_embeddings=false,dropout=false,"
       "experts=4,topk=2,expert_ffn=32,shared_expert_ffn=64")


def with_all_to_all(system, efficiency, latency_factor, overhead):
    return replace(system, collectives=replace(system.collectives, operation_efficiency=(("all_to_all", efficiency),),
                                               operation_latency_factor=(("all_to_all", latency_factor),),
                                               operation_step_overhead_s=(("all_to_all", overhead),)))


def test_without_all_to_all_factors_the_price_is_the_link_formula_by_hand():
    """dgx-h100, 1e8 bytes: EP 8 in a node n 7/8 / (450e9 x 0.82) + 3 us; EP 32 over 4 nodes
    n 24/32 / (50e9 x 0.94) + 5 us (one device's share of its node's NICs); a group of one 0."""
    system = load_system("dgx-h100")
    comm = TopologyCommModel(system)
    n = 1e8
    assert comm.all_to_all(n, 8, 1) == pytest.approx(n * 7 / 8 / (450e9 * 0.82) + 3e-6, rel=1e-12)
    assert comm.all_to_all(n, 32, 1) == pytest.approx(n * 24 / 32 / (50e9 * 0.94) + 5e-6, rel=1e-12)
    assert comm.all_to_all(n, 1, 1) == 0.0
    assert all_to_all_line(system, 8, 2) == pytest.approx((4 / 8 / (50e9 * 0.94), 5e-6))  # 4 of 8 in a node
    assert experts.all_to_all_time(system, n, 8, 1) == comm.all_to_all(n, 8, 1)
    assert comm.algorithm("all_to_all", n, 8, 1) == "direct"


def test_all_to_all_factors_scale_the_bandwidth_and_latency_parts_and_add_the_step_overhead():
    """t = a n / e + f b + w for a group of two or more, 0 for a group of one."""
    base = load_system("dgx-h100")
    system = with_all_to_all(base, 0.5, 3.0, 1e-3)
    comm = TopologyCommModel(system)
    n = 1e8
    assert comm.all_to_all(n, 8, 1) == pytest.approx(n * 7 / 8 / (450e9 * 0.82 * 0.5) + 3 * 3e-6 + 1e-3, rel=1e-12)
    assert comm.all_to_all(n, 1, 1) == 0.0
    # the other operations are untouched
    assert comm.all_reduce(n, 8, 1) == TopologyCommModel(base).all_reduce(n, 8, 1)


def test_dispatch_prices_the_probabilities_all_to_all_beside_the_tokens():
    """All-to-all dispatcher, etp 1: two all-to-alls of the tokens and one of their probabilities
    (1/hidden of the tokens' bytes) each way."""
    model, system = load_model("qwen3-30b-a3b"), load_system("dgx-h100")
    c = columns_of(Plan(tp=1, pp=2, vpp=12, ep=8, mbs=1, gbs=1024, dp=8))
    comm = TopologyCommModel(system)
    sent = 2 * model.hidden * float(experts.dispatched_tokens(model, c))
    expected = 2 * comm.all_to_all(sent, 8, 1) + comm.all_to_all(sent / model.hidden, 8, 1)
    assert float(experts.dispatch_times(system, comm, model, c)) == pytest.approx(expected, rel=1e-12)


def test_the_fit_recovers_known_all_to_all_factors_from_synthetic_points():
    """Points priced on a profile with all_to_all efficiency 0.3, latency factor 4 and a 2 ms step
    overhead (the fastest repetition without it, the mean with it): the fit from the same links
    without the factors finds all three, and the other collectives' numbers are not touched."""
    from perfsim.calibrate.collectives import fit_all_to_all

    base = load_system("cpu-example")
    truth = with_all_to_all(base, 0.3, 4.0, 0.0)
    clear_caches()
    comm = TopologyCommModel(truth)
    records = []
    for i, n in enumerate(1 << k for k in range(10, 25, 2)):
        t = float(comm.all_to_all(n, 2, 1))
        records.append({"suite": "collective", "op": "all_to_all", "dtype": "bf16", "group": [2, 1], "nbytes": n,
                        "shape": {"nbytes": n}, "key": f"k{i}", "timing": "interleaved", "_t": t,
                        "stats": {"min_s": t, "mean_s": t + 2e-3, "median_s": t + 2e-3}})
    values, quality, _ = fit_all_to_all(records, base, "synthetic")
    assert values["collectives.operation_efficiency.all_to_all"].value == pytest.approx(0.3, rel=1e-4)
    assert values["collectives.operation_latency_factor.all_to_all"].value == pytest.approx(4.0, rel=1e-4)
    assert values["collectives.operation_step_overhead_s.all_to_all"].value == pytest.approx(2e-3, rel=1e-9)
    assert set(values) == {f"collectives.{t}.all_to_all" for t in
                           ("operation_efficiency", "operation_latency_factor", "operation_step_overhead_s")}
    assert quality[0].fit_mape == pytest.approx(0.0, abs=1e-6)
    assert fit_all_to_all([], base, "none") == ({}, [], [])


def test_step_bytes_of_the_ep_default_plans_by_hand():
    """The model above, bf16, cpu-example (4-byte gradients), 2 micro-batches of 2 sequences of
    32 tokens, top-2 of 4 experts, per rank:
    - EP 2 x dp 2: all-to-alls per layer, micro-batch and pass: tokens 128 copies x 64 x 2 bytes
      x 1/2 there and back (16384) and their probabilities 128 x 2 x 1/2 (128): 16512 x 2 passes
      x 2 layers x 2 micro-batches = 132096; the reduction: 115520 dense parameters all-reduced
      over dp 2 (4 bytes x 2 x 1/2 = 462080), the 24576 routed-expert parameters a rank holds
      (2 experts x 3 x 64 x 32 x 2 layers) not at all (expert-DP 1).
    - tp 2 + SP, ep 1, etp 1: no all-to-all; the 49152 routed-expert parameters reduced over
      expert-DP 2: 196608.
    - tp 2 + SP, ep 1, etp 2: 64 copies all-gathered and reduced-scattered over ETP and their
      probabilities gathered, (2 - 1) x 64 x 2 x (2 x 64 + 1) = 16512 a pass: 132096."""
    model, system = load_model(MOE), load_system("cpu-example")
    ep2 = step_sent_bytes(model, system, Plan(dp=2, ep=2, mbs=2, gbs=8), "bf16")
    assert ep2["ep"] == 2 * 132096 and ep2["dp"] == 2 * 462080
    assert ep_all_to_all_bytes(model, Plan(dp=2, ep=2, mbs=2, gbs=8)) == 16512
    folded = step_sent_bytes(model, system, Plan(tp=2, sp=True, ep=1, etp=1, mbs=2, gbs=4), "bf16")
    assert folded["dp"] == 2 * 196608 and folded["ep"] == 0
    etp = step_sent_bytes(model, system, Plan(tp=2, sp=True, ep=1, etp=2, mbs=2, gbs=4), "bf16")
    assert etp["ep"] == 2 * 132096 and etp["dp"] == 0
    # all-gather dispatcher, EP 2 x dp 2, per rank, layer and micro-batch: each pass the 64 tokens
    # gathered and the outputs reduce-scattered (2 x 8192) and the 128 copies' probabilities (256),
    # the forward the chosen experts (128 x 8): 274432 on both ranks, as the harness counts
    gathered = step_sent_bytes(model, system, Plan(dp=2, ep=2, mbs=2, gbs=8, moe_dispatcher="allgather"), "bf16")
    assert gathered["ep"] == 2 * 8 * (2 * 64 * 64 * 2 + 128 * 2) + 2 * 4 * 128 * 8
    dense = load_model(MOE.split(",experts=")[0])
    assert step_sent_bytes(dense, system, Plan(dp=2, mbs=2, gbs=8))["ep"] == 0


def test_the_probabilities_all_to_all_follows_the_tokens_and_pays_no_step_overhead():
    """The probabilities' call right after the tokens' (no compute between) pays its link time
    only: the dispatch is the profile without the step overhead plus that overhead twice, once for
    each token call; without a step overhead in the profile nothing changes."""
    model, base = load_model("qwen3-30b-a3b"), load_system("dgx-h100")
    c = columns_of(Plan(tp=1, pp=2, vpp=12, ep=8, mbs=1, gbs=1024, dp=8))
    w = 2e-3
    with_w = experts.dispatch_times(with_all_to_all(base, 0.5, 2.0, w), TopologyCommModel(with_all_to_all(base, 0.5, 2.0, w)),
                                    model, c)
    clear_caches()
    without = experts.dispatch_times(with_all_to_all(base, 0.5, 2.0, 0.0),
                                     TopologyCommModel(with_all_to_all(base, 0.5, 2.0, 0.0)), model, c)
    assert with_w == pytest.approx(without + 2 * w, rel=1e-12)
    comm = TopologyCommModel(with_all_to_all(base, 0.5, 2.0, w))
    assert experts.chained(comm, comm.all_to_all(1e3, 8, 1), "all_to_all", 8) == pytest.approx(
        TopologyCommModel(with_all_to_all(base, 0.5, 2.0, 0.0)).all_to_all(1e3, 8, 1), rel=1e-12)
    assert experts.chained(comm, 0.0, "all_to_all", 1) == 0.0
    plain = TopologyCommModel(base)
    assert experts.chained(plain, 1.5, "all_to_all", 8) == 1.5
