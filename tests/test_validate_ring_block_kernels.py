"""Which fused kernel ring attention's blocks run in (validate.context_parallel.fused_block_kernels),
and how the GPU kernels are called, on a CPU: stand-ins for the CUDA and XPU aten ops take their
arguments through the real ops' schemas (each call is also made on meta tensors, so the binding
torch uses on a GPU parses it), return the log-sum-exp in each kernel's own layout, and compute with
the CPU's flash kernel. A ring step through them must equal the ring through the CPU kernel
(to an ulp), so a wrong argument order, a log-sum-exp left padded or a lost random-number state fails
here rather than on a GPU."""

from __future__ import annotations

import math
import types

import pytest

torch = pytest.importorskip("torch")

from validate import context_parallel as cp  # noqa: E402

B, HEADS, C, D = 2, 2, 8, 16  # a rank's s/cp = 2 C tokens; C is no multiple of 32: the padded layout shows


def bind(name: str, args, kwargs) -> dict:
    """The arguments of a call of aten op `name` by parameter name, after the real op's binding
    accepted them (the call repeated on meta tensors; its meta kernel runs)."""
    op = getattr(torch.ops.aten, name).default
    def meta(x):
        return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x

    op(*map(meta, args), **{k: meta(v) for k, v in kwargs.items()})
    params = op._schema.arguments
    bound = dict(zip([p.name for p in params if not p.kwarg_only], args), **kwargs)
    return {p.name: bound.get(p.name, p.default_value if p.has_default_value() else None) for p in params}


def cpu_forward(a):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(a["query"], a["key"], a["value"], a["dropout_p"],
                                                                     a["is_causal"], scale=a["scale"])


def cpu_backward(a, grad_out, lse):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, a["query"], a["key"], a["value"], a["out"], lse, a["dropout_p"], a["is_causal"], scale=a["scale"])


class StandIns:
    """The GPU ops fused_block_kernels calls, as the kernels behave (torch's CUDA and XPU sources):
    flash's log-sum-exp [b, h, s], memory-efficient attention's [b, h, s padded to 32] (the padding
    is NaN here: any of it read back spoils the result), the XPU oneDNN kernel's [b, h, s, 1], which
    it computes only with grad mode on and an input that requires grad."""

    def __init__(self):
        self.calls, self.rng = [], None

    def _rng(self):
        self.rng = (torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64))
        return self.rng

    def _check_rng(self, seed, offset):
        assert self.rng is not None and seed is self.rng[0] and offset is self.rng[1], "the forward's rng state"

    def _scaled_dot_product_flash_attention(self, *args, **kwargs):
        a = bind("_scaled_dot_product_flash_attention", args, kwargs)
        self.calls.append("flash")
        out, lse = cpu_forward(a)
        s, sk = a["query"].shape[-2], a["key"].shape[-2]
        return (out, lse, None, None, s, sk, *self._rng(), torch.empty(0))

    def _scaled_dot_product_flash_attention_backward(self, *args, **kwargs):
        a = bind("_scaled_dot_product_flash_attention_backward", args, kwargs)
        assert a["logsumexp"].shape == a["query"].shape[:3]
        assert (a["max_q"], a["max_k"]) == (a["query"].shape[-2], a["key"].shape[-2])
        self._check_rng(a["philox_seed"], a["philox_offset"])
        return cpu_backward(a, a["grad_out"], a["logsumexp"])

    @staticmethod
    def _as_many_heads(a):
        assert a["query"].shape[1] == a["key"].shape[1] == a["value"].shape[1], "the kernel takes no grouped queries"

    def _scaled_dot_product_efficient_attention(self, *args, **kwargs):
        a = bind("_scaled_dot_product_efficient_attention", args, kwargs)
        assert a["compute_log_sumexp"] and a["attn_bias"] is None
        self._as_many_heads(a)
        self.calls.append("efficient")
        out, lse = cpu_forward(a)
        s = lse.shape[-1]
        padded = torch.full((*lse.shape[:2], math.ceil(s / 32) * 32), float("nan"))
        padded[..., :s] = lse
        return (out, padded, *self._rng())

    def _scaled_dot_product_efficient_attention_backward(self, *args, **kwargs):
        a = bind("_scaled_dot_product_efficient_attention_backward", args, kwargs)
        s = a["query"].shape[-2]
        assert a["logsumexp"].shape == (*a["query"].shape[:2], math.ceil(s / 32) * 32)
        assert a["grad_input_mask"] == [True, True, True, False] and a["attn_bias"] is None
        self._check_rng(a["philox_seed"], a["philox_offset"])
        return (*cpu_backward(a, a["grad_out_"], a["logsumexp"][..., :s]), None)

    def _scaled_dot_product_fused_attention_overrideable(self, *args, **kwargs):
        a = bind("_scaled_dot_product_fused_attention_overrideable", args, kwargs)
        self.calls.append("overrideable")
        out, lse = cpu_forward(a)
        if not (torch.is_grad_enabled() and any(a[n].requires_grad for n in ("query", "key", "value"))):
            lse = None  # as the oneDNN kernel: no log-sum-exp outside training
        s, sk = a["query"].shape[-2], a["key"].shape[-2]
        return (out, None if lse is None else lse.unsqueeze(-1), None, None, s, sk, *self._rng(), None)

    def _scaled_dot_product_fused_attention_overrideable_backward(self, *args, **kwargs):
        a = bind("_scaled_dot_product_fused_attention_overrideable_backward", args, kwargs)
        self._as_many_heads(a)
        assert a["logsumexp"].shape == (*a["query"].shape[:3], 1)  # the XPU kernel asserts this layout
        assert a["grad_input_mask"] == [True, True, True, False]
        self._check_rng(a["philox_seed"], a["philox_offset"])
        return (*cpu_backward(a, a["grad_out"], a["logsumexp"][..., 0]), None)


