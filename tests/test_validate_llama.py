"""The Llama-shaped layers of the harness (validate/llama.py) one by one, against plain torch: the
same values and gradients as the textbook formula, what each keeps for backward, and the layouts
that keep a tensor-parallel rank's pieces together; and `perfsim validate` timing a Llama-shaped
model's plans through validate.steps. The parallel steps' exactness against perfsim is checked
where the GPT's is (tests/test_validate_gpt.py, _attention, _multidim, _pipeline_dp,
_context_parallel run the same checks on a Llama-shaped model)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from perfsim.spec.model import load_model  # noqa: E402
from validate import llama  # noqa: E402
from validate.gpt import GPT, GROUPED_CORES, GPTConfig  # noqa: E402

LLAMA = ("layers=2,hidden=64,heads=8,kv_heads=2,ffn=160,activation=swiglu,norm=rmsnorm,bias=false,"
         "learned_positions=false,tied_embeddings=false,dropout=false,seq=32,vocab=512")


def saved_shapes(fn, *args):
    """(output, shapes of what autograd keeps for backward, a module's parameters left out)."""
    shapes = []
    params = {p.data_ptr() for p in fn.parameters()} if isinstance(fn, torch.nn.Module) else set()

    def pack(t):
        if t.data_ptr() not in params:
            shapes.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, shapes


def test_rmsnorm_is_torchs_and_keeps_its_input_and_one_statistic():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    norm = llama.RMSNorm(16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(16, generator=g))
    y, kept = saved_shapes(norm, x)
    ref = F.rms_norm(x, (16,), norm.weight, llama.NORM_EPS)
    assert torch.equal(y, ref)  # torch's own kernel forward
    assert kept == [(2, 5, 16), (2, 5, 1)]  # the input and 1/rms: not torch's CPU composite's normalised copy
    dy = torch.randn(2, 5, 16, generator=g)
    ours = torch.autograd.grad(y, (x, norm.weight), dy)
    theirs = torch.autograd.grad(ref, (x, norm.weight), dy)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_rmsnorm_backward_runs_torchs_fused_kernel_where_the_device_has_one(monkeypatch):
    """On a GPU the backward is torch's fused kernel, called with (dy, x, shape, 1/rms, weight,
    mask); the CPU build has none, so a stand-in that computes what the kernel does (the explicit
    math) takes its place here and must see exactly those arguments and give the same gradients."""
    calls = []

    def fused(dy, x, shape, rstd, weight, mask):
        calls.append((tuple(dy.shape), tuple(x.shape), list(shape), tuple(rstd.shape), tuple(weight.shape), list(mask)))
        monkeypatch.setitem(llama.FUSED_BACKWARD_WORKS, x.device.type, False)  # the explicit math, once
        try:
            return llama.rms_norm_backward(dy, x, rstd, weight)
        finally:
            monkeypatch.setitem(llama.FUSED_BACKWARD_WORKS, x.device.type, True)

    monkeypatch.setattr(llama, "FUSED_RMS_NORM_BACKWARD", fused)
    monkeypatch.setitem(llama.FUSED_BACKWARD_WORKS, "cpu", True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 16, generator=g, requires_grad=True)
    norm = llama.RMSNorm(16)
    dy = torch.randn(3, 4, 16, generator=g)
    ours = torch.autograd.grad(norm(x), (x, norm.weight), dy)
    theirs = torch.autograd.grad(F.rms_norm(x, (16,), norm.weight, llama.NORM_EPS), (x, norm.weight), dy)
    assert calls == [((3, 4, 16), (3, 4, 16), [16], (3, 4, 1), (16,), [True, True])]
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_rotary_rotates_pairs_of_halves_by_the_token_position_and_keeps_nothing():
    """q . k after rotation depends on the two tokens' offset alone; the gradient is the rotation's
    transpose; a context-parallel rank's positions pick its own rows of the tables."""
    g = torch.Generator().manual_seed(1)
    rotary = llama.Rotary(8)
    x = torch.randn(1, 6, 2, 8, generator=g, requires_grad=True)
    y, kept = saved_shapes(rotary, x)
    assert kept == []
    cos, sin = rotary.tables(6, x.dtype, x.device)
    half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    assert torch.allclose(y, x * cos + half * sin)
    dy = torch.randn(y.shape, generator=g)
    (dx,) = torch.autograd.grad(y, x, dy)
    (ref,) = torch.autograd.grad(x * cos + half * sin, x, dy)
    assert torch.allclose(dx, ref, atol=1e-6)
    q = torch.randn(8, generator=g).expand(1, 6, 1, 8)
    k = torch.randn(8, generator=g).expand(1, 6, 1, 8)
    dots = (rotary(q)[0, :, 0, None, :] * rotary(k)[0, None, :, 0, :]).sum(-1)  # [query position, key position]
    assert torch.allclose(dots[1, 0], dots[5, 4], atol=1e-5) and torch.allclose(dots[3, 1], dots[4, 2], atol=1e-5)
    mine = llama.Rotary(8)
    mine.at(torch.tensor([0, 1, 4, 5]))
    assert torch.equal(mine.tables(4, x.dtype, x.device)[0][2:], cos[4:6])


def test_swiglu_is_silu_of_the_gate_times_up_and_keeps_its_input():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 10, generator=g, requires_grad=True)  # 5 (gate, up) pairs, interleaved
    y, kept = saved_shapes(llama.swiglu, x)
    ref = F.silu(x[:, 0::2]) * x[:, 1::2]
    assert torch.allclose(y, ref) and kept == [(3, 10)]
    dy = torch.randn(3, 5, generator=g)
    assert torch.allclose(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(ref, x, dy)[0], atol=1e-6)
    r, kept = saved_shapes(llama.squared_relu, x)
    assert torch.equal(r, F.relu(x) ** 2) and kept == [(3, 10), (3, 10), (3, 10)]  # one storage, the ReLU's


