"""How a step runs on a GPU (issue 29): kernels apart from the host's time per call in the
microbenchmarks (perfsim.calibrate.host_bound), the host beside the device in a step
(perfsim.cost.host), the fused attention kernel's softmax cost (flash_score_s), and the harness's
own numerics under torch.autocast and its optimizer, gradient accumulation and gradients
(perfsim.calibrate.overheads.as_trained); docs/equations.md 3.5, 3.9, 3.12, 6.3, 6.4, 7.1, 7.2, 8.3."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from perfsim.calibrate import overheads as oh
from perfsim.calibrate.compute import fit_flash
from perfsim.calibrate.host_bound import HOST_BOUND, contained_host_bound, device_times, host_floor
from perfsim.cost.layer import FP32, flash_curve_times, head_memory_ops, layer_memory_ops
from perfsim.cost.memory import activation_bytes
from perfsim.predict import predict
from perfsim.schedule.simulator import predict_simulated
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

GPT = "layers=4,hidden=1024,heads=16,seq=1024,vocab=8192,tied_embeddings=false,dropout=false"


def _with(system, device=None, **framework):
    return dataclasses.replace(system, framework=dataclasses.replace(system.framework, **framework),
                               device=dataclasses.replace(system.device, **(device or {})))


# --- microbenchmarks on an asynchronous device ---

def _point(op, size, seconds, number=20, suite="memory", low=None):
    stats = {"mean_s": seconds, "median_s": seconds, "min_s": low or seconds, "number": number}
    return {"suite": suite, "op": op, "dtype": "bf16", "nbytes": size, "stats": stats, "_t": seconds}


def _kernel(size, floor=7e-6, rate=4e12):
    """A point as a GPU's back-to-back calls time it: the longer of the host's call and the kernel."""
    return max(floor, 2e-6 + size / rate)


def test_host_bound_points_are_left_out_on_a_gpu_and_kept_on_a_cpu():
    sizes = [2 ** e for e in range(14, 31)]
    records = [_point("gelu", n, _kernel(n)) for n in sizes]
    assert host_floor(records) == pytest.approx(7e-6)
    kept, notes = device_times(records, "cuda")
    assert kept and all(r["_t"] >= HOST_BOUND * 7e-6 for r in kept)
    assert len(kept) < len(records) and "gelu 7 us" in notes[0]
    # what is left follows the kernel alone: a fit through it finds the device's rate
    slope = np.polyfit([r["nbytes"] for r in kept], [r["_t"] for r in kept], 1)[0]
    assert 1 / slope == pytest.approx(4e12, rel=1e-6)
    assert device_times(records, "cpu") == (records, [])


def test_an_op_without_a_flat_floor_keeps_every_point():
    """A kernel every size of which outlasts the host (the cross-entropy of large logits): no floor."""
    records = [_point("cross_entropy", n, n / 2e12) for n in (56e6, 75e6, 150e6, 300e6)]
    assert host_floor(records) is None
    assert device_times(records, "cuda")[0] == records


def test_a_single_call_is_taken_less_the_host_floor_or_left_out():
    floor = [_point("flash", 2 ** e, 20e-6, suite="attention") for e in range(20, 26)]
    long = _point("flash", 2 ** 34, 72e-6, number=1, suite="attention", low=68e-6)
    short = _point("flash", 2 ** 28, 51e-6, number=1, suite="attention", low=47e-6)
    kept, _ = device_times(floor + [long, short], "xpu")
    assert [r["_t"] for r in kept] == [pytest.approx(52e-6)]  # the median less the floor; the short one gone


def _gemm_point(m, n, k, seconds, count=1, number=20):
    stats = {"mean_s": seconds, "median_s": seconds, "min_s": seconds, "number": number}
    return {"suite": "gemm", "op": "matmul", "dtype": "bf16", "shape": {"count": count, "m": m, "n": n, "k": k},
            "flops": 2.0 * count * m * n * k, "stats": stats, "_t": seconds}


def test_a_gemm_a_containing_gemm_outran_is_the_hosts():
    """Hand count: 2048 x 128 x 512 at 46 us is contained by 2048 x 512 x 512 (4 x its FLOPs) at 11.5
    us <= 1.15 x 46 us, so its time is the host's; 2048 x 2048 x 2048 at 26.6 us is contained by
    2048 x 2048 x 8192 (4 x) only at 92 us > 1.15 x 26.6: kept; 2048 x 2048 x 6144 at 63 us is
    contained by nothing of 2 x its FLOPs; 128 x 8192 x 8192 at 40 us is not contained by 8192 x
    8192 x 128 (k smaller), however fast; a single call is never judged by its time."""
    records = [_gemm_point(2048, 128, 512, 46e-6), _gemm_point(2048, 512, 512, 11.5e-6),
               _gemm_point(2048, 2048, 2048, 26.6e-6), _gemm_point(2048, 2048, 8192, 92e-6),
               _gemm_point(2048, 2048, 6144, 63e-6), _gemm_point(128, 8192, 8192, 40e-6),
               _gemm_point(8192, 8192, 128, 20e-6), _gemm_point(1024, 256, 512, 30e-6, number=1)]
    assert contained_host_bound(records) == {0}
    # a containing GEMM of under 2 x the FLOPs says nothing: 2048 x 128 x 768 at the same time
    assert contained_host_bound([_gemm_point(2048, 128, 512, 46e-6), _gemm_point(2048, 128, 768, 46e-6)]) == set()
    # on a GPU the contained point is left out, with a note; on a CPU nothing changes
    kept, notes = device_times(records[:6], "cuda")
    assert [r["shape"]["n"] for r in kept] == [512, 2048, 2048, 2048, 8192]
    assert any("1 more points above the floor" in note for note in notes)
    assert device_times(records, "cpu") == (records, [])


# --- the fused kernel's softmax ---

def _flash_record(op, heads, seq, head_dim, seconds):
    return {"suite": "attention", "op": op, "dtype": "bf16", "_t": seconds, "stats": {"mean_s": seconds},
            "shape": {"batch": 1, "heads": heads, "seq": seq, "head_dim": head_dim}}


def test_the_softmax_cost_per_score_is_found_from_two_head_dimensions():
    truth = _with(load_system("dgx-h100"), device={"flash_forward_efficiency": 0.45, "flash_score_s": 2.5e-13,
                                                    "flash_backward_efficiency": 0.3})
    peak = truth.device.peak_flops_bf16
    shapes = [(heads, seq, d) for heads in (8, 16, 32) for seq in (1024, 2048, 3072) for d in (64, 128)]
    records = [_flash_record(op, heads, seq, d, flash_curve_times(truth.device, peak, heads, seq, seq, d)[i])
               for i, op in enumerate(("flash", "flash_backward")) for heads, seq, d in shapes]
    values, quality, _, fitted = fit_flash(records, load_system("dgx-h100"), "cuda", "l.jsonl")
    for key in ("flash_forward_efficiency", "flash_score_s", "flash_backward_efficiency"):
        assert values[f"device.{key}"].value == pytest.approx(getattr(truth.device, key), rel=1e-6)
    assert all(q.fit_mape < 1e-6 for q in quality)
    # so a head dimension of 64 reaches less of peak than one of 128, as the H200's kernels did
    rate = lambda d: 2 * 1024 * 1024 * d / flash_curve_times(fitted.device, peak, 16, 1024, 1024, d)[0]  # noqa: E731
    assert rate(64) < rate(128)


def test_one_head_dimension_fits_one_efficiency_as_before():
    system = load_system("dgx-h100")
    records = [_flash_record("flash", heads, seq, 64, 5e-5) for heads, seq in ((8, 2048), (16, 2048), (32, 2048))]
    values, *_ = fit_flash(records, system, "cuda", "l.jsonl")
    assert "device.flash_score_s" not in values and 0 < values["device.flash_forward_efficiency"].value <= 1


# --- the host beside a GPU ---

ENGINES = {"analytic": predict, "sim": predict_simulated}


def predict_with_engine(model, system, plan, dtype, engine):
    return ENGINES[engine](model, system, plan, dtype)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_host_shows_only_where_it_outlasts_the_device(engine):
    model, plan = load_model(GPT), Plan(mbs=1, gbs=4)
    base = _with(load_system("dgx-h100"), step_overhead_s=0.0)
    kernels = predict_with_engine(model, base, plan, "bf16", engine).step_time_s
    per_microbatch = (kernels - predict(model, base, plan).time_breakdown_s["optimizer"]) / 4
    for layer_host in (0.1 * per_microbatch / 4, 10 * per_microbatch / 4):
        host = layer_host * 4  # four layers
        serial = _with(base, layer_overhead_s=layer_host)
        overlapped = _with(serial, host_overlap=1.0)
        assert predict_with_engine(model, serial, plan, "bf16", engine).step_time_s == pytest.approx(kernels + 4 * host)
        shown = predict_with_engine(model, overlapped, plan, "bf16", engine).step_time_s
        assert shown == pytest.approx(kernels + 4 * max(host - per_microbatch, 0.0), rel=1e-9)


def test_the_step_overhead_hides_behind_the_optimizer_with_host_overlap():
    model, plan = load_model(GPT), Plan(mbs=1, gbs=4)
    system = _with(load_system("dgx-h100"), host_overlap=1.0)
    optimizer = predict(model, system, plan).time_breakdown_s["optimizer"]
    for step in (0.5 * optimizer, 2 * optimizer):
        other = predict(model, _with(system, step_overhead_s=step), plan).time_breakdown_s["other"]
        assert other == pytest.approx(max(step - optimizer, 0.0))


def test_a_gpu_calibration_fits_the_host_time_without_subtracting_the_kernels():
    system = _with(load_system("dgx-h100"), host_overlap=1.0)
    truth = {"step_overhead_s": 0.003, "microbatch_overhead_s": 0.0012, "layer_overhead_s": 0.0014}
    records = []
    for model, plans in oh.overhead_cases(1):
        for plan in plans:
            t = predict(model, oh.as_trained(_with(system, **truth), "bf16", "cuda"), plan, "bf16").step_time_s
            records.append({"suite": "step", "model": model, "plan": plan.as_dict(), "dtype": "bf16",
                            "measured": {"step_time_s": t, "device": {"kind": "cuda"}}})
    values, quality, _ = oh.fit_framework_overheads(records, system, "steps.jsonl")
    for key, value in truth.items():
        assert values[f"framework.{key}"].value == pytest.approx(value, rel=0.02)
    assert quality[0].held_mape < 0.02


# --- the harness's numerics under autocast ---

def test_autocast_runs_norms_and_softmax_in_fp32_between_casts():
    model = load_model(GPT)
    plain = {op.name: op for op in layer_memory_ops(model, 2, 1, 1)}
    mixed = {op.name: op for op in layer_memory_ops(model, 2, 1, 1, autocast=1)}
    region, scores = 2 * 1024 * 1024, 2 * 16 * 1024 * 1024
    for name, elements in (("norm1", region), ("norm2", region), ("softmax", scores)):
        assert mixed[name].nbytes == 2 * plain[name].nbytes  # the same two passes, 4-byte elements
        for cast in (f"{name}_to_fp32", f"{name}_from_fp32"):
            assert mixed[cast].nbytes == (2 + FP32) * elements and cast not in plain
    assert mixed["activation"] == plain["activation"] and mixed["residual1"] == plain["residual1"]
    head = {op.name for op in head_memory_ops(model, 2, 1, 1, 8192, autocast=1)}
    assert {"final_norm_to_fp32", "final_norm_from_fp32"} <= head


def test_autocast_keeps_the_fp32_copies_for_backward():
    model = load_model(GPT)
    s, b, h, a = 1024, 2, 1024, 16
    for recompute, flash, extra in ((0, 0, 2 * 2 * s * b * h + 4 * a * s * s * b), (0, 1, 2 * 2 * s * b * h),
                                    (1, 0, 2 * 2 * s * b * h)):  # 1: selective drops the scores either way
        kept = activation_bytes(model, b, 1, 1, recompute, flash=flash, autocast=1)
        assert kept - activation_bytes(model, b, 1, 1, recompute, flash=flash) == extra


# --- the harness's optimizer, gradient accumulation and gradients ---

def test_master_adam_moves_the_bytes_a_dispatch_count_finds():
    """An independent count: the kernels the optimizer's step dispatches, each reading its tensor
    inputs and writing its outputs and the inputs it mutates (a copy's destination is written, not
    read; views such as detach move nothing), for a parameter of 1,000 elements."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    from validate.optim import MasterAdam

    def tensors(xs):
        out = []
        for x in xs:
            out += [t for t in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(t, torch.Tensor) and t.dim()]
        return out

    class Bytes(TorchDispatchMode):
        total, ops = 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            schema = func._schema.arguments
            # the fused AdamW's schema marks its gradients mutable (it unscales them in place when
            # given a grad_scale, which MasterAdam does not): here they are only read
            mutated = [args[i] for i, a in enumerate(schema[:len(args)]) if a.alias_info and a.alias_info.is_write
                       and not (func.__name__.startswith("_fused_adamw_") and a.name == "grads")]
            inputs = tensors(args)
            results = [t for t in tensors(out if isinstance(out, (list, tuple)) else [out])
                       if not any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in inputs)]
            if not mutated and not results:  # a view: no kernel
                return out
            written = tensors(mutated) + results
            read = [t for t in inputs if not (func.__name__.startswith("copy_") and any(t is w for w in written))]
            Bytes.ops.append(func.__name__)
            Bytes.total += sum(t.numel() * t.element_size() for t in read + written)
            return out

    for dtype, element in ((torch.bfloat16, 2), (torch.float32, 4)):
        p = torch.nn.Parameter(torch.ones(1000, dtype=dtype))
        p.grad = torch.ones(1000, dtype=dtype)
        optimizer = MasterAdam([p])
        optimizer.init_states()
        Bytes.total, Bytes.ops = 0, []
        with Bytes():
            optimizer.step()
        assert Bytes.total == 1000 * oh.master_adam_bytes(element), Bytes.ops


