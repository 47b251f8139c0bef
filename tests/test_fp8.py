"""--dtype fp8 (docs/equations.md 3.11): each layer's weight GEMMs at the profile's FP8
peak, their operands cast to FP8 (and transposed) as element-wise passes, the FP8 weight copies
and scaling state in memory, the updated weights cast once per step; attention and logits in
bf16. Counted here by hand from the formulas' definitions."""

from __future__ import annotations

import dataclasses
import json

import pytest

from perfsim import cli
from perfsim.cost.columns import at_dtype, columns_of
from perfsim.cost.layer import Gemm, work
from perfsim.cost.memory import memory_breakdown
from perfsim.predict import predict
from perfsim.schedule.simulator import simulate
from perfsim.search import search
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

from profile_toml import write_variant

H100 = load_system("dgx-h100")
MODEL = load_model("layers=4,hidden=1024,heads=16,seq=2048,vocab=32000")
PLAN = Plan(tp=2, pp=2, dp=2, mbs=1, gbs=8)
# one layer's weight matrices: QKV h x 3h, projection h x h, FC1 h x 4h, FC2 4h x h
LINEAR_WEIGHTS = 1024 * 3072 + 1024 * 1024 + 1024 * 4096 + 4096 * 1024


def gemm_seconds(peak, best, m, n, k, half=None, overhead=None):
    """A large GEMM on dgx-h100 (compute-bound): FLOPs over peak x the efficiency model, its half
    dimension and kernel overhead the profile's unless given."""
    half = H100.device.gemm_half_dim if half is None else half
    overhead = H100.device.kernel_overhead_s if overhead is None else overhead
    efficiency = best * (m / (m + half)) * (n / (n + half)) * (k / (k + half))
    return 2.0 * m * n * k / (peak * efficiency) + overhead


def stream_seconds(nbytes, device=H100.device):
    return nbytes / (device.memory_bandwidth_Bps * device.memory_efficiency) + device.kernel_overhead_s


def test_dgx_h100_states_the_dense_fp8_peak():
    assert H100.device.peak_flops_fp8 == 1979e12  # twice the bf16 989, rounded as the datasheet does
    assert H100.provenance["device.peak_flops_fp8"][0] == "spec"


def test_a_weight_gemm_runs_at_the_fp8_peak_the_attention_core_at_bf16():
    fc1 = Gemm("fc1", 1, 8192, 8192, 8192)
    fp8 = work(H100.device, 989e12, [fc1], [], fp8=1)
    casts = stream_seconds(4 * 8192 * 8192)  # read bf16, write FP8 and its transpose
    # the profile's bf16 GEMM efficiency (the H200 ledger's; its measured bf16 table applies to
    # predictions in bf16 only, through for_dtype, and never to FP8 GEMMs)
    best = H100.device.gemm_efficiency
    assert fp8.time_s == pytest.approx(gemm_seconds(1979e12, best, 8192, 8192, 8192) + casts, rel=1e-12)
    assert work(H100.device, 989e12, [fc1], []).time_s == pytest.approx(gemm_seconds(989e12, best, 8192, 8192, 8192))
    scores = Gemm("scores", 16, 2048, 2048, 128)
    assert work(H100.device, 989e12, [scores], [], fp8=1).time_s == work(H100.device, 989e12, [scores], []).time_s


def test_the_profiles_fp8_efficiency_replaces_the_best_case(tmp_path):
    def edit(data):
        data["device"]["fp8_gemm_efficiency"] = {"value": 0.7, "provenance": "assumed", "source": "test"}
    device = load_system(write_variant(tmp_path, "dgx-h100", edit)).device
    fc1 = Gemm("fc1", 1, 8192, 8192, 8192)
    expected = gemm_seconds(1979e12, 0.7, 8192, 8192, 8192) + stream_seconds(4 * 8192 * 8192)
    assert work(device, 989e12, [fc1], [], fp8=1).time_s == pytest.approx(expected, rel=1e-12)