@pytest.mark.parametrize("tp", [1, 2])
def test_column_splits_keep_query_groups_and_gate_up_pairs_whole(tp):
    """A column-parallel rank's QKV columns are whole query groups with their K and V heads, and its
    FC1 columns whole (gate, up) pairs: the rank's attention and SwiGLU on its columns alone equal
    the unsharded ones' columns of its heads and units."""
    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_spec(load_model(LLAMA)))
    attn, mlp = gpt.blocks[0].attn, gpt.blocks[0].mlp
    x = torch.randn(2, 32, 64)
    q, k, v = llama.grouped_qkv(attn.qkv(x), attn.group, attn.head_dim)
    for r in range(tp):
        cols = attn.qkv.weight.chunk(tp)[r]
        mine = llama.grouped_qkv(F.linear(x, cols), attn.group, attn.head_dim)
        heads, groups = 8 // tp, 2 // tp
        for part, whole, n in zip(mine, (q, k, v), (heads, groups, groups)):
            assert torch.equal(part, whole[:, r * n:(r + 1) * n])
        up = F.linear(x, mlp.fc1.weight.chunk(tp)[r])
        assert torch.allclose(llama.swiglu(up), llama.swiglu(mlp.fc1(x)).chunk(tp, -1)[r])


def test_grouped_cores_equal_multi_head_attention_on_repeated_keys_and_values():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 16, 4, generator=g)
    k, v = torch.randn(2, 2, 16, 4, generator=g), torch.randn(2, 2, 16, 4, generator=g)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    for core in GROUPED_CORES.values():
        assert torch.allclose(core(q, k, v), ref, atol=1e-6)


@pytest.mark.multiprocess
def test_perfsim_validate_times_a_llama_shaped_models_plans(run_cli, tmp_path):
    """validate.steps builds a Llama-shaped model's step for each plan kind (1d with flash
    attention, a pipeline, FSDP2's ZeRO-3; SP's named differences are tests/test_validate_gpt.py's)
    as for the GPT: FLOPs and bytes sent equal the prediction, saved activations and the
    allocator's peak near it (the peak as for the GPT's plans: within 10%)."""
    plans = "tp=2,attention=flash,mbs=2,gbs=4;pp=2,mbs=2,gbs=8;dp=2,zero=3,mbs=2,gbs=4"
    r = run_cli("validate", "--device", "cpu", "--nproc", "2", "--model", LLAMA, "--plans", plans, "--steps", "1",
                "--speed-tolerance", "inf", "--ledger", str(tmp_path / "l.jsonl"), "--json")
    assert r.code == 0, r.err
    entries = r.json()
    assert len(entries) == 3
    for e in entries:
        assert e["flops"]["counted"] == e["flops"]["predicted"], e["label"]
        # the pipeline's one-time warm-up vote, 4 bytes a rank (tests/test_validate_pipeline_dp.py)
        assert 0 <= e["comm_bytes"]["counted"] - e["comm_bytes"]["predicted"] <= 8, e["label"]
        assert e["activation_bytes"]["counted"] == pytest.approx(e["activation_bytes"]["predicted"], rel=0.05), e["label"]
        assert e["peak_memory_bytes"]["measured"] == pytest.approx(e["peak_memory_bytes"]["predicted"], rel=0.10)