def test_gradient_accumulation_adds_a_pass_per_micro_batch_after_the_first():
    model = load_model(GPT)
    system = oh.as_trained(load_system("dgx-h100"), "bf16", "cuda")
    none = dataclasses.replace(system.framework, grad_accumulation_bytes_per_param=0.0)
    for gbs, passes in ((1, 0), (4, 3)):
        plan = Plan(mbs=1, gbs=gbs)
        with_passes = predict(model, system, plan).step_time_s
        without = predict(model, dataclasses.replace(system, framework=none), plan).step_time_s
        params = predict(model, system, plan).memory_bytes["weights"] / 2
        seconds = passes * 3 * 2 * params / (system.device.memory_bandwidth_Bps * system.device.memory_efficiency)
        assert with_passes - without == pytest.approx(seconds, rel=0.05, abs=1e-9)


def test_gradients_freed_every_step_are_not_at_the_peak_of_a_single_micro_batch():
    model = load_model(GPT)
    system = oh.as_trained(load_system("dgx-h100"), "bf16", "cuda")
    held = dataclasses.replace(system, framework=dataclasses.replace(system.framework, grads_set_to_none=0.0))
    assert predict(model, system, Plan(mbs=2, gbs=2)).memory_bytes["gradients"] == 0
    assert predict(model, held, Plan(mbs=2, gbs=2)).memory_bytes["gradients"] > 0
    assert predict(model, system, Plan(mbs=2, gbs=4)).memory_bytes["gradients"] > 0  # the first one's, at the second


