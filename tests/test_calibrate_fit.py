"""perfsim.calibrate on synthetic ledgers made from known profiles (no torch): the fit finds the
numbers back, holds out a quarter of the sizes, and writes a profile perfsim loads; and the
harness asks perfsim for the shapes it measures."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest

from perfsim import calibrate as cal
from perfsim.cost.layer import (Gemm, MemoryOp, gemm_time, head_memory_ops, layer_memory_ops, measured_memory_op,
                                memory_time)
from perfsim.cost.topology import TopologyCommModel
from perfsim.errors import PerfsimError
from perfsim.ledger import calibration_problem
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system
from validate import microbench as mb


def _truth():
    base = load_system("cpu-example")
    dev = dataclasses.replace(base.device, gemm_efficiency=0.6, gemm_half_dim=90.0, memory_bandwidth_Bps=20e9,
                              memory_efficiency=0.7, kernel_overhead_s=4e-6, peak_flops_bf16=200e9)
    node = dataclasses.replace(base.node, node_link_bandwidth_Bps=2e9, node_link_latency_s=80e-6)
    coll = dataclasses.replace(base.collectives, node_efficiency=1.0)
    return base, dataclasses.replace(base, device=dev, node=node, collectives=coll)


def synthetic_records(truth, noise=0.03, seed=1):
    """Records as validate/ writes them, with times from `truth` and multiplicative noise."""
    rng = np.random.default_rng(seed)
    jitter = lambda: float(np.exp(rng.normal(0, noise)))  # noqa: E731
    records = []

    def add(suite, op, dtype, shape, t, **extra):
        records.append({"schema": 1, "key": f"{suite}:{op}:{dtype}:{json.dumps(shape, sort_keys=True)}:{extra}",
                        "suite": suite, "op": op, "dtype": dtype, "shape": shape, "device": {"kind": "cpu"},
                        "stats": {"median_s": float(t) * jitter()}, **extra})

    dims = (64, 128, 256, 512, 1024, 2048)
    for dtype, peak in (("fp32", truth.device.peak_flops_fp32), ("bf16", truth.device.peak_flops_bf16)):
        for m, n, k in itertools.product(dims, repeat=3):
            add("gemm", "matmul", dtype, {"count": 1, "m": m, "n": n, "k": k},
                gemm_time(truth.device, peak, Gemm("g", 1, m, n, k)))
    for op in cal.ELEMENTWISE_OPS + cal.STREAM_OPS:
        for e in range(10, 26):
            n = 1 << e
            nbytes = mb.traffic_bytes(op, n, "fp32")
            t = memory_time(truth.device, MemoryOp(op, nbytes))
            if op in cal.STREAM_OPS:  # streaming reaches the full bandwidth
                t = nbytes / truth.device.memory_bandwidth_Bps + truth.device.kernel_overhead_s
            add("memory", op, "fp32", {"rows": max(1, n // 1024), "cols": min(n, 1024)}, t, nbytes=nbytes)
    comm = TopologyCommModel(truth)
    for op in cal.COLLECTIVE_OPS:
        for e in range(10, 27):
            n = 1 << e
            add("collective", op, "fp32", {"nbytes": n}, getattr(comm, op)(float(n), 2, 1), group=[2, 1], nbytes=n)
    return records


def test_fit_finds_the_profile_back_and_predicts_held_out_points(tmp_path):
    base, truth = _truth()
    records = synthetic_records(truth)
    calibration = cal.fit(records, base, "synthetic.jsonl")
    v = {k: f.value for k, f in calibration.values.items()}
    assert v["device.gemm_efficiency"] == pytest.approx(0.6, rel=0.05)
    assert v["device.gemm_half_dim"] == pytest.approx(90, rel=0.1)
    assert v["device.peak_flops_bf16"] == pytest.approx(200e9, rel=0.05)
    assert v["device.memory_bandwidth_Bps"] * v["device.memory_efficiency"] == pytest.approx(14e9, rel=0.05)
    assert v["device.memory_bandwidth_Bps"] == pytest.approx(20e9, rel=0.05)
    assert v["device.kernel_overhead_s"] == pytest.approx(4e-6, rel=0.2)
    bus = v["node.node_link_bandwidth_Bps"] * v["collectives.node_efficiency"]
    assert bus == pytest.approx(2e9, rel=0.05)
    assert v["node.node_link_latency_s"] == pytest.approx(80e-6, rel=0.15)
    rows = {q.name: q for q in calibration.quality}
    assert rows["gemm fp32"].held_points > 0 and rows["gemm fp32"].held_mape < 0.05 and rows["gemm fp32"].passed
    profile_row = next(q for name, q in rows.items() if name.startswith("collectives (profile"))
    assert profile_row.held_mape < 0.05 and profile_row.passed
    assert all(f.source and "synthetic.jsonl" in f.source for f in calibration.values.values())

    # the calibrated profile: loads, says "calibrated", names the ledger, keeps the rest
    base_path = base.path
    text = cal.calibrated_profile(base_path, calibration, "synthetic.jsonl", "cpu-test", "a test profile")
    out = tmp_path / "cpu-test.toml"
    out.write_text(text)
    system = load_system(str(out))
    assert system.name == "cpu-test"
    assert system.provenance["device.gemm_efficiency"][0] == "calibrated"
    assert "synthetic.jsonl" in system.provenance["device.gemm_efficiency"][1]
    assert system.provenance["device.peak_flops_fp32"] == base.provenance["device.peak_flops_fp32"]
    assert system.device.gemm_efficiency == pytest.approx(v["device.gemm_efficiency"], rel=1e-5)
    assert system.framework.zero_implementation == base.framework.zero_implementation == "fsdp2"  # a plain string kept
    assert text.startswith("# Calibrated by `perfsim calibrate`")


def test_held_out_is_a_quarter_of_the_sizes_and_the_same_for_every_op():
    records = synthetic_records(_truth()[1], noise=0)
    gemm = [r for r in records if r["suite"] == "gemm"]
    share = sum(cal.held_out(r) for r in gemm) / len(gemm)
    assert 0.15 < share < 0.35
    coll = [r for r in records if r["suite"] == "collective"]
    held_sizes = {r["shape"]["nbytes"] for r in coll if cal.held_out(r)}
    assert held_sizes and all(cal.held_out(r) == (r["shape"]["nbytes"] in held_sizes) for r in coll)


def test_fit_without_collectives_or_gemms_keeps_the_base():
    base, truth = _truth()
    memory_only = [r for r in synthetic_records(truth) if r["suite"] == "memory"]
    calibration = cal.fit(memory_only, base, "m.jsonl")
    assert "device.gemm_efficiency" not in calibration.values
    assert "node.node_link_bandwidth_Bps" not in calibration.values
    assert "device.memory_efficiency" in calibration.values


def test_fit_command_writes_a_loadable_profile(run_cli, tmp_path):
    _, truth = _truth()
    ledger = tmp_path / "synthetic.jsonl"
    ledger.write_text("".join(json.dumps(r) + "\n" for r in synthetic_records(truth)) + "{broken\n")
    out = tmp_path / "cpu-fitted.toml"
    r = run_cli("calibrate", "--fit", str(ledger), "--system", "cpu-example", "--out", str(out))
    assert r.code == 0, r.err
    assert "damaged" in r.err and "gemm fp32" in r.out and f"wrote {out}" in r.out
    system = load_system(str(out))
    assert system.name == "cpu-fitted" and "machine-specific" in system.description
    r = run_cli("predict", "--system", str(out), "--model", "gpt3-125m", "--devices", "2", "--tp", "2", "--json")
    assert r.code == 0, r.err


def test_memory_traffic_matches_perfsims_byte_counts():
    """The harness's bytes per element are perfsim's: its element counts times its traffic give
    back perfsim.cost.layer's bytes for every op perfsim models."""
    model = load_model("gpt3-350m")
    plan = Plan(tp=2, dp=1, mbs=2, gbs=2)
    ops = {op.name: float(op.nbytes) for op in layer_memory_ops(model, 2, 2, 1)}
    found = mb.plan_memory_ops(model, plan)
    assert {name for name, *_ in found} == set(mb.PERFSIM_MEMORY_OPS) & set(ops)
    for name, bench, elements, cols in found:
        assert mb.traffic_bytes(bench, elements, "bf16") == ops[name]
        assert elements % cols == 0