def test_casts_forward_the_input_backward_the_output_gradient():
    m, n, k = 4096, 16384, 4096
    fc1 = Gemm("fc1", 1, m, n, k)
    bf16, fp8 = work(H100.device, 989e12, [fc1], []), work(H100.device, 989e12, [fc1], [], fp8=1)
    gemm = gemm_seconds(1979e12, H100.device.gemm_efficiency, m, n, k)
    assert fp8.time_s - gemm == pytest.approx(stream_seconds(4 * m * k), rel=1e-9)
    assert fp8.backward_s - 2 * gemm == pytest.approx(stream_seconds(4 * m * n), rel=1e-9)
    assert fp8.flops == bf16.flops  # the same products, counted the same way


def _bf16_weights_kept(system):
    """The profile with the bf16 weights kept beside the FP8 copies (Megatron-LM's default, without
    --fp8-param-gather)."""
    return dataclasses.replace(system, framework=dataclasses.replace(system.framework, fp8_param_gather=0))


def test_memory_adds_the_fp8_copies_and_scaling_state_exactly():
    kept = _bf16_weights_kept(H100)
    bf16, fp8 = predict(MODEL, kept, PLAN).memory_bytes, predict(MODEL, kept, PLAN, "fp8").memory_bytes
    layers_per_stage, t = 4 / 2, 2
    copies = 2 * layers_per_stage * LINEAR_WEIGHTS / t  # one byte each: the FP8 weight and its transpose
    scaling = layers_per_stage * 4 * 5 * (2 + 1024) * 4  # 4 GEMMs x 5 tensors x (scale, inverse, 1024 amaxes) fp32
    assert fp8["weights"] - bf16["weights"] == copies + scaling == 25_329_984
    for kind in ("gradients", "optimizer"):
        assert fp8[kind] == bf16[kind]


def test_fp8_weights_take_the_place_of_the_bf16_ones():
    """dgx-h100 trains FP8 as NVIDIA's recipes do, the FP8 layers' weights in FP8 (fp8_param_gather):
    their data and transpose, 2 bytes, where the bf16 weight was; the scaling state on top."""
    assert H100.framework.fp8_param_gather == 1
    bf16, fp8 = predict(MODEL, H100, PLAN).memory_bytes, predict(MODEL, H100, PLAN, "fp8").memory_bytes
    assert fp8["weights"] - bf16["weights"] == 2 * 4 * 5 * (2 + 1024) * 4  # two layers' scaling state


@pytest.mark.parametrize("attention", ["unfused", "flash"])
def test_fp8_layers_keep_fp8_copies_of_their_linears_inputs(attention):
    """Transformer Engine's FP8 linears keep the FP8 copy of their input for the weight gradient (1
    byte an element where bf16 keeps 2): the QKV and FC1 inputs (s b h each, replicated without
    SP), the projection's (s b h / t) and FC2's (s b 4h / t). The fused attention kernel keeps its
    own bf16 output beside the projection's copy: there the context costs a byte more, not less.
    Per layer and micro-batch: -2 sbh - 4 sbh/t, and -sbh/t (unfused) or +sbh/t (flash)."""
    s, b, h, t = 2048, 1, 1024, 2
    sbh = s * b * h
    per_layer = -2 * sbh - 4 * sbh / t + (sbh / t if attention == "flash" else -sbh / t)
    c = columns_of(PLAN.replace(attention=attention))
    bf16, fp8 = (memory_breakdown(MODEL, H100, at_dtype(c, dtype), last_stage=False)["activations"]
                 for dtype in ("bf16", "fp8"))
    # the first of two stages: two layers, min(m, p) = 2 micro-batches in flight
    assert float(fp8 - bf16) == 2 * 2 * per_layer


def test_zero3_shards_the_fp8_copies_over_data_and_context_parallelism():
    model = load_model("layers=4,hidden=1024,heads=16,seq=8192,vocab=32000")
    plan = Plan(tp=1, cp=2, pp=2, dp=2, zero=3, mbs=1, gbs=8, attention="flash")
    kept = _bf16_weights_kept(H100)
    bf16, fp8 = predict(model, kept, plan).memory_bytes, predict(model, kept, plan, "fp8").memory_bytes
    copies = 2 * 2 * LINEAR_WEIGHTS / (2 * 2)  # two layers a stage, sharded over dp x cp = 4
    assert fp8["weights"] - bf16["weights"] == copies + 2 * 4 * 5 * (2 + 1024) * 4