def test_the_harness_is_priced_as_it_trains_on_each_device():
    cpu, gpu = (oh.as_trained(load_system("dgx-h100"), "bf16", kind).framework for kind in ("cpu", "cuda"))
    assert (cpu.host_overlap, cpu.autocast) == (0.0, 0.0) and (gpu.host_overlap, gpu.autocast) == (1.0, 1.0)
    assert oh.as_trained(load_system("dgx-h100"), "fp32", "cuda").framework.autocast == 0.0  # fp32: no autocast
    assert cpu.optimizer_bytes_per_param == 40 and cpu.grad_accumulation_bytes_per_param == 6


# --- the host's time per layer, by what the layer dispatches ---

# Layers the host tables must price: GPT, each Llama feature alone, their mixes, MoE layers
# (one device; expert parallelism's are tests/test_validate_moe.py's)
LAYER_VARIANTS = ("", ",activation=swiglu", ",activation=squared-relu,norm=rmsnorm", ",bias=false",
                  ",learned_positions=false", ",kv_heads=2", ",learned_positions=false,kv_heads=2,activation=swiglu",
                  ",activation=swiglu,norm=rmsnorm,bias=false,learned_positions=false,kv_heads=2",
                  ",activation=swiglu,norm=rmsnorm,bias=false,learned_positions=false,kv_heads=2,experts=4,topk=2,"
                  "expert_ffn=16,shared_expert_ffn=32",
                  ",bias=false,experts=2,topk=1,expert_ffn=16", ",activation=squared-relu,bias=false,experts=3,topk=2,expert_ffn=8")


