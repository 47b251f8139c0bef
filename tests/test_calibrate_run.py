"""`perfsim calibrate` for real on this machine's CPU (torch, gloo): a tiny 2-process collective
benchmark, a tiny GEMM sweep and its fit, a campaign killed half-way and resumed, and the
command's input errors."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from perfsim.calibrate import read_ledger
from perfsim.cost.layer import Gemm, backward_gemms
from perfsim.ledger import step_problem
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

torch = pytest.importorskip("torch")

from validate import microbench as mb  # noqa: E402
from validate.campaign import Options, run_worker  # noqa: E402


def worker_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def test_rotated_gemm_cycles_through_more_operands_than_the_cache_holds():
    """A "rotate" GEMM point's function uses a new copy of A, B and C on every call until the
    copies (ROTATING_BYTES together, at most MAX_COPIES) are used up, and computes the product."""
    from validate.device import Device

    point = mb.Point("gemm", "matmul", "fp32", (("count", 1), ("k", 64), ("m", 128), ("n", 256)), timing="rotate")
    fn = mb.make_compute(torch, Device("cpu", 0, 1), point)
    one = 4 * (128 * 64 + 64 * 256 + 128 * 256)
    copies = min(mb.MAX_COPIES, -(-mb.ROTATING_BYTES["cpu"] // one))
    outs = [fn() for _ in range(copies + 1)]
    assert len({o.data_ptr() for o in outs}) == copies and outs[copies].data_ptr() == outs[0].data_ptr()
    assert copies * one >= mb.ROTATING_BYTES["cpu"]
    a, b = outs[0], outs[1]  # every copy holds the same operands
    assert torch.equal(a, b) and a.shape == (128, 256)
    warm = mb.make_compute(torch, Device("cpu", 0, 1), dataclasses.replace(point, timing=""))
    assert warm().data_ptr() == warm().data_ptr()


@pytest.mark.multiprocess
def test_two_process_gloo_collectives(run_cli, tmp_path):
    ledger = tmp_path / "coll.jsonl"
    r = run_cli("calibrate", "--device", "cpu", "--nproc", "2", "--quick", "--suites", "collective",
                "--max-bytes", "16KiB", "--ledger", str(ledger), "--no-fit", "--model",
                "layers=2,hidden=64,heads=4,seq=32,vocab=256")
    assert r.code == 0, r.err
    records, problems = read_ledger(str(ledger))
    assert problems == []
    assert {x["op"] for x in records} == set(mb.COLLECTIVES)
    assert all("error" not in x for x in records), [x.get("error") for x in records]
    sizes = sorted({x["shape"]["nbytes"] for x in records})
    assert sizes == [1024, 2048, 4096, 8192, 16384]
    one = records[0]
    assert one["group"] == [2, 1] and one["world"] == 2 and one["backend"] == "gloo"
    assert one["device"]["kind"] == "cpu" and one["software"]["torch"] == torch.__version__
    assert one["stats"]["repeats"] >= 3 and one["stats"]["min_s"] <= one["stats"]["median_s"] <= one["stats"]["max_s"]
    assert "MASTER_PORT" in one["env"]


def test_tiny_gemm_sweep_and_fit(tmp_path, capsys):
    """One rank in-process: a tiny GEMM and memory sweep, then the fit writes a profile."""
    ledger = tmp_path / "gemm.jsonl"
    options = Options(device="cpu", ledger=str(ledger), model="layers=2,hidden=128,heads=4,seq=64,vocab=512",
                      plan={"tp": 1, "dp": 1, "gbs": 1}, dtypes=("fp32", "bf16"), suites=("gemm", "memory"),
                      quick=True, warmup=1, repeats=3, min_time_s=2e-4, threads=1)
    measured = run_worker(options, environ={})
    records, problems = read_ledger(str(ledger))
    assert problems == [] and len(records) == measured > 10
    gemm = [x for x in records if x["suite"] == "gemm"]
    assert {x["dtype"] for x in gemm} == {"fp32", "bf16"} and any(x["origin"] == "plan" for x in gemm)
    assert all(x["flops"] == 2 * x["shape"]["count"] * x["shape"]["m"] * x["shape"]["n"] * x["shape"]["k"] for x in gemm)
    # one-thread CPU ranks also record the CPU time they got (what the fit uses on a shared machine)
    assert all(0 < x["cpu_stats"]["min_s"] <= 1.5 * x["stats"]["max_s"] for x in records)
    # and the reference kernels' times right before each point (perfsim.calibrate.drift)
    assert all(set(x["reference_s"]) == {"gemm", "memory"} and min(x["reference_s"].values()) > 0 for x in records)
    assert run_worker(options, environ={}) == 0  # everything is in the ledger: nothing measured again
    # the backward kernels and the loss, in the dtype a step runs them in
    kernels = {x["op"] for x in records if x["suite"] == "memory" and x["dtype"] == "bf16"}
    assert set(mb.BACKWARD_OPS + mb.CROSS_ENTROPY_OPS) <= kernels
    assert not any(x["op"] in mb.BACKWARD_OPS + mb.CROSS_ENTROPY_OPS for x in records if x["dtype"] == "fp32")

    from perfsim.calibrate import fit_ledger
    out = tmp_path / "cpu-tiny.toml"
    calibration = fit_ledger(str(ledger), "cpu-example", str(out))
    assert {"device.gemm_efficiency", "device.gemm_half_dim", "device.kernel_overhead_s"} <= set(calibration.values)
    system = load_system(str(out))
    assert system.provenance["device.gemm_half_dim"] == ("calibrated", calibration.values["device.gemm_half_dim"].source)
    assert "gemm.jsonl" in system.provenance["device.gemm_efficiency"][1]
    # per-kind efficiencies, written and loaded back
    kinds = dict(system.device.operation_memory_efficiency)
    assert {"layernorm", "layernorm_backward", "cross_entropy", "cross_entropy_backward"} <= set(kinds)
    assert "gemm.jsonl" in system.provenance["device.operation_memory_efficiency.softmax_backward"][1]


@pytest.mark.multiprocess
def test_overheads_suite_trains_the_calibration_model_and_fits_the_loops_time(run_cli, tmp_path):
    """The `overheads` suite for real: real training steps of the calibration model (2 ranks,
    gloo, fp32) into LEDGER-overheads.jsonl, fitted into the three framework overhead keys."""
    from perfsim.calibrate.overheads import HOST_RUNS, QUICK_RUNS, is_host_run, overheads_ledger

    ledger, out = tmp_path / "cal.jsonl", tmp_path / "cal.toml"
    r = run_cli("calibrate", "--device", "cpu", "--nproc", "2", "--quick", "--suites", "gemm,overheads",
                "--dtypes", "fp32", "--tp", "1", "--model", "layers=2,hidden=64,heads=4,seq=32,vocab=256",
                "--ledger", str(ledger), "--out", str(out))
    assert r.code == 0, r.err
    steps, problems = read_ledger(overheads_ledger(str(ledger)), step_problem)
    runs = [x for x in steps if not x["measured"].get("alone")]
    host = [x for x in steps if is_host_run(x)]
    assert problems == [] and len(runs) == len(QUICK_RUNS) and len(steps) == len(QUICK_RUNS) + 1 + len(HOST_RUNS)
    assert len(host) == len(HOST_RUNS) and all(x["measured"]["alone"] and x["dtype"] == "fp32" for x in host)
    assert {(load_model(x["model"]).layers, Plan(**x["plan"]).microbatches) for x in runs} == set(QUICK_RUNS)
    assert "framework overheads (real steps of the calibration model)" in r.out
    system = load_system(str(out))
    for key in ("step_overhead_s", "microbatch_overhead_s", "layer_overhead_s"):
        kind, source = system.provenance[f"framework.{key}"]
        assert kind == "calibrated" and "cal-overheads.jsonl" in source
        assert getattr(system.framework, key) >= 0
    assert "host model" in system.provenance["framework.layer_overhead_s"][1]
    # the run alone on each rank: the ranks' spread, framework.rank_jitter
    kind, source = system.provenance["framework.rank_jitter"]
    assert kind == "calibrated" and "alone on each of 2 ranks" in source and 0 <= system.framework.rank_jitter < 1


@pytest.mark.parametrize("op", mb.BACKWARD_OPS + mb.CROSS_ENTROPY_OPS)
def test_backward_kernels_and_the_loss_run_and_count_perfsims_bytes(op):
    """Each kernel runs at a tiny size, returns what the step's kernel returns, and records the
    bytes perfsim counts: the kind's forward bytes, times MEMORY_BACKWARD for a backward kernel."""
    from perfsim.cost.layer import MEMORY_BACKWARD, kind_bytes
    from validate.device import Device

    rows, cols = 8, 256
    point = mb.Point("memory", op, "bf16", mb.point_shape(rows=rows, cols=cols))
    out = mb.make_compute(torch, Device("cpu"), point)()
    first = out[0] if isinstance(out, tuple) else out
    if op == "cross_entropy":  # the mean loss over the rows, in fp32
        assert first.dtype == torch.float32 and first.dim() == 0
    else:  # the input gradient, in the input's dtype
        assert first.shape == (rows, cols) and first.dtype == torch.bfloat16
    kind = op.removesuffix("_backward")
    forward = kind_bytes(kind, 2) * rows * cols
    assert mb.compute_counts(point)["nbytes"] == (MEMORY_BACKWARD * forward if op.endswith("_backward") else forward)
    assert isinstance(mb.compute_counts(point)["nbytes"], int)
    if op == "cross_entropy":
        assert mb.compute_counts(point)["nbytes"] == (2 + 4 * 4) * rows * cols  # perfsim.cost.layer.head_memory_ops


