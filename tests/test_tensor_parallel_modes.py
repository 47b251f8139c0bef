"""Tensor-parallel modes against the closed forms of shared/reference/tensor-parallel.md.

Expected values are written out here from the reference's formulas, not taken from perfsim."""

import math

import pytest

import perfsim
from perfsim.cost import counts
from perfsim.cost import tensor_parallel as tpc
from perfsim.cost.collectives import CommModel
from perfsim.cost.columns import columns_of
from perfsim.spec.model import build_model

B = 2  # bytes per bf16 element
MODEL = build_model("t", dict(layers=8, hidden=1024, heads=16, seq=256, vocab=32000), "test")


def layout(mode, tp, mbs=16, depth=1, regather=False, **extra):
    plan = perfsim.Plan(tp=tp, tp_mode=mode, tp_depth=depth, mbs=mbs, gbs=mbs, tp_regather=regather, **extra)
    assert perfsim.plan_problems(plan, MODEL) == []
    return tpc.layout_of(MODEL, columns_of(plan)), plan


def linear_sent(lay, h_in, h_out, tokens, index=0):
    fwd, bwd = tpc.linear_collectives(lay, index, tokens, h_in, h_out)
    return tpc.collectives_sent_bytes(lay, fwd + bwd)


@pytest.mark.parametrize("q", [2, 4])
@pytest.mark.parametrize("shape", [(1024, 3072), (4096, 1024)])
def test_2d_linear_volume(q, shape):
    h_in, h_out = shape
    lay, plan = layout("2d", q * q, mbs=4 * q)
    tokens = plan.mbs * MODEL.seq
    expected = 3 * (q - 1) / q**2 * (tokens * h_in + h_in * h_out) * B
    assert float(linear_sent(lay, h_in, h_out, tokens)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("q", [2, 4])
@pytest.mark.parametrize("regather", [False, True])
def test_3d_linear_volume(q, regather):
    h_in, h_out = 1024, 4096
    lay, plan = layout("3d", q**3, mbs=q * q, regather=regather)
    tokens = plan.mbs * MODEL.seq
    expected = 2 * (q - 1) / q**3 * (tokens * h_in + tokens * h_out + h_in * h_out) * B
    if regather:  # the 2021 version gathers X and W again for backward
        expected += (q - 1) / q**3 * (tokens * h_in + h_in * h_out) * B
    for index in (0, 1):  # input and output axes swap roles; the volume does not change
        assert float(linear_sent(lay, h_in, h_out, tokens, index)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("q,d", [(2, 2), (2, 4), (4, 2)])
def test_2p5d_linear_volume(q, d):
    h_in, h_out = 1024, 1024
    lay, plan = layout("2.5d", q * q * d, mbs=q * d, depth=d)
    tokens = plan.mbs * MODEL.seq
    summa = 3 * (q - 1) / q**2 * (tokens / d * h_in + h_in * h_out) * B  # SUMMA on b/d rows
    depth_allreduce = 2 * (d - 1) / d * h_in * h_out / q**2 * B  # weight gradients over depth
    assert float(linear_sent(lay, h_in, h_out, tokens)) == pytest.approx(summa + depth_allreduce, rel=1e-12)


@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_1d_layer_volume(t, sp):
    lay, plan = layout("1d", t, mbs=2, sp=sp)
    fwd, bwd = tpc.layer_collectives(lay, MODEL, plan.mbs)
    tokens = plan.mbs * MODEL.seq
    expected = 8 * (t - 1) / t * tokens * MODEL.hidden * B  # 4 all-reduces of [b, h], or 8 AG/RS halves
    assert float(tpc.collectives_sent_bytes(lay, fwd + bwd)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode,tp,mbs,depth", [("1d", 4, 1, 1), ("2d", 4, 2, 1), ("2.5d", 8, 4, 2), ("3d", 8, 4, 1)])
def test_every_mode_splits_the_layer_flops_evenly(mode, tp, mbs, depth):
    lay, plan = layout(mode, tp, mbs=mbs, depth=depth)
    per_device = sum(2 * g.count * g.m * g.n * g.k for g in tpc.layer_gemms(lay, MODEL, mbs))
    total = sum(counts.layer_forward_flops(MODEL, mbs * MODEL.seq).values())
    assert float(per_device) * tp == pytest.approx(total, rel=1e-12)


def _same(a, b):
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
    for key, value in a.memory_bytes.items():
        assert value == pytest.approx(b.memory_bytes[key], rel=1e-12), key
    assert a.time_breakdown_s == pytest.approx(b.time_breakdown_s, rel=1e-12)


@pytest.mark.parametrize("system", ["dgx-a100", "smng-p2"])
def test_2p5d_with_depth_one_is_2d(system):
    for q in (2, 4):
        base = perfsim.Plan(tp=q * q, pp=2, mbs=q, gbs=8 * q, recompute="selective")
        _same(perfsim.predict(MODEL, system, base.replace(tp_mode="2.5d")),
              perfsim.predict(MODEL, system, base.replace(tp_mode="2d")))


@pytest.mark.parametrize("mode", ["2d", "2.5d", "3d"])
def test_one_device_in_any_mode_is_no_tensor_parallelism(mode):
    base = perfsim.Plan(tp=1, pp=2, dp=2, mbs=2, gbs=16, zero=1, recompute="full")
    _same(perfsim.predict(MODEL, "dgx-a100", base.replace(tp_mode=mode)), perfsim.predict(MODEL, "dgx-a100", base))


def test_axis_placement_puts_the_heaviest_axis_innermost():
    # Many tokens per micro-batch: activation traffic (input/output axes) outweighs weight traffic.
    lay, _ = layout("3d", 8, mbs=64)
    strides = {axis: int(stride) for axis, (size, stride) in lay.axes.items()}
    assert sorted(strides.values()) == [1, 2, 4]
    assert strides["weight"] == 4
    # A user-fixed order is followed as given, innermost first.
    fixed, _ = layout("3d", 8, mbs=64, tp_axes="weight-output-input")
    assert {a: int(s) for a, (_, s) in fixed.axes.items()} == {"weight": 1, "output": 2, "input": 4}


def test_placement_changes_predicted_time_only_through_links():
    base = perfsim.Plan(tp=8, tp_mode="3d", mbs=64, gbs=64)
    auto = perfsim.predict(MODEL, "smng-p2", base)
    worst = perfsim.predict(MODEL, "smng-p2", base.replace(tp_axes="weight-input-output"))
    assert auto.time_breakdown_s["tp_comm"] <= worst.time_breakdown_s["tp_comm"]
    assert auto.time_breakdown_s["compute"] == pytest.approx(worst.time_breakdown_s["compute"])


def test_smng_ring_over_one_node_and_data_parallel_group_across_nodes():
    system = perfsim.load_system("smng-p2")
    comm = CommModel(system)
    xe_link = system.node.node_link_bandwidth_Bps * system.collectives.node_efficiency
    bw, _ = comm.link(8, 1)  # the 8 tiles of one node: the ring crosses Xe Link
    assert float(bw) == pytest.approx(xe_link)
    bw, _ = comm.link(4, 8)  # one tile per node, all 8 tiles of every node sending at once
    assert float(bw) == pytest.approx(50e9 / 8 * system.collectives.network_efficiency)
    bw, _ = comm.link(2, 1)  # the two tiles of one card
    assert float(bw) == pytest.approx(system.node.card_link_bandwidth_Bps * system.collectives.card_efficiency)


@pytest.mark.parametrize("tp,mode,message", [
    (16, "3d", "needs a cube; 8, 27, 64 are allowed, got 16"),
    (8, "2d", "needs a square"),
    (12, "2.5d", "tp = q x q x depth"),
])
def test_grid_shape_errors(tp, mode, message):
    problems = perfsim.plan_problems(perfsim.Plan(tp=tp, tp_mode=mode, mbs=64, gbs=64), MODEL)
    assert any(message in p for p in problems), problems


def test_3d_needs_the_micro_batch_split_q_squared_ways():
    problems = perfsim.plan_problems(perfsim.Plan(tp=8, tp_mode="3d", mbs=2, gbs=2), MODEL)
    assert any("multiple of 4" in p for p in problems)


def test_3d_keeping_gathered_copies_costs_memory_and_saves_traffic():
    base = perfsim.Plan(tp=8, tp_mode="3d", mbs=4, gbs=4)
    keep = perfsim.predict(MODEL, "dgx-a100", base)
    regather = perfsim.predict(MODEL, "dgx-a100", base.replace(tp_regather=True))
    assert keep.memory_bytes["activations"] > regather.memory_bytes["activations"]
    assert keep.time_breakdown_s["tp_comm"] < regather.time_breakdown_s["tp_comm"]
    assert math.isclose(keep.model_flops_per_step, regather.model_flops_per_step)


# --- embedding and final norm of the multi-dimensional modes (docs/equations.md 4.7) ---------------

def _padded_vocab(tp):
    step = 128 * tp  # Megatron pads to a multiple of 128 t
    return -(-32000 // step) * step


def _by_axis_kind(lay, collectives):
    out = {}
    for x in collectives:
        sent = float(tpc.collectives_sent_bytes(lay, [x]))
        if sent:
            out[(x.axis, x.kind)] = out.get((x.axis, x.kind), 0.0) + sent
    return out


def _assert_same(got, expected):
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


@pytest.mark.parametrize("q", [2, 4])
def test_2d_embedding_reduce_scatters_the_lookups_and_gathers_their_gradient_on_col(q):
    lay, plan = layout("2d", q * q, mbs=2 * q)
    T, h = plan.mbs * MODEL.seq, MODEL.hidden
    fwd, bwd = tpc.embedding_collectives(lay, MODEL, plan.mbs)
    lookups = (q - 1) / q * T * h / q * B  # [T, h/q] partial sums over the q vocabulary blocks of a column
    _assert_same(_by_axis_kind(lay, fwd), {("col", "reduce_scatter"): lookups})
    _assert_same(_by_axis_kind(lay, bwd), {("col", "all_gather"): lookups})


@pytest.mark.parametrize("q,d", [(2, 2), (2, 4), (4, 2)])
def test_2p5d_embedding_adds_the_weight_gradient_all_reduce_over_depth(q, d):
    lay, plan = layout("2.5d", q * q * d, mbs=q * d, depth=d)
    T, h, V = plan.mbs * MODEL.seq, MODEL.hidden, _padded_vocab(q * q * d)
    fwd, bwd = tpc.embedding_collectives(lay, MODEL, plan.mbs)
    lookups = (q - 1) / q * (T / d) * (h / q) * B  # one depth slice's tokens
    weight_grad = 2 * (d - 1) / d * (V / q) * (h / q) * B  # [V/q, h/q], replicated over depth
    _assert_same(_by_axis_kind(lay, fwd), {("col", "reduce_scatter"): lookups})
    _assert_same(_by_axis_kind(lay, bwd), {("col", "all_gather"): lookups, ("depth", "all_reduce"): weight_grad})


@pytest.mark.parametrize("q", [2, 4])
@pytest.mark.parametrize("regather", [False, True])
def test_3d_embedding_gathers_the_weight_and_reduce_scatters_on_input(q, regather):
    lay, plan = layout("3d", q**3, mbs=q * q, regather=regather)
    T, h, V = plan.mbs * MODEL.seq, MODEL.hidden, _padded_vocab(q**3)
    fwd, bwd = tpc.embedding_collectives(lay, MODEL, plan.mbs)
    weight = (q - 1) / q * (V / q) * (h / q) * B  # [V/q^2, h/q] gathered to [V/q, h/q]
    lookups = (q - 1) / q * (T / q) * (h / q) * B  # [T/q, h/q] scattered to [T/q^2, h/q]
    _assert_same(_by_axis_kind(lay, fwd), {("weight", "all_gather"): weight, ("input", "reduce_scatter"): lookups})
    _assert_same(_by_axis_kind(lay, bwd), {("input", "all_gather"): lookups, ("weight", "reduce_scatter"): weight})
    # the closed form 2 (q-1)/q^3 (T h + V h)
    total = float(tpc.collectives_sent_bytes(lay, fwd + bwd))
    assert total == pytest.approx(2 * (q - 1) / q**3 * (T * h + V * h) * B, rel=1e-12)


@pytest.mark.parametrize("mode,tp,depth,expected", [("2d", 4, 1, 4096), ("2.5d", 8, 2, 34816), ("3d", 8, 1, 34816)])
def test_embedding_bytes_of_the_real_steps_model(mode, tp, depth, expected):
    """The small GPT of validate/multidim_check.py (h 64, s 16, V 512 padded to 128 P, 4 sequences),
    whose real steps sent these bytes (docs/real-steps-multidim.md). By hand: 2d q 2: 2 x 1/2 x
    64 x 32 x 2; 2.5d: 2 x 1/2 x 32 x 32 x 2 + 1/2 x 2 x 512 x 32 x 2 (V = 1024); 3d:
    2 x 1/8 x (64 x 64 + 1024 x 64) x 2."""
    model = build_model("small", dict(layers=2, hidden=64, heads=4, seq=16, vocab=512), "test")
    plan = perfsim.Plan(tp=tp, tp_mode=mode, tp_depth=depth, mbs=4, gbs=4)
    lay = tpc.layout_of(model, columns_of(plan))
    fwd, bwd = tpc.embedding_collectives(lay, model, 4)
    assert float(tpc.collectives_sent_bytes(lay, fwd + bwd)) == expected


@pytest.mark.parametrize("mode,tp,depth,axis,q", [("2d", 16, 1, "row", 4), ("2.5d", 8, 2, "row", 2), ("3d", 8, 1, "output", 2)])
def test_final_norm_all_reduces_its_statistics_each_way(mode, tp, depth, axis, q):
    lay, plan = layout(mode, tp, mbs=q * q * depth, depth=depth)
    T = plan.mbs * MODEL.seq
    vocab = _padded_vocab(tp)
    fwd, bwd = tpc.head_collectives(lay, MODEL, plan.mbs, vocab)
    linear_fwd, linear_bwd = tpc.linear_collectives(lay, 0, T, MODEL.hidden, vocab)
    norm = 2 * (q - 1) / q * 2 * 4 * T * q / tp  # fp32 sum and sum of squares of the device's T q / P tokens
    loss_axis = "input" if mode == "3d" else "row"
    loss = 2 * (q - 1) / q * 3 * 4 * T * q / tp
    expected_fwd = _by_axis_kind(lay, linear_fwd)
    expected_fwd[(axis, "all_reduce")] = expected_fwd.get((axis, "all_reduce"), 0.0) + norm
    expected_fwd[(loss_axis, "all_reduce")] = expected_fwd.get((loss_axis, "all_reduce"), 0.0) + loss
    expected_bwd = _by_axis_kind(lay, linear_bwd)
    expected_bwd[(axis, "all_reduce")] = expected_bwd.get((axis, "all_reduce"), 0.0) + norm
    _assert_same(_by_axis_kind(lay, fwd), expected_fwd)
    _assert_same(_by_axis_kind(lay, bwd), expected_bwd)


def test_1d_final_norm_issues_no_collective():
    lay, plan = layout("1d", 8, mbs=2)
    fwd, bwd = tpc.head_collectives(lay, MODEL, plan.mbs, _padded_vocab(8))
    T = plan.mbs * MODEL.seq
    sent = float(tpc.collectives_sent_bytes(lay, fwd + bwd))
    # the three loss all-reduces and the backward all-reduce of the head input, nothing else
    assert sent == pytest.approx(2 * 7 / 8 * (3 * 4 * T + B * T * MODEL.hidden), rel=1e-12)


@pytest.mark.parametrize("mode,tp,depth,shard", [("1d", 4, 1, None), ("2d", 4, 1, 4), ("2.5d", 8, 2, 4), ("3d", 8, 1, 8)])
def test_last_stage_holds_its_share_of_the_final_norm(mode, tp, depth, shard):
    from perfsim.cost.memory import stage_params

    h = MODEL.hidden
    plan = perfsim.Plan(tp=tp, tp_mode=mode, tp_depth=depth, pp=2, mbs=8, gbs=16)
    c = columns_of(plan)
    ends = float(stage_params(MODEL, c, "last") - stage_params(MODEL, c, "middle"))
    if shard is None:  # 1d: the final norm whole on every rank, the output layer split t ways
        assert ends == pytest.approx(2 * h + _padded_vocab(tp) * h / tp, rel=1e-12)
    else:
        assert ends == pytest.approx((2 * h + _padded_vocab(tp) * h) / shard, rel=1e-12)


@pytest.mark.parametrize("mode,tp,depth", [("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)])
def test_an_rmsnorm_all_reduces_one_statistic_each_way(mode, tp, depth):
    """A LayerNorm over a split hidden dimension all-reduces a token's sum and sum of squares
    (and two sums of its gradient); an RMSNorm its sum of squares (and one sum of the gradient
    times the normalised input): half the bytes, in the layer and in the final norm."""
    rms = build_model("rms", dict(layers=8, hidden=1024, heads=16, seq=256, vocab=32000, norm="rmsnorm"), "test")
    lay, plan = layout(mode, tp, mbs=4 * depth if mode != "3d" else 4, depth=depth)
    for model, stats in ((MODEL, 2), (rms, 1)):
        norm = tpc.norm_statistics(lay, model, plan.mbs * model.seq, 1)
        assert norm.nbytes == stats * 4 * plan.mbs * model.seq * lay.axes[norm.axis][0] / tp
        fwd, bwd = tpc.layer_collectives(lay, model, plan.mbs)
        assert [x.nbytes for x in fwd + bwd if x.kind == "all_reduce" and x.axis == norm.axis and x.count == 2] \
            == [norm.nbytes] * 2