def test_the_harness_layer_dispatches_the_ops_perfsim_scales_its_host_time_by():
    torch = pytest.importorskip("torch")

    from perfsim.cost.columns import columns_of
    from perfsim.cost.host import HARNESS_LAYER_OPS, harness_layer_ops
    from validate.gpt import GPT, GPTConfig
    from validate.instrument import OpCounter

    def ops(spec, recompute, attention):  # in bf16, the dtype the tables are counted in
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_spec(load_model(spec), 1, recompute, attention)).to(torch.bfloat16)
        tokens = torch.randint(0, 256, (1, 16))
        model.loss(tokens, tokens).backward()  # one-off work (the causal mask, built once per shape)
        with OpCounter() as counter:
            model.loss(tokens, tokens).backward()
        return counter.ops

    base = "hidden=32,heads=4,seq=16,vocab=256,tied_embeddings=false,dropout=false"
    for attention, counts in HARNESS_LAYER_OPS.items():  # the calibration model's layer
        calibration = oh.CALIBRATION_MODEL.format(layers="{}")
        assert tuple(ops(calibration.format(2), rc, attention) - ops(calibration.format(1), rc, attention)
                     for rc in ("none", "selective", "full")) == counts
    for variant in LAYER_VARIANTS:
        for attention in ("unfused", "flash"):
            for code, rc in enumerate(("none", "selective", "full")):
                counted = ops(f"layers=2,{base}{variant}", rc, attention) - ops(f"layers=1,{base}{variant}", rc, attention)
                model = load_model(f"layers=2,{base}{variant}")
                priced = harness_layer_ops(model, columns_of(Plan(mbs=1, gbs=1, attention=attention, recompute=rc)), code)
                assert counted == priced, (variant, attention, rc)