def test_the_step_casts_the_updated_weights_once():
    bf16, fp8 = predict(MODEL, H100, PLAN), predict(MODEL, H100, PLAN, "fp8")
    elements = 2 * LINEAR_WEIGHTS / 2  # two layers a stage, half of each matrix a device
    cast = 4 * elements / (3.35e12 * 0.85) + 2 * 4 * H100.device.kernel_overhead_s  # one kernel per GEMM
    extra = fp8.time_breakdown_s["optimizer"] - bf16.time_breakdown_s["optimizer"]
    assert extra == pytest.approx(cast, rel=1e-9)
    assert fp8.step_time_s < bf16.step_time_s
    assert fp8.model_flops_per_step == bf16.model_flops_per_step
    assert fp8.peak_tflops_per_device == bf16.peak_tflops_per_device == 989  # MFU against the bf16 peak


def test_both_engines_agree_in_fp8():
    plan = Plan(tp=2, pp=1, dp=1, mbs=1, gbs=4)
    simulated = simulate(MODEL, H100, plan, "fp8")
    assert simulated.prediction.step_time_s == pytest.approx(simulated.analytic.step_time_s, rel=1e-9)
    assert simulated.analytic.step_time_s == predict(MODEL, H100, plan, "fp8").step_time_s


def test_bf16_predictions_do_not_depend_on_the_fp8_key(tmp_path):
    without = load_system(write_variant(tmp_path, "dgx-h100", lambda data: data["device"].pop("peak_flops_fp8")))
    a, b = predict(MODEL, H100, PLAN).as_json(), predict(MODEL, without, PLAN).as_json()
    assert a == b


@pytest.mark.parametrize("system", ["smng-p2", "dgx-a100", "v100-tacc"])
@pytest.mark.parametrize("command", ["predict", "simulate", "search"])
def test_profiles_without_an_fp8_peak_refuse_in_one_line(capsys, system, command):
    args = [command, "--system", system, "--dtype", "fp8", "--devices", "8"]
    if command == "search":
        args += ["--model", "sc21-1.7b", "--gbs", "64"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("perfsim: error:")
    assert system in err and "peak_flops_fp8" in err


def test_search_explores_in_fp8_when_asked():
    found = search(MODEL, H100, 8, 32, top=1, dtype="fp8")
    best = found.plans[0]
    assert best.dtype == "fp8"
    assert best.step_time_s < search(MODEL, H100, 8, 32, top=1).plans[0].step_time_s


def test_predict_json_names_the_dtype(capsys):
    assert cli.main(["predict", "--system", "dgx-h100", "--model", "sc21-1.7b", "--devices", "8", "--dtype", "fp8",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "fp8"
    # dgx-h100 carries the H200 ledger's bf16 GEMMs: they price the bf16 logits GEMM; the FP8 weight
    # GEMMs, their casts and the fused attention rest on the curves (was exactly 1 without a table)
    assert 0.5 < out["compute_extrapolated_share"] < 1.0


def test_dgx_b200_states_dense_peaks_and_marks_carried_over_efficiencies_assumed():
    b200 = load_system("dgx-b200")
    assert b200.device.peak_flops_bf16 == 2.25e15 and b200.device.peak_flops_fp8 == 2 * 2.25e15  # half the sparse 4.5 / 9 PF
    assert b200.node.devices_per_node == 8 and b200.node.node_link_bandwidth_Bps == 900e9  # 1.8 TB/s both ways
    for key in ("gemm_half_dim", "memory_efficiency", "flash_forward_efficiency", "flash_backward_efficiency",
                "kernel_overhead_s"):
        assert getattr(b200.device, key) == getattr(H100.device, key)
        provenance, source = b200.provenance[f"device.{key}"]
        assert provenance == "assumed" and "not measured on B200" in source
    # the GEMM rate is B200's own, one GPU alone (mamf-finder), as dgx-h100's is its ledger's
    provenance, source = b200.provenance["device.gemm_efficiency"]
    assert provenance == "measured" and "B200" in source and "mamf-finder" in source
    assert predict(MODEL, b200, PLAN, "fp8").step_time_s < predict(MODEL, H100, PLAN, "fp8").step_time_s