def test_head_and_kernel_traffic_follow_perfsims_conventions():
    """The loss and the final norm count as head_memory_ops counts them; a backward kernel moves
    MEMORY_BACKWARD x its forward's bytes."""
    model = load_model("gpt3-350m")
    tokens, vocab = 2 * model.seq, 50304
    head = {op.name: op for op in head_memory_ops(model, 2, 2, 1, vocab)}
    assert mb.traffic_bytes("cross_entropy", tokens * vocab // 2, "bf16") == head["cross_entropy"].nbytes
    assert mb.traffic_bytes(head["final_norm"].kind, tokens * model.hidden, "bf16") == head["final_norm"].nbytes
    for op in mb.BACKWARD_OPS + ("cross_entropy_backward",):
        forward = op.removesuffix("_backward")
        assert mb.traffic_bytes(op, 1000, "bf16") == 1.5 * mb.traffic_bytes(forward, 1000, "bf16")
        assert measured_memory_op(op, mb.traffic_bytes(op, 1000, "bf16"))[0].nbytes == mb.traffic_bytes(forward, 1000, "bf16")


def test_the_cpu_ledger_keeps_its_keys_and_a_campaign_adds_only_the_new_kernels():
    """The repository's CPU ledger loads, the campaign that wrote it (gpt3-350m, tp 2, two ranks,
    fp32 and bf16) still names every compute point it measured by the same key, and what a resumed
    campaign would measure is new kernels only (backward and loss kernels in bf16, the causal flash
    kernel, the plan's GEMMs at their backward products' shapes), with held-out sizes among them."""
    from profile_toml import HWPROFILES

    records, problems = cal.read_ledger(f"{HWPROFILES}/ledgers/calibration-cpu.jsonl")
    assert problems == [] and records
    points = mb.build_points("cpu", ("fp32", "bf16"), load_model("gpt3-350m"), Plan(tp=2, dp=1, mbs=1, gbs=1), 2, 2,
                             mb.default_sweep("cpu"))
    keys = {p.key("cpu", 2): p for p in points}
    measured = {r["key"] for r in records if r["suite"] != "collective"}
    # GEMMs timed the earlier ways (same operands every call; a cache flush per call) stay under
    # the keys those timings give the same points
    earlier = {dataclasses.replace(p, timing=t).key("cpu", 2) for p in points if p.suite == "gemm" for t in ("", "cold")}
    assert measured <= set(keys) | earlier
    forward = {(g[1:]) for g in mb.plan_gemms(load_model("gpt3-350m"), Plan(tp=2, dp=1, mbs=1, gbs=1))}
    backward_shapes = [p for p in keys.values() if p.suite == "gemm" and p.origin == "plan"
                       and tuple(p.dims[c] for c in ("count", "m", "n", "k")) not in forward]
    assert backward_shapes  # measured since perfsim prices backward products at their own shapes
    assert {k for k, p in keys.items() if p.suite == "gemm" and p not in backward_shapes} <= measured  # rotate-timed too
    new = [p for k, p in keys.items() if k not in measured and p.suite != "collective" and p not in backward_shapes]
    # the attention sweep has grown since (shapes the held-out hash holds out); its first shapes
    ledger_sweep = {(8, 256), (8, 512), (8, 1024)}
    new = [p for p in new if p.suite != "attention" or p.origin == "plan"
           or (p.dims["heads"], p.dims["seq"]) in ledger_sweep]
    kernels_since = mb.BACKWARD_OPS + mb.CROSS_ENTROPY_OPS  # in bf16, and the causal flash kernels in both dtypes
    assert all(p.op in kernels_since and p.dtype == "bf16" or p.op in ("flash", "flash_backward") for p in new)
    assert {p.op for p in new if p.suite == "attention"} == {"flash", "flash_backward"}
    kernels = [p for p in points if p.op in mb.BACKWARD_OPS + mb.CROSS_ENTROPY_OPS]
    assert {p.op for p in kernels} == set(mb.BACKWARD_OPS + mb.CROSS_ENTROPY_OPS)
    for op in mb.BACKWARD_OPS + mb.CROSS_ENTROPY_OPS:
        sizes = [p for p in kernels if p.op == op]
        held = sum(cal.held_out({"suite": "memory", "shape": p.dims}) for p in sizes)
        assert 1 <= held < len(sizes) / 2, op
    assert {p.origin for p in kernels if p.op in mb.BACKWARD_OPS} == {"plan", "sweep"}
    assert all(4096 <= p.dims["cols"] <= 8192 for p in kernels if p.op in mb.CROSS_ENTROPY_OPS)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_the_attention_sweep_holds_shapes_out(kind):
    """The flash kernels' tables get a held-out figure like every other kernel's: some of the
    attention sweep's shapes are held out by calibrate's hash, most are fitted."""
    points = mb.build_points(kind, ("fp32",), load_model("gpt3-350m"), Plan(tp=2, dp=1, mbs=1, gbs=1), 2, 2,
                             mb.default_sweep(kind), ("attention",))
    sweep = [p for p in points if p.op == "flash" and p.origin == "sweep"]
    held = [p for p in sweep if cal.held_out({"suite": "attention", "shape": p.dims})]
    assert 2 <= len(held) < len(sweep) / 2


def test_plan_shapes_come_from_perfsim():
    model = load_model("gpt3-350m")  # hidden 1024, 16 heads, seq 2048
    gemms = {g[0]: g[1:] for g in mb.plan_gemms(model, Plan(tp=2, dp=1, mbs=1, gbs=1))}
    assert gemms["qkv"] == (1, 2048, 1536, 1024) and gemms["fc2"] == (1, 2048, 1024, 2048)
    assert gemms["scores"] == (8, 2048, 2048, 64)
    assert mb.plan_attention(model, Plan(tp=2, dp=1, mbs=1, gbs=1)) == (8, 2048, 64)
    # context parallelism: a rank's s/cp tokens, the attention in cp x cp ring blocks of (s/cp)^2
    # (perfsim.cost.stage and docs/equations.md 11.2), its ring's group and the gradients' dp x cp group
    cp = {g[0]: g[1:] for g in mb.plan_gemms(model, Plan(tp=2, cp=2, dp=2, mbs=2, gbs=4))}
    assert cp["qkv"] == (1, 2048, 1536, 1024) and cp["scores"] == (32, 1024, 1024, 64)
    assert mb.plan_group_shapes(model, Plan(tp=2, cp=2, dp=2, mbs=2, gbs=4)) == [(2, 1), (2, 2), (2, 4), (4, 2)]
    # 2D tensor parallelism on a 2 x 2 grid, 2-way data parallel: both grid axes, then dp
    shapes = mb.plan_group_shapes(model, Plan(tp=4, tp_mode="2d", dp=2, mbs=2, gbs=4))
    assert sorted(shapes[:2]) == [(2, 1), (2, 2)] and shapes[2] == (2, 4)
    assert mb.groups_of(2, 2, 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mb.group_shapes(model, Plan(tp=8, dp=2, mbs=1, gbs=2), 16, 8) == [(8, 1), (2, 8), (16, 1), (2, 1)]


def test_points_have_stable_unique_keys():
    model = load_model("gpt3-350m")
    plan = Plan(tp=2, dp=1, mbs=1, gbs=1)
    sweep = mb.default_sweep("cpu", quick=True)
    points = mb.build_points("cpu", ("fp32", "bf16"), model, plan, 2, 2, sweep)
    keys = [p.key("cpu", 2) for p in points]
    assert len(set(keys)) == len(keys)
    again = mb.build_points("cpu", ("fp32", "bf16"), model, plan, 2, 2, sweep)
    assert [p.key("cpu", 2) for p in again] == keys
    assert {p.suite for p in points} == set(mb.SUITES)
    assert {p.op for p in points if p.suite == "collective"} == set(mb.COLLECTIVES)
    sizes = sorted({p.dims["nbytes"] for p in points if p.suite == "collective"})
    assert sizes[0] == 1024 and sizes[-1] == 1024 * 1024
    full = mb.default_sweep("cuda")
    assert full.collective_bytes[0] == 1024 and full.collective_bytes[-1] >= 256 * 1024 * 1024


def test_cpu_time_of_compute_points_is_fitted_unless_wall_is_asked():
    """A shared CPU box: the wall clock doubled by another process, the rank's CPU time true."""
    base, truth = _truth()
    records = [r for r in synthetic_records(truth) if r["suite"] == "gemm"]
    for r in records:
        t = r["stats"]["median_s"]
        r["stats"] = {"median_s": 2 * t, "min_s": 2 * t}
        r["cpu_stats"] = {"median_s": t, "min_s": t}
    auto = cal.fit(records, base, "shared.jsonl").values["device.gemm_efficiency"].value
    wall = cal.fit(records, base, "shared.jsonl", clock="wall").values["device.gemm_efficiency"].value
    assert auto == pytest.approx(0.6, rel=0.05) and wall == pytest.approx(0.3, rel=0.05)
    with pytest.raises(PerfsimError, match="statistic must be"):
        cal.fit(records, base, "x", statistic="max")


def test_multi_node_links_and_the_algorithm_rule_are_fitted():
    """Two SMNG-P2 nodes: card (MDFI), node (Xe Link) and network (InfiniBand) links are fitted
    each, and a base profile that fixes the wrong algorithm rule gets the measured one."""
    smng = load_system("smng-p2")
    truth = dataclasses.replace(smng, node=dataclasses.replace(smng.node, node_link_bandwidth_Bps=5e9,
                                                                node_link_latency_s=20e-6),
                                collectives=dataclasses.replace(smng.collectives, algorithm="ring",
                                                                network_efficiency=0.5))
    base = dataclasses.replace(smng, collectives=dataclasses.replace(smng.collectives, algorithm="tree"))
    comm = TopologyCommModel(truth)
    records = []
    for (size, stride), op, e in itertools.product([(2, 1), (8, 1), (4, 2), (2, 8)], cal.COLLECTIVE_OPS,
                                                   range(10, 29, 4)):
        n = 1 << e
        records.append({"schema": 1, "key": f"{size}/{stride}/{op}/{n}", "suite": "collective", "op": op,
                        "dtype": "bf16", "shape": {"nbytes": n}, "group": [size, stride], "nbytes": n,
                        "device": {"kind": "xpu"}, "stats": {"median_s": float(getattr(comm, op)(float(n), size, stride))}})
    calibration = cal.fit(records, base, "smng.jsonl")
    fitted = calibration.system
    assert calibration.values["collectives.algorithm"].value in ("ring", "auto")
    assert fitted.node.node_link_bandwidth_Bps * fitted.collectives.node_efficiency == pytest.approx(
        5e9 * smng.collectives.node_efficiency, rel=0.05)
    assert fitted.node.node_link_latency_s == pytest.approx(20e-6, rel=0.1)
    assert fitted.network.nic_bandwidth_Bps * fitted.collectives.network_efficiency == pytest.approx(
        smng.network.nic_bandwidth_Bps * 0.5, rel=0.05)
    assert fitted.provenance["collectives.network_efficiency"][0] == "calibrated"
    row = next(q for q in calibration.quality if q.name.startswith("collectives (profile"))
    assert row.held_mape < 0.05


def _with_factors(system, eff: dict, lat: dict):
    ops = cal.COLLECTIVE_OPS
    return dataclasses.replace(system, collectives=dataclasses.replace(
        system.collectives, operation_efficiency=tuple((op, eff[op]) for op in ops if op in eff),
        operation_latency_factor=tuple((op, lat[op]) for op in ops if op in lat)))


# gloo-like (docs/calibration.md): every operation its own speed, none reaching the link (the
# fitted profile puts the fastest at efficiency 1 and send/recv at latency factor 1)
GLOO_EFF = {"all_reduce": 0.25, "all_gather": 0.14, "reduce_scatter": 0.1, "broadcast": 0.6, "reduce": 0.3, "send": 0.8}
GLOO_LAT = {"all_reduce": 3.0, "all_gather": 4.0, "reduce_scatter": 8.0, "broadcast": 2.8, "reduce": 4.6, "send": 2.0}


def test_per_operation_factors_are_found_back_and_written(tmp_path):
    base, plain_truth = _truth()
    truth = _with_factors(plain_truth, GLOO_EFF, GLOO_LAT)
    records = [r for r in synthetic_records(truth) if r["suite"] == "collective"]
    calibration = cal.fit(records, base, "ops.jsonl")
    fitted, v = calibration.system, {k: f.value for k, f in calibration.values.items()}
    bus = fitted.node.node_link_bandwidth_Bps * fitted.collectives.node_efficiency
    latency = fitted.node.node_link_latency_s
    # normalised: the fastest op (send, 0.8) has efficiency 1, send's latency factor is 1 ...
    assert v["collectives.operation_efficiency.send"] == 1.0
    assert v["collectives.operation_latency_factor.send"] == pytest.approx(1.0)
    assert bus == pytest.approx(0.8 * 2e9, rel=0.05) and latency == pytest.approx(2.0 * 80e-6, rel=0.1)
    # ... and what each operation gets is the truth's
    for op in cal.COLLECTIVE_OPS:
        e, f, _ = fitted.collectives.operation_factors(op)
        assert (e, f) == (v[f"collectives.operation_efficiency.{op}"], v[f"collectives.operation_latency_factor.{op}"])
        assert bus * e == pytest.approx(2e9 * GLOO_EFF[op], rel=0.05), op
        assert latency * f == pytest.approx(80e-6 * GLOO_LAT[op], rel=0.15), op
    rows = {q.name: q for q in calibration.quality}
    profile = rows["collectives (profile: per link class x per-operation factors)"]
    assert profile.held_points > 0 and profile.held_mape < 0.05 and profile.passed
    assert rows["collectives (link classes alone, no operation factors)"].held_mape > 0.3  # what the factors buy
    assert all(rows[f"  {op}"].held_mape < 0.06 for op in cal.COLLECTIVE_OPS)

    text = cal.calibrated_profile(base.path, calibration, "ops.jsonl", "cpu-ops", "a test profile")
    out = tmp_path / "cpu-ops.toml"
    out.write_text(text)
    system = load_system(str(out))
    assert "[collectives.operation_efficiency.reduce_scatter]" in text and "[collectives.operation_efficiency]" not in text
    for op in cal.COLLECTIVE_OPS:
        for table in ("operation_efficiency", "operation_latency_factor"):
            kind, source = system.provenance[f"collectives.{table}.{op}"]
            assert kind == "calibrated" and "ops.jsonl" in source
    assert system.collectives.operation_factors("reduce_scatter") == pytest.approx(
        fitted.collectives.operation_factors("reduce_scatter"), rel=1e-5)
    # the written profile predicts the measurements as the fit did
    assert cal.mape(cal.collective_times(system, records), [r["stats"]["median_s"] for r in records]) < 0.05
    # fitting again from the calibrated profile (it has factors already) gives the same factors
    again = cal.fit(records, system, "ops.jsonl").system
    for op in cal.COLLECTIVE_OPS:
        assert again.collectives.operation_factors(op) == pytest.approx(fitted.collectives.operation_factors(op), rel=0.02)


# efficiencies of each kind and direction a synthetic CPU runs at (some above 1: in cache)
KIND_TRUTH = {"layernorm": 0.3, "softmax": 0.2, "gelu": 0.25, "add": 1.6, "dropout": 0.02, "cross_entropy": 0.5,
              "layernorm_backward": 0.18, "softmax_backward": 0.7, "gelu_backward": 0.22, "cross_entropy_backward": 0.05}


def kind_records(truth, noise=0.03, seed=2):
    """bf16 records of every kind in KIND_TRUTH at the CPU sweep's sizes, timed by `truth` with
    those efficiencies through perfsim's memory_time."""
    rng = np.random.default_rng(seed)
    sweep = mb.default_sweep("cpu")
    dev = dataclasses.replace(truth.device, operation_memory_efficiency=tuple(KIND_TRUTH.items()))
    records = []
    for name in KIND_TRUTH:
        if name.startswith("cross_entropy"):
            shapes = sweep.cross_entropy_shapes
        else:
            sizes = sweep.backward_elements if name.endswith("_backward") else sweep.memory_elements
            shapes = [(max(1, n // 1024), min(n, 1024)) for n in sizes]
        for rows, cols in shapes:
            nbytes = mb.traffic_bytes(name, rows * cols, "bf16")
            t = float(memory_time(dev, *measured_memory_op(name, nbytes))) * float(np.exp(rng.normal(0, noise)))
            records.append({"schema": 1, "key": f"memory:{name}:bf16:{rows}x{cols}", "suite": "memory", "op": name,
                            "dtype": "bf16", "shape": {"rows": rows, "cols": cols}, "device": {"kind": "cpu"},
                            "stats": {"median_s": t}, "nbytes": nbytes})
    return records


def test_per_kind_efficiencies_are_found_back_and_written(tmp_path):
    base, truth = _truth()
    records = synthetic_records(truth) + kind_records(truth)
    calibration = cal.fit(records, base, "kinds.jsonl")
    fitted = calibration.system.device
    assert fitted.memory_bandwidth_Bps == pytest.approx(20e9, rel=0.05)  # copy and triad
    kinds = dict(fitted.operation_memory_efficiency)
    assert set(kinds) == set(KIND_TRUTH)
    for name, efficiency in KIND_TRUTH.items():  # each kind's bandwidth is the truth's
        assert fitted.memory_bandwidth_Bps * kinds[name] == pytest.approx(20e9 * efficiency, rel=0.03), name
        assert calibration.values[f"device.operation_memory_efficiency.{name}"].value == kinds[name]
    rows = {q.name.split(":")[0]: q for q in calibration.quality}
    head = next(q for q in calibration.quality if q.name.startswith("memory: per kind"))
    assert head.held_points >= 10 and head.held_mape < 0.05 and head.fit_mape < 0.05
    one = float(head.note.split("held-out ")[1].rstrip("%")) / 100  # one memory_efficiency misses them widely
    assert one > 0.5
    assert all(rows[f"  {name}"].held_mape < 0.06 for name in KIND_TRUTH if rows[f"  {name}"].held_points)

    text = cal.calibrated_profile(base.path, calibration, "kinds.jsonl", "cpu-kinds", "a test profile")
    out = tmp_path / "cpu-kinds.toml"
    out.write_text(text)
    system = load_system(str(out))
    assert "[device.operation_memory_efficiency.cross_entropy_backward]" in text
    assert dict(system.device.operation_memory_efficiency) == pytest.approx(kinds, rel=1e-5)
    provenance, source = system.provenance["device.operation_memory_efficiency.softmax_backward"]
    assert provenance == "calibrated" and "kinds.jsonl" in source
    # the written profile predicts the kernels as measured; refitting from it gives the same
    kernels = [r for r in records if r["suite"] == "memory" and r["dtype"] == "bf16"]
    predicted = [float(memory_time(system.device, *measured_memory_op(r["op"], r["nbytes"]))) for r in kernels]
    assert cal.mape(predicted, [r["stats"]["median_s"] for r in kernels]) < 0.05
    again = dict(cal.fit(records, system, "kinds.jsonl").system.device.operation_memory_efficiency)
    assert again == pytest.approx(kinds, rel=0.02)


def test_one_measured_operation_writes_no_operation_factors():
    base, truth = _truth()
    records = [r for r in synthetic_records(truth) if r["suite"] == "collective" and r["op"] == "all_reduce"]
    calibration = cal.fit(records, base, "ar.jsonl")
    assert not any(".operation_" in key for key in calibration.values)
    assert calibration.system.collectives.operation_efficiency == ()
    row = next(q for q in calibration.quality if q.name.startswith("collectives (profile"))
    assert row.name == "collectives (profile: one bandwidth and latency per link class)" and row.held_mape < 0.05


def test_model_free_check_is_exact_on_a_power_law_and_sees_scatter():
    rows = [{"op": "all_reduce", "dtype": "fp32", "group": [2, 1], "nbytes": 1 << e, "_t": 1e-6 * (1 << e) ** 0.7}
            for e in range(10, 28)]
    fit, held = rows[::2], rows[1::2]
    q = cal.collectives.neighbour_check(fit, held[:-1])  # the last held point lies beyond the fitted ones: an edge
    assert q.held_mape == pytest.approx(0.0, abs=1e-12) and q.held_points == len(held) - 1
    assert q.fit_mape > 0  # the fitted points' own check leaves each out: the two ends are edges
    bumpy = [{**r, "_t": r["_t"] * (1.3 if i % 2 else 1.0)} for i, r in enumerate(rows)]
    assert cal.collectives.neighbour_check(bumpy[::2], bumpy[1::2][:-1]).held_mape == pytest.approx(0.3 / 1.3, rel=1e-9)


def test_fit_command_takes_a_name_and_description(run_cli, tmp_path):
    _, truth = _truth()
    ledger = tmp_path / "c.jsonl"
    ledger.write_text("".join(json.dumps(r) + "\n" for r in synthetic_records(truth) if r["suite"] == "collective"))
    out = tmp_path / "out.toml"
    r = run_cli("calibrate", "--fit", str(ledger), "--system", "cpu-example", "--out", str(out), "--name", "box",
                "--description", "the test box, two ranks")
    assert r.code == 0, r.err
    system = load_system(str(out))
    assert (system.name, system.description) == ("box", "the test box, two ranks")
    assert dict(system.collectives.operation_efficiency).keys() == set(cal.COLLECTIVE_OPS)
    assert "collectives.operation_efficiency.all_gather" in r.out and "model-free" in r.out


def test_cpu_collectives_are_timed_between_compute_in_both_dtypes_and_old_keys_stay():
    model, plan = load_model("gpt3-350m"), Plan(tp=2, dp=1, mbs=1, gbs=1)
    points = mb.build_points("cpu", ("fp32", "bf16"), model, plan, 2, 2, mb.default_sweep("cpu", quick=True))
    collectives = [p for p in points if p.suite == "collective"]
    assert {p.dtype for p in collectives} == {"fp32", "bf16"}
    # interleaved: the link fit's; concurrent (a few, beside a compute burst): the overlap efficiency's
    assert {p.timing for p in collectives} == {"interleaved", "concurrent"}
    assert {p.dtype for p in collectives if p.timing == "interleaved"} == {"fp32", "bf16"}
    p = collectives[0]
    assert p.timing == "interleaved"
    barrier_timed = dataclasses.replace(p, timing="")
    assert barrier_timed.key("cpu", 2) != p.key("cpu", 2)  # a new measurement, not a resumed one
    # the key of a barrier-timed point is what ledgers before the stream timing hold
    ident = {"device": "cpu", "world": 2, "suite": p.suite, "op": p.op, "dtype": p.dtype, "shape": p.dims,
             "group": list(p.group)}
    import hashlib

    text = json.dumps(ident, sort_keys=True, separators=(",", ":"))
    assert barrier_timed.key("cpu", 2) == f"{p.suite}:{p.op}:{p.dtype}:" + hashlib.sha1(text.encode()).hexdigest()[:16]


def test_fit_prefers_the_most_step_like_timing_and_bf16():
    base, truth = _truth()
    records = synthetic_records(truth)
    # the same collectives, 3x slower, timed back to back in bf16: those are what the fit must use
    extra = [dict(r, key=r["key"] + ":stream", dtype="bf16", timing="stream",
                  stats={"median_s": 3 * r["stats"]["median_s"]}) for r in records if r["suite"] == "collective"]
    calibration = cal.fit(records + extra, base, "synthetic.jsonl")
    assert any("stream-timed points" in n for n in calibration.notes)
    # interleaved (after a compute burst) is preferred over stream and barrier timings
    inter = [dict(r, key=r["key"] + ":interleaved", timing="interleaved") for r in extra]
    assert any("interleaved-timed points" in n for n in cal.fit(records + extra + inter, base, "s.jsonl").notes)
    comm = TopologyCommModel(calibration.system)
    for r in extra[::7]:
        t = getattr(comm, r["op"])(float(r["shape"]["nbytes"]), 2, 1)
        assert t == pytest.approx(r["stats"]["median_s"], rel=0.25), r["op"]


def test_step_overhead_is_the_mean_wait_beyond_the_fitted_repetition(tmp_path):
    """Interleaved-timed collectives whose mean repetition is the fastest one plus a wait w per
    operation (up to 16 MiB; more above, where it is bandwidth noise): a min fit writes w as
    collectives.operation_step_overhead_s.<op>; a mean fit, which has the wait in it, writes none."""
    base, truth = _truth()
    comm = TopologyCommModel(truth)
    waits = {"all_reduce": 2.5e-3, "all_gather": 1.5e-3, "send": 0.5e-3}
    records = []
    for op, w in waits.items():
        for e in range(10, 27):
            n, t = 1 << e, float(getattr(comm, op)(float(1 << e), 2, 1))
            extra = w if n <= cal.STEP_OVERHEAD_MAX_BYTES else 10 * w
            records.append({"schema": 1, "key": f"{op}:{n}", "suite": "collective", "op": op, "dtype": "bf16",
                            "shape": {"nbytes": n}, "group": [2, 1], "nbytes": n, "device": {"kind": "cpu"},
                            "timing": "interleaved",
                            "stats": {"min_s": t, "median_s": t + extra / 2, "mean_s": t + extra}})
    calibration = cal.fit(records, base, "waits.jsonl")
    v = {k: f.value for k, f in calibration.values.items()}
    for op, w in waits.items():
        assert v[f"collectives.operation_step_overhead_s.{op}"] == pytest.approx(w, rel=1e-9)
        assert calibration.system.collectives.operation_factors(op)[2] == pytest.approx(w, rel=1e-9)
    assert "collectives.operation_step_overhead_s.reduce" not in v
    assert any(q.name.startswith("collectives in a step") for q in calibration.quality)
    small = [r for r in records if r["nbytes"] <= cal.STEP_OVERHEAD_MAX_BYTES]
    # the link model plus the wait gives each point's mean back
    assert cal.collective_times(calibration.system, small) == pytest.approx([r["stats"]["mean_s"] for r in small],
                                                                             rel=1e-3)
    text = cal.calibrated_profile(base.path, calibration, "waits.jsonl", "cpu-waits", "a test profile")
    out = tmp_path / "cpu-waits.toml"
    out.write_text(text)
    system = load_system(str(out))
    assert system.collectives.operation_factors("all_gather")[2] == pytest.approx(1.5e-3)
    assert system.provenance["collectives.operation_step_overhead_s.all_gather"][0] == "calibrated"
    assert not any(k.startswith("collectives.operation_step_overhead_s")
                   for k in cal.fit(records, base, "waits.jsonl", statistic="mean").values)


def test_gemms_timed_with_rotated_operands_are_preferred_and_keep_new_keys():
    base, truth = _truth()
    records = synthetic_records(truth)
    gemms = [r for r in records if r["suite"] == "gemm"]
    # the same GEMMs 20% slower with rotated operands: those are what the fit uses
    rotated = [dict(r, key=r["key"] + ":rotate", timing="rotate", stats={"median_s": 1.2 * r["stats"]["median_s"]})
               for r in gemms]
    calibration = cal.fit(records + rotated, base, "rotate.jsonl")
    assert any("GEMMs fitted on their rotate-timed points" in n for n in calibration.notes)
    s = calibration.system
    for r in rotated[::37]:
        d = r["shape"]
        t = gemm_time(s.device, s.device.peak_flops_fp32 if r["dtype"] == "fp32" else s.device.peak_flops_bf16,
                      Gemm("g", 1, d["m"], d["n"], d["k"]))
        assert float(t) == pytest.approx(r["stats"]["median_s"], rel=0.15)
    model, plan = load_model("gpt3-350m"), Plan(tp=2, dp=1, mbs=1, gbs=1)
    points = [p for p in mb.build_points("cpu", ("bf16",), model, plan, 2, 2, mb.default_sweep("cpu", quick=True))
              if p.suite == "gemm"]
    assert {p.timing for p in points} == {mb.GEMM_TIMING}
    assert points[0].key("cpu", 2) != dataclasses.replace(points[0], timing="").key("cpu", 2)


def test_expected_statistic_fits_compute_means_and_collective_minima():
    """The default ("expected"): compute points at the mean of their repetitions (a step's time is
    the sum of its kernels), collectives' link model at their fastest repetition (the step
    overhead adds the mean's excess); "min" fits the fastest repetition everywhere."""
    base, truth = _truth()
    records = synthetic_records(truth, noise=0.0)
    for r in records:
        t = r["stats"]["median_s"]
        r["stats"] = {"median_s": 1.1 * t, "min_s": t, "mean_s": (1.25 if r["suite"] != "collective" else 1.5) * t}
    expected, fastest = cal.fit(records, base, "e.jsonl"), cal.fit(records, base, "e.jsonl", statistic="min")
    e, m = expected.system.device, fastest.system.device
    assert m.gemm_efficiency == pytest.approx(truth.device.gemm_efficiency, rel=0.03)
    assert e.peak_flops_fp32 * e.gemm_efficiency == pytest.approx(
        m.peak_flops_fp32 * m.gemm_efficiency / 1.25, rel=0.03)
    for s in (expected, fastest):  # the link model is the fastest repetition's either way
        assert s.system.node.node_link_latency_s == pytest.approx(fastest.system.node.node_link_latency_s, rel=1e-6)
    assert any("the mean of each compute point" in n for n in expected.notes)


def _overhead_record(op: str, seq: int, diffs: list) -> dict:
    return {"schema": 1, "key": f"tp_overhead:{op}:bf16:{seq}", "suite": "tp_overhead", "op": op, "dtype": "bf16",
            "shape": {"mbs": 1, "seq": seq, "hidden": 1024, "heads": 16}, "group": [2, 1], "origin": "plan",
            "stats": {"median_s": 0.06}, "reference_stats": {"median_s": 0.05}, "overhead_s": diffs}


def test_tp_overhead_points_give_the_median_of_every_rounds_difference():
    """Both layouts' keys from their points pooled over sequence lengths; a negative median (noise
    on a small overhead) reads as 0; a record without its rounds is refused."""
    records = [_overhead_record("1d", 64, [0.004, 0.006, 0.020]), _overhead_record("1d", 128, [0.008, -0.01]),
               _overhead_record("1d_sp", 64, [-0.003, -0.001, 0.002])]
    assert all(calibration_problem(r) is None for r in records)
    values, notes = cal.overheads.fit_tp_overhead(records, "l.jsonl")
    assert values["framework.tp_layer_overhead_s"].value == pytest.approx(0.006)  # median of 5 rounds
    assert values["framework.sp_layer_overhead_s"].value == 0.0
    assert "64 / 128 tokens" in values["framework.tp_layer_overhead_s"].source and len(notes) == 2
    assert cal.overheads.fit_tp_overhead([r for r in records if r["op"] == "1d"], "l")[0].keys() == {"framework.tp_layer_overhead_s"}
    broken = dict(records[0], overhead_s=[])
    assert "overhead_s" in calibration_problem(broken)


def test_tp_overhead_points_only_with_1d_tensor_parallelism():
    model = load_model("gpt3-350m")
    sweep = mb.default_sweep("cpu", quick=True)
    points = [p for p in mb.build_points("cpu", ("fp32", "bf16"), model, Plan(tp=2, dp=1, mbs=1, gbs=1), 2, 2, sweep)
              if p.suite == "tp_overhead"]
    assert sorted((p.op, p.dims["seq"]) for p in points) == [(op, s) for op in ("1d", "1d_sp") for s in (64, 128, 256)]
    assert all(p.dtype == "bf16" and p.group == (2, 1) and p.dims["hidden"] == 1024 for p in points)
    gpu = [p for p in mb.build_points("cuda", ("bf16",), model, Plan(tp=2, dp=1, mbs=1, gbs=1), 2, 2, sweep)
           if p.suite == "tp_overhead"]
    assert {p.dims["seq"] for p in gpu} == {model.seq}  # the model's own sequence on a GPU
    for plan in (Plan(tp=1, dp=2, mbs=1, gbs=2), Plan(tp=4, tp_mode="2d", mbs=1, gbs=1)):
        assert not [p for p in mb.build_points("cpu", ("bf16",), model, plan, plan.devices, plan.devices, sweep)
                    if p.suite == "tp_overhead"]


def test_a_kind_no_bandwidth_explains_keeps_memory_efficiency():
    """A kind whose points run faster than one kernel overhead (a quick campaign's lone tiny point)
    would fit an efficiency at the bound (1000 x the bandwidth) and price that kind absurdly fast
    everywhere; it is left out, with a note, and keeps memory_efficiency."""
    base, truth = _truth()
    records = synthetic_records(truth, noise=0.0)
    for r in records:
        if r["suite"] == "memory" and r["op"] == "layernorm":
            r["stats"]["median_s"] = 1e-9
    calibration = cal.fit(records, base, "fast.jsonl")
    assert "device.operation_memory_efficiency.layernorm" not in calibration.values
    assert "device.operation_memory_efficiency.softmax" in calibration.values
    assert any("ran into its bounds" in n and "layernorm" in n for n in calibration.notes)


def test_the_collective_notes_give_the_measurements_own_precision():
    """Held-out collectives cannot come closer than the points' means are known: the note gives the
    standard error of each point's mean (std_s is the population's, over `repeats` repetitions)."""
    from perfsim.calibrate.collectives import repetition_spread

    def record(mean, std, n):
        return {"nbytes": 1 << 20, "stats": {"min_s": mean / 2, "median_s": mean, "mean_s": mean, "std_s": std,
                                             "repeats": n}}
    # population std 0.3 over 10 repetitions: sample std 0.3 * sqrt(10/9), standard error that / sqrt(10)
    note = repetition_spread([record(1.0, 0.3, 10), record(2.0, 0.6, 10), record(1.0, 0.3, 10)])
    assert "known to 10.0% at best (standard error over single repetitions" in note
