"""Exactness of the fused (SDPA) attention core of validate.gpt against the unfused one, in one
process (docs/real-steps.md, "Fused attention").

`compare(model, mbs, recompute, dtype)` builds the same seeded GPT twice, attention "unfused"
(Megatron's kernels, validate.gpt.attention_core) and "flash" (torch's
scaled_dot_product_attention), runs one forward and backward of the same batch on each and
returns the loss and gradients of both against an fp32 unfused reference, the matrix FLOPs the
flash step ran (validate.instrument.LocalFlopCounter, fused kernels at perfsim's count), the
bytes its forward saved for backward (validate.tp_check.SavedTensorCounter), the allocator's peak
of each step (validate.device: the profiler's running total on CPU) and what perfsim says of each
(hardware FLOPs, layer and head activations).
"""

from __future__ import annotations

from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

SYSTEM = "cpu-example"  # any profile: FLOPs and activation bytes do not depend on the machine


def _step(torch, gpt, tokens, targets, counters=()):
    """Loss and gradients (fp32, by name) of one forward and backward under `counters`."""
    import contextlib

    with contextlib.ExitStack() as stack:
        for c in counters:
            stack.enter_context(c)
        loss = gpt.loss(tokens, targets)
        gpt.backward(loss)
    grads = {n: p.grad.float() for n, p in gpt.named_parameters()}
    return float(loss.detach()), grads


def _max_error(grads, reference):
    return max(float((grads[n] - g).abs().max()) for n, g in reference.items())


def compare(model, mbs: int = 2, recompute: str = "none", dtype: str = "fp32") -> dict:
    """One step of the flash and of the unfused GPT (same seed and batch) in `dtype`, against the
    fp32 unfused step, with the flash step counted and perfsim's figures for the flash plan."""
    import gc

    import torch

    from perfsim.predict import predict
    from validate.device import Device
    from validate.gpt import GPT, GPTConfig
    from validate.instrument import LocalFlopCounter
    from validate.tp_check import SavedTensorCounter, perfsim_saved_bytes, price_saved

    run_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab, (mbs, model.seq), generator=g)
    targets = torch.randint(0, model.vocab, (mbs, model.seq), generator=g)

    def built(attention, run=run_dtype):
        torch.manual_seed(0)
        return GPT(GPTConfig.from_spec(model, 1, recompute, attention)).to(run)

    ref_loss, ref_grads = _step(torch, built("unfused", torch.float32), tokens, targets)
    device = Device("cpu", 0)
    out = {"dtype": dtype, "recompute": recompute, "reference_loss": ref_loss,
           "grad_max_abs": max(float(g.abs().max()) for g in ref_grads.values())}

    def counted(gpt):
        flops, saved = LocalFlopCounter(), SavedTensorCounter(torch, gpt)
        gc.collect()  # nothing left from before is freed inside the window, lowering its peak
        with device.allocation_peak() as peak:
            with flops:
                with saved:
                    loss = gpt.loss(tokens, targets)
                gpt.backward(loss)
        grads = {n: p.grad.float() for n, p in gpt.named_parameters()}
        return {"loss": float(loss.detach()), "grad_max_abs_error": _max_error(grads, ref_grads),
                "flops": flops.total(), "flops_by_op": flops.by_op(), "peak_bytes": peak.bytes,
                "saved_items": saved.items, "saved": price_saved(saved.items, [(mbs, model.heads, model.seq)]),
                "grads": grads}

    for attention in ("unfused", "flash"):
        out[attention] = counted(built(attention))
        plan = Plan(attention=attention, recompute=recompute, mbs=mbs, gbs=mbs)
        out[attention]["perfsim"] = {
            "flops": float(predict(model, load_system(SYSTEM), plan, "bf16").hardware_flops_per_step),
            "saved": perfsim_saved_bytes(model, plan)}
    flash, unfused = out["flash"]["grads"], out["unfused"]["grads"]
    out["flash_vs_unfused_grad_max_abs_error"] = _max_error(flash, unfused)
    for attention in ("unfused", "flash"):
        del out[attention]["grads"]
    return out
