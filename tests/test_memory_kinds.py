"""Element-wise ops priced per kind and direction: the optional [device.operation_memory_efficiency]
table loads (or fails in one line), changes exactly the op and direction it names, and a profile
without it predicts bit for bit what perfsim predicted before the table existed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from perfsim.cost.layer import (KIND_TRAFFIC, MEMORY_BACKWARD, OP_KINDS, MemoryOp, head_memory_ops,
                                layer_memory_ops, measured_memory_op, memory_time, memory_times, work)
from perfsim.predict import predict
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import MEMORY_KINDS, MEMORY_OPERATIONS, load_system

from profile_toml import HWPROFILES, assert_one_line_error, profile_with


def _entry(kind, value, provenance="calibrated", source="a test: fitted on this machine"):
    return (f'[device.operation_memory_efficiency.{kind}]\nvalue = {value}\nprovenance = "{provenance}"\n'
            f'source = "{source}"\n\n')


def _with_table(system, **entries):
    table = tuple((name, entries[name]) for name in MEMORY_OPERATIONS if name in entries)
    return dataclasses.replace(system, device=dataclasses.replace(system.device, operation_memory_efficiency=table))


def test_the_table_loads_in_kind_order_with_provenance(tmp_path):
    path = profile_with(tmp_path, _entry("cross_entropy_backward", 0.05) + _entry("layernorm", 0.3)
                         + _entry("add", 2.5))  # above 1: a kind that runs in cache
    system = load_system(path)
    d = system.device
    assert d.operation_memory_efficiency == (("layernorm", 0.3), ("add", 2.5), ("cross_entropy_backward", 0.05))
    assert d.memory_efficiency_of("layernorm") == 0.3 and d.memory_efficiency_of("layernorm", backward=True) is None
    assert d.memory_efficiency_of("cross_entropy", backward=True) == 0.05
    assert d.memory_efficiency_of("") is None and d.memory_efficiency_of("softmax") is None
    assert system.provenance["device.operation_memory_efficiency.add"] == ("calibrated", "a test: fitted on this machine")
    assert load_system("cpu-example").device.operation_memory_efficiency == ()


@pytest.mark.parametrize("extra, words", [
    (_entry("layer_norm", 0.5), ["unknown kind device.operation_memory_efficiency.layer_norm",
                                 ", ".join(MEMORY_OPERATIONS)]),
    (_entry("gelu", 0), ["device.operation_memory_efficiency.gelu.value", "above 0"]),
    (_entry("softmax_backward", -1), ["device.operation_memory_efficiency.softmax_backward.value", "above 0"]),
    (_entry("add", '"fast"'), ["device.operation_memory_efficiency.add.value", "a number"]),
    (_entry("add", 0.5, provenance="guessed"), ["device.operation_memory_efficiency.add.provenance"]),
    ("[device.operation_memory_efficiency.dropout]\nvalue = 0.1\nprovenance = \"measured\"\n",
     ["device.operation_memory_efficiency.dropout has no source"]),
    ("[device.operation_memory_efficiency]\nlayernorm = 0.5\n",
     ["device.operation_memory_efficiency.layernorm must be a table"]),
])
def test_bad_tables_are_one_line_errors(tmp_path, capsys, extra, words):
    assert_one_line_error(capsys, profile_with(tmp_path, extra), words)


def test_a_number_where_the_table_belongs_is_an_error(tmp_path, capsys):
    from perfsim import cli
    with open(f"{HWPROFILES}/cpu-example.toml", encoding="utf-8") as fh:
        text = fh.read()
    path = tmp_path / "bad.toml"
    assert "[device]\nname = " in text
    path.write_text(text.replace("[device]\nname = ", "[device]\noperation_memory_efficiency = 0.5\nname = ", 1))
    assert cli.main(["predict", "--system", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "device.operation_memory_efficiency must be a table of kinds" in err


def test_kinds_and_their_traffic_are_one_list():
    assert set(KIND_TRAFFIC) == set(MEMORY_KINDS)
    assert set(OP_KINDS.values()) <= set(MEMORY_KINDS)
    model = load_model("gpt3-350m")
    ops = layer_memory_ops(model, 2, 2, 1) + head_memory_ops(model, 2, 2, 1, 50304)
    assert {op.name: op.kind for op in ops} == {name: OP_KINDS[name] for name in (op.name for op in ops)}
    llama = layer_memory_ops(load_model("llama2-7b"), 1, 1, 1)
    assert {op.name: op.kind for op in llama}["activation"] == "gelu"  # SwiGLU is priced as the gelu kind
    assert {op.name: op.kind for op in llama}["rotary"] == ""  # generic


@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100", "smng-p2", "v100-tacc", "cpu-example", "cpu-calibrated"])
def test_without_the_table_every_op_is_priced_as_before(name):
    """The formula perfsim used before the table: one efficiency, backward 1.5 x forward, bit for bit."""
    dev = load_system(name).device
    if dev.operation_memory_efficiency:
        pytest.skip("this profile has per-kind efficiencies")
    nbytes = np.array([1e3, 3.7e6, 1.2e9])
    for kind in ("",) + MEMORY_KINDS:
        op = MemoryOp("x", nbytes, kind)
        before = nbytes / (dev.memory_bandwidth_Bps * dev.memory_efficiency) + dev.kernel_overhead_s
        forward, backward = memory_times(dev, op)
        assert np.array_equal(forward, before) and np.array_equal(backward, MEMORY_BACKWARD * before)
        assert np.array_equal(memory_time(dev, op), before)
        assert np.array_equal(memory_time(dev, op, backward=True), MEMORY_BACKWARD * before)


@pytest.mark.parametrize("system, model, plan, step, compute", [
    ("dgx-a100", "gpt3-1.3b", Plan(tp=8, pp=4, dp=4, mbs=1, gbs=64), 0.22005196829953413, 0.11683425739478298),
    ("dgx-a100", "gpt3-13b", Plan(tp=8, sp=True, pp=2, vpp=2, schedule="interleaved", dp=2, mbs=1, gbs=32,
                                  recompute="full"), 1.9310322720948796, 0.9758464869816469),
    # dgx-h100 as since its kernel rates are one GPU's (the H200 ledger's GEMMs and table, 4.1 us a
    # kernel, causal flash 0.524) and a step on more than one GPU pays the named at-scale terms
    # (SM-bound kernels at 0.93 x 0.804, the gradient-buffer passes, 2.7 ms a step; docs/equations.md
    # 8.4-8.6): before, 1.849990246092489 and 1.201151957659957 (GEMM efficiency fitted to the
    # Megatron-LM H100 table, 0.58, commit 44f0064; an RMSNorm's one statistic, commit 70caede)
    ("dgx-h100", "llama2-7b", Plan(tp=4, tp_mode="2d", dp=2, mbs=2, gbs=16, recompute="selective"),
     1.5149367495504658, 0.9217606334871593),
    # ZeRO-3's step time as since its gathers go module by module (commit 8f6242d: 10.743062621494321
    # before, +7.4 ms of latency) and since smng-p2's 8 tiles wait for the slowest (rank_jitter 0.11 x
    # E[max of 8 normals], issue 30: 10.750442621494319 before); its compute as before the table
    ("smng-p2", "gpt3-13b", Plan(tp=2, dp=4, zero=3, mbs=4, gbs=32), 12.433919296163285, 4.13729340202433),
])
def test_gpu_predictions_are_bit_identical_to_before_the_table(system, model, plan, step, compute):
    """Numbers perfsim printed before per-kind pricing existed (commit 4fe9f31)."""
    p = predict(model, system, plan)
    assert p.step_time_s == step and p.time_breakdown_s["compute"] == compute


def test_an_entry_changes_exactly_its_kind_and_direction():
    plain = load_system("cpu-example")
    dev, bw, o = plain.device, plain.device.memory_bandwidth_Bps, plain.device.kernel_overhead_s
    model = load_model("gpt3-350m")
    ops = layer_memory_ops(model, 1, 1, 1) + head_memory_ops(model, 1, 1, 1, 50304)
    base = {op.name: memory_times(dev, op) for op in ops}
    forward_only = _with_table(plain, layernorm=0.2).device
    backward_only = _with_table(plain, cross_entropy_backward=0.01).device
    for op in ops:
        f, b = base[op.name]
        f1, b1 = memory_times(forward_only, op)
        f2, b2 = memory_times(backward_only, op)
        if op.kind == "layernorm":  # new forward; backward still 1.5 x (the new) forward
            assert f1 == pytest.approx(op.nbytes / (bw * 0.2) + o, rel=1e-12) and f1 > 2 * f
            assert b1 == MEMORY_BACKWARD * f1
        else:
            assert (f1, b1) == (f, b)
        if op.kind == "cross_entropy":  # forward untouched; backward moves 1.5 x the bytes at its own efficiency
            assert f2 == f and b2 == pytest.approx(MEMORY_BACKWARD * op.nbytes / (bw * 0.01) + o, rel=1e-12)
        else:
            assert (f2, b2) == (f, b)
    # through the work of a layer: only the two norms' forward (and their backward with it) change
    layer = layer_memory_ops(model, 1, 1, 1)
    w0, w1 = work(dev, 1e12, [], layer), work(forward_only, 1e12, [], layer)
    norms = [op for op in layer if op.kind == "layernorm"]
    extra = sum(memory_time(forward_only, op) - memory_time(dev, op) for op in norms)
    assert w1.time_s - w0.time_s == pytest.approx(extra, rel=1e-9)
    assert w1.backward_s - w0.backward_s == pytest.approx(MEMORY_BACKWARD * extra, rel=1e-9)


def test_a_backward_entry_reaches_the_prediction_and_arrays_still_work():
    plain = load_system("cpu-example")
    slow = _with_table(plain, cross_entropy_backward=0.001)
    model, plan = "layers=2,hidden=256,heads=4,seq=128,vocab=8192", Plan(tp=1, mbs=2, gbs=2)
    a, b = predict(model, plain, plan), predict(model, slow, plan)
    assert b.step_time_s > 1.5 * a.step_time_s and b.time_breakdown_s["tp_comm"] == a.time_breakdown_s["tp_comm"]
    nbytes = np.array([1e6, 2e6, 4e6])
    forward, backward = memory_times(slow.device, MemoryOp("cross_entropy", nbytes, "cross_entropy"))
    assert forward.shape == backward.shape == (3,) and np.all(np.diff(backward) > 0)


def test_measured_kernels_map_to_their_kind_and_direction():
    op, backward = measured_memory_op("softmax_backward", 300.0)
    assert (op.kind, op.nbytes, backward) == ("softmax", 200.0, True)  # recorded bytes are 1.5 x the forward's
    op, backward = measured_memory_op("cross_entropy", 18.0)
    assert (op.kind, op.nbytes, backward) == ("cross_entropy", 18.0, False)
    op, backward = measured_memory_op("copy", 8.0)
    assert (op.kind, backward) == ("", False)
