"""Memory as Megatron-Core and Transformer Engine allocate it (docs/equations.md section 7), counted
by hand: Llama 3 70B at 8K tokens in FP8 on 64 H100s (TP 4 + SP, PP 8, VP 5, micro-batch 1, the
plan of NVIDIA's published run), and the visible calibration sets (SC21 Table 1 on dgx-a100, the
Megatron-LM H100 table on dgx-h100), every plan of which ran and must fit."""

from __future__ import annotations

import math

import pytest

from perfsim.calibrate.overheads import as_trained
from perfsim.predict import predict
from perfsim.reproduce import h100_table, sc21_table
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

H100 = load_system("dgx-h100")
LLAMA3_70B = load_model("layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,activation=swiglu,norm=rmsnorm,bias=false,"
                        "learned_positions=false,seq=8192,vocab=128256,tied_embeddings=false,dropout=false")
PLAN_70B = Plan(tp=4, sp=True, pp=8, vpp=5, schedule="interleaved", dp=2, zero=1, mbs=1, gbs=128, attention="flash",
                tp_overlap=True, dp_overlap=True)
GIB = 2**30


def test_llama3_70b_fp8_on_64_h100s_by_hand():
    p = predict(LLAMA3_70B, H100, PLAN_70B, "fp8")
    m = p.memory_bytes
    s, h, kv, f, t, e = 8192, 8192, 1024, 28672, 4, 2
    # the first stage (peak): 10 layers, the word embedding; 1d shards the linears 4 ways
    linear = h * (h + 2 * kv) + h * h + h * 2 * f + f * h  # QKV, projection, SwiGLU's FC1 (gate, up), FC2
    layer = linear // t + 2 * h  # the two RMSNorm scales replicated
    vocab = math.ceil(128256 / (128 * t)) * 128 * t  # Megatron pads the vocabulary to 128 x TP: 128,512
    params = 10 * layer + vocab * h // t
    assert params == 2_402_451_456
    # Megatron-Core's buffers pad each of the 62 parameter tensors (at most 63 elements) and each of
    # the 61 + 5 buckets (40M parameters; one more per model chunk) to lcm(dp, 128) = 128 (at most 127)
    padding = 62 * 63 + (61 + 5) * 127
    # FP8 weights in place of bf16 (fp8_param_gather): data + transpose, 2 bytes, as bf16; the
    # delayed-scaling state of 4 GEMMs x 5 tensors x (scale, inverse scale, 1024 amaxes) in fp32
    assert m["weights"] == 2 * (params + padding) + 10 * 4 * 5 * (2 + 1024) * 4
    assert m["gradients"] == 4 * (params + padding)  # Megatron-LM's fp32 gradient buffer
    assert m["optimizer"] == 12 * params / 2  # fp32 master, Adam's two moments, over DP 2
    # one layer and micro-batch, in units of u = s b h / t bytes-per-element (16,777,216)
    u = s * h // t
    per_layer = (2 * e * u  # the two RMSNorm inputs (bf16)
                 + 2 * 1 * u  # the QKV and FC1 inputs: TE keeps their FP8 copies
                 + e * u + 2 * e * u * kv // h  # Q; K and V of the 8 query groups
                 + e * u + 1 * u  # the fused kernel's output (bf16) and the projection's FP8 copy of it
                 + e * 2 * f * u // h  # SwiGLU keeps FC1's output, both halves
                 + 1 * f * u // h  # FC2's input, an FP8 copy
                 + 4 * 64 * s // t)  # the kernel's log-sum-exp, fp32 a row and head
    assert per_layer == 29 * u + 524_288
    # in flight on the first stage: Megatron-Core's interleaved warm-up 2 (p - 1) + (v - 1) p chunks and
    # one more, each of 80 / (8 x 5) = 2 layers: 47 x 2 = 94 layers' worth
    assert m["activations"] == (2 * 7 + 4 * 8 + 1) * 2 * per_layer
    # buffers: two pipeline receive buffers (s/t b h, bf16); the SP gathers land in TE's userbuffers;
    # TE's cuBLAS workspace once per userbuffers stream (3); then, outside the allocator, 12
    # userbuffers of the whole [s b, h] (8 all-gathers in FP8, 4 in bf16) and the runtime, and the
    # allocator's 5% over everything it holds
    inside = 2 * e * u + 3 * (32 * 2**20 + 1024)
    userbuffers = s * h * (8 * 1 + 4 * e)
    live = m["weights"] + m["gradients"] + m["optimizer"] + m["activations"] + inside
    assert m["buffers"] == pytest.approx(inside + userbuffers + 2e9 + 0.05 * live, rel=1e-12)
    assert m["total"] == pytest.approx(81_594_906_000, rel=1e-9)  # 76.0 GiB
    assert p.memory_peak_stage == "first" and p.fits  # of the 81,089 MiB torch sees of an H100
    assert H100.device.memory_bytes == 81089 * 2**20


def test_the_70b_run_fits_without_recomputation_and_the_search_keeps_it():
    """The run used no recomputation; at its sizes perfsim's search does not ask for any either."""
    from perfsim.search import search

    fixes = {"tp": {4}, "pp": {8}, "vpp": {5}, "mbs": {1}, "zero": {1}, "cp": {1}, "sp": {1}}
    best = search(LLAMA3_70B, H100, 64, 128, fixes, top=1, dtype="fp8").plans[0]
    assert best.plan.recompute == "none" and best.fits


@pytest.fixture(scope="module")
def calibration_sets():
    return sc21_table(), h100_table()


def test_every_plan_of_the_calibration_sets_fits_at_its_published_settings(calibration_sets):
    sc21, h100 = calibration_sets
    a100 = load_system("dgx-a100")
    for row, p in sc21:  # stated: full recomputation; micro-batch and interleaving tuned
        assert p.fits and p.plan.recompute == "full", row.preset
        plain = predict(p.model, a100, p.plan.replace(mbs=1, vpp=1, schedule="1f1b"))
        assert plain.fits, row.preset  # the plainest plan of the row fits too
    for row, p in h100:  # no recomputation stated: none chosen, and it fits
        assert p.fits and p.plan.recompute == "none", row.name
        assert p.memory_bytes["total"] <= 0.95 * p.device_memory_bytes, row.name


def test_the_harness_has_none_of_the_stacks_terms():
    """validate/ trains plain torch: no TE workspace or userbuffers, no Megatron buffers or FP8
    weights (perfsim.calibrate.overheads.as_trained), so its predictions are what they were."""
    fw = as_trained(H100, "bf16", "cuda").framework
    assert fw.workspace_bytes is None and fw.buffer_alignment_elements is None and fw.fp8_param_gather is None