def fake(kind: str, dtype=torch.float32):
    """What fused_block_kernels reads of a GPU tensor."""
    return types.SimpleNamespace(device=torch.device(kind), dtype=dtype)


@pytest.fixture
def gpu(monkeypatch):
    """Pretend the device's torch has every kernel and scaled_dot_product_attention picks `backend`."""
    def pick(backend, present=True):
        monkeypatch.setattr(cp, "sdpa_backend", lambda q, k=None: backend)
        monkeypatch.setattr(cp, "_has_kernel", lambda name, key: present)
    return pick


@pytest.mark.parametrize("kind, backend, called", [
    ("cuda", cp.FLASH, "flash"), ("cuda", cp.EFFICIENT, "efficient"), ("xpu", cp.OVERRIDEABLE, "overrideable"),
    ("xpu", cp.FLASH, "flash")])
def test_a_gpu_block_runs_the_kernel_sdpa_picks(gpu, kind, backend, called):
    gpu(backend)
    ops = StandIns()
    forward, _ = cp.fused_block_kernels(fake(kind), ops=ops)
    q = torch.randn(B, HEADS, C, D)
    out, lse = forward(q, q, q, True)
    assert ops.calls == [called]
    assert lse.shape == (B, HEADS, C) and lse.dtype == torch.float32 and out.shape == q.shape


@pytest.mark.parametrize("backend", [0, 3, -1, None])  # math, cuDNN, error, nothing to ask
def test_explicit_math_where_sdpa_picks_no_wired_kernel(gpu, backend):
    gpu(backend)
    assert cp.fused_block_kernels(fake("cuda"), ops=StandIns()) is None


def test_explicit_math_where_torch_lacks_the_kernels(gpu):
    gpu(cp.OVERRIDEABLE, present=False)
    assert cp.fused_block_kernels(fake("xpu"), ops=StandIns()) is None


def test_explicit_math_on_other_devices_and_this_builds_gpus():
    """This torch has no CUDA or XPU kernels: nothing to ask, the checks keep those paths shut."""
    for kind in ("cuda", "xpu", "mps"):
        assert cp.sdpa_backend(fake(kind)) is None
        assert cp.fused_block_kernels(fake(kind)) is None
    assert cp.fused_block_kernels(torch.randn(1, 1, 4, 8, dtype=torch.float16)) is None  # CPU fp16


def test_the_choice_is_asked_of_scaled_dot_product_attention(monkeypatch):
    """sdpa_backend's call goes through the real op (here its CPU kernel, which picks flash), with
    grouped queries too."""
    monkeypatch.setattr(cp, "DISPATCH_KEYS", {"cpu": "CPU"})
    q = torch.randn(B, HEADS, 2 * C, D)
    assert cp.sdpa_backend(q) == cp.sdpa_backend(q, q) == cp.sdpa_backend(q, q[:, :1]) == cp.FLASH


def ring_step(q, k, v, group):
    """Output and gradients of a one-rank ring (cp = 1: a causal block, a full one and a skipped one)."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = cp.ring_attention(q, k, v, group)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out).to(out.dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind, backend, kv_heads", [("cuda", cp.FLASH, HEADS), ("cuda", cp.EFFICIENT, HEADS),
                                                     ("xpu", cp.OVERRIDEABLE, HEADS), ("cuda", cp.FLASH, 1)])
def test_ring_through_gpu_kernels_equals_the_cpu_kernel(monkeypatch, one_rank_group, kind, backend, kv_heads, dtype):
    """kv_heads 1: grouped-query attention, which flash attention takes as it is (SDPA picks the
    others only for as many key as query heads)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, 2 * C, D, generator=g).to(dtype) for h in (HEADS, kv_heads, kv_heads))
    cpu = ring_step(q, k, v, one_rank_group)
    reference = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                                 enable_gqa=True)
    assert torch.allclose(cpu[0].float(), reference, atol=1e-5 if dtype == torch.float32 else 2e-2)
    ops = StandIns()
    real = cp.fused_block_kernels
    monkeypatch.setattr(cp, "sdpa_backend", lambda q, k=None: backend)
    monkeypatch.setattr(cp, "_has_kernel", lambda name, key: True)
    monkeypatch.setattr(cp, "fused_block_kernels", lambda q, k=None: real(fake(kind, q.dtype), k, ops))
    through = ring_step(q, k, v, one_rank_group)
    assert len(ops.calls) == 3  # the ring's three blocks
    # the same kernel's numbers; the log-sum-exp's memory layout may pick another vectorised loop in
    # _merge (an ulp of fp32); a misplaced argument or padded row is off by far more, or NaN
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    for mine, theirs in zip(through, cpu):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=atol)