def _lines(path):
    try:
        with open(path, "rb") as fh:
            return fh.read().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.mark.multiprocess
def test_killed_half_way_and_resumed(tmp_path):
    """SIGKILL a campaign after a few records, damage its tail as a kill mid-write would, run the
    same command again: every point recorded exactly once."""
    ledger = tmp_path / "resume.jsonl"
    model = "layers=2,hidden=128,heads=4,seq=64,vocab=512"
    argv = [sys.executable, "-m", "perfsim.cli", "calibrate", "--worker", "--device", "cpu", "--quick",
            "--suites", "gemm,memory", "--dtypes", "fp32", "--ledger", str(ledger), "--model", model, "--tp", "1",
            "--min-time", "0.03", "--repeats", "2", "--warmup", "0", "--threads", "1"]
    proc = subprocess.Popen(argv, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while _lines(ledger) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before, _ = read_ledger(str(ledger))
    with open(ledger, "a") as fh:
        fh.write('{"schema": 1, "key": "gemm:matmul:fp32:0123')  # a record cut short by the kill
    done = subprocess.run(argv, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "damaged" in done.stderr and "already in" in done.stderr

    records, problems = read_ledger(str(ledger))
    assert len(problems) == 1
    keys = [json.loads(line)["key"] for line in ledger.read_text().splitlines() if line.startswith('{"schema":1')]
    assert len(keys) == len(set(keys)), "a point was recorded twice"
    expected = mb.build_points("cpu", ("fp32",), load_model(model), Plan(tp=1, dp=1, gbs=1), 1, 1,
                               mb.default_sweep("cpu", quick=True), ("gemm", "memory"))
    assert set(keys) == {p.key("cpu", 1) for p in expected}, "a point was lost"
    assert 4 <= len(before) < len(expected), "the kill did not land half-way"
    assert {r["key"] for r in before} <= set(keys)


@pytest.mark.parametrize("argv, message", [
    (("--device", "tpu"), "invalid choice: 'tpu'"),
    (("--device", "cuda", "--system", "dgx-a100"), "--device cuda:"),
    (("--device", "cpu", "--ledger", "/nonexistent/folder/l.jsonl"), "does not exist"),
    (("--device", "cpu", "--nproc", "3", "--tp", "2"), "not a multiple of tp x cp x pp"),
    (("--device", "cpu", "--nproc", "2", "--tp", "2", "--plans", "tp=2"), "give either --plans or plan flags"),
    (("--device", "cpu", "--nproc", "2", "--plans", "tp=2;cp=3"), "not a multiple of tp x cp x pp"),
    (("--device", "cpu", "--nproc", "2", "--plans", "tp=2,zeal=1"), "'zeal=1' is not FIELD=VALUE"),
    (("--emit-slurm", "x.sbatch", "--nodes", "1", "--plans", "tp=8"), "--plans is for campaigns on this machine"),
    (("--device", "cpu", "--nproc", "2", "--tp", "2", "--model", "layers=2,hidden=96,heads=3,seq=32,vocab=64"),
     "must divide the 3 attention heads"),
    (("--device", "cpu", "--system", "nosuch"), "unknown system 'nosuch'"),
    (("--emit-slurm", "x.sbatch"), "--emit-slurm needs --nodes"),
    ((), "give --device"),
])
def test_input_errors_exit_2(run_cli, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    r = run_cli("calibrate", *argv)
    assert r.code == 2 and r.err.startswith("perfsim: error: ") and message in r.err
    assert r.err.count("\n") == 1 and "Traceback" not in r.err


def test_backend_not_available_exits_2(run_cli, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.distributed, "is_gloo_available", lambda: False)
    r = run_cli("calibrate", "--device", "cpu", "--nproc", "2")
    assert r.code == 2 and "no gloo backend" in r.err


def test_the_flash_kernels_time_the_causal_fused_attention_a_flash_step_runs():
    """"flash" is the causal scaled_dot_product_attention of validate.gpt; "flash_backward" its
    backward alone (the gradients of Q, K and V), equal to autograd's through the same kernel."""
    from validate.device import Device

    shape = mb.point_shape(batch=1, heads=2, seq=16, head_dim=8)
    forward = mb.make_compute(torch, Device("cpu"), mb.Point("attention", "flash", "fp32", shape))()
    assert forward.shape == (1, 2, 16, 8)
    grads = mb.make_compute(torch, Device("cpu"), mb.Point("attention", "flash_backward", "fp32", shape))()
    assert len(grads) == 3 and all(g.shape == (1, 2, 16, 8) for g in grads)
    # causal: the first query sees only the first key, so its output is the first value exactly
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])
    assert {"flash", "flash_backward"} <= set(mb.ATTENTION_OPS)


def test_plans_measure_the_kernels_and_groups_of_each_plan_into_one_ledger(run_cli, tmp_path):
    """calibrate --plans: one campaign per plan, what they share measured once; a context-parallel
    plan's GEMMs are those of its s/cp tokens and ring blocks (perfsim.cost.stage), its cp group
    and the gradients' dp x cp group measured; plans that differ in nothing a kernel sees (here
    recompute) measure alike."""
    ledger = tmp_path / "plans.jsonl"
    model = "layers=2,hidden=64,heads=4,seq=32,vocab=256"
    r = run_cli("calibrate", "--device", "cpu", "--nproc", "2", "--quick", "--suites", "gemm,collective",
                "--max-bytes", "2KiB", "--dtypes", "fp32", "--ledger", str(ledger), "--no-fit", "--model", model,
                "--plans", "tp=2,mbs=2;tp=2,mbs=2,recompute=full;cp=2,mbs=2")
    assert r.code == 0, r.err
    assert "(1 of 2 plans)" in r.err and "(2 of 2 plans)" in r.err
    records, problems = read_ledger(str(ledger))
    assert problems == []
    keys = [x["key"] for x in records]
    assert len(keys) == len(set(keys)), "a shared point was measured twice"
    plan_gemms = {(x["shape"]["count"], x["shape"]["m"], x["shape"]["n"], x["shape"]["k"])
                  for x in records if x["suite"] == "gemm" and x.get("origin") == "plan"}
    tp2 = set(mb.plan_gemms(load_model(model), Plan(tp=2, mbs=2, gbs=2)))
    cp2 = set(mb.plan_gemms(load_model(model), Plan(cp=2, mbs=2, gbs=2)))
    # each forward GEMM and its backward's two products at their own shapes (perfsim.cost.layer.backward_gemms)
    shapes = {(g.count, g.m, g.n, g.k) for g in (Gemm(*x) for x in tp2 | cp2) for g in (g, *backward_gemms(g))}
    assert shapes == plan_gemms and {g[1:] for g in tp2 | cp2} < plan_gemms
    assert ("scores", 16, 16, 16, 16) in cp2  # mbs/cp x heads x cp^2 blocks of (s/cp)^2 x head_dim
    groups = {tuple(x["group"]) for x in records if x["suite"] == "collective"}
    assert (2, 1) in groups