def test_the_host_time_of_a_layer_follows_its_ops():
    model = load_model(GPT)
    system = _with(load_system("dgx-h100"), layer_overhead_s=1e-3, step_overhead_s=0.0)
    base = predict(model, system, Plan(mbs=1, gbs=1))
    kernels = predict(model, _with(system, layer_overhead_s=0.0), Plan(mbs=1, gbs=1))
    assert base.step_time_s - kernels.step_time_s == pytest.approx(4 * 1e-3)
    for attention, recompute, ops in (("flash", "none", 93), ("unfused", "full", 189), ("flash", "selective", 100)):
        plan = Plan(mbs=1, gbs=1, attention=attention, recompute=recompute)
        host = predict(model, system, plan).step_time_s - predict(model, _with(system, layer_overhead_s=0.0), plan).step_time_s
        assert host == pytest.approx(4 * 1e-3 * ops / 116)


def test_autocasts_fp32_kernels_are_measured_on_a_gpu_and_priced_by_their_own_tables():
    from perfsim.cost.layer import MemoryOp, memory_times
    from perfsim.cost.measured import KernelTable
    from validate import microbench as mb

    model, plan = load_model(GPT), Plan(mbs=2, gbs=2)
    for kind, expected in (("cuda", {"layernorm", "layernorm_backward", "softmax", "softmax_backward"}), ("cpu", set())):
        points = mb.build_points(kind, ("bf16",), model, plan, 1, 1, mb.default_sweep(kind), ("memory",))
        assert {p.op for p in points if p.dtype == "fp32"} == expected
    device = load_system("dgx-h100").device
    op = MemoryOp("norm1", 8 * 2 ** 24, "layernorm", "fp32")
    curve = memory_times(device, op)[0]
    twice = KernelTable("layernorm", "fp32", tuple((n, 2 * memory_times(device, dataclasses.replace(op, nbytes=n))[0])
                                                   for n in (2 ** 25, 2 ** 27, 2 ** 29)), 0.5)
    measured = dataclasses.replace(device, measured=(twice,), kernel_dtype="bf16")
    assert memory_times(measured, op)[0] == pytest.approx(2 * curve, rel=0.1)  # the fp32 table
    assert memory_times(measured, dataclasses.replace(op, dtype=""))[0] == pytest.approx(curve)  # no bf16 table
