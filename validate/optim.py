"""Megatron-style mixed-precision Adam: bf16 (or any dtype) model parameters and gradients, an
fp32 master copy of every parameter plus Adam's two fp32 moments in the optimizer.

That is the state perfsim's memory model counts (perfsim.cost.memory: weights in the step's
dtype, gradients at `framework.grad_bytes_per_param`, OPTIMIZER_BYTES_PER_PARAM = 12 for master,
m and v), so a real step built with it holds what perfsim predicts. With fp32 parameters the
master copy is still kept, so the optimizer's bytes do not depend on the step's dtype.
"""

from __future__ import annotations

import torch

OPTIMIZER_STATE_BYTES_PER_PARAM = 12  # fp32 master + fp32 exp_avg + fp32 exp_avg_sq


class MasterAdam(torch.optim.Optimizer):
    """AdamW on fp32 master weights; the model's parameters receive the rounded result. The
    update is torch's fused AdamW kernel (one pass over master, moments and gradient), as
    production optimizers fuse it.

    Works on plain tensors and on DTensor parameters (their local shards are updated), so it
    serves tensor-parallel models and, as `optimizer_class`, ZeroRedundancyOptimizer."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @staticmethod
    def _local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    @staticmethod
    def _as_param(p, grad):
        """The gradient laid out like its parameter: a DTensor gradient can come back with other
        placements (a sharded embedding's gradient replicated, say) and must be re-sharded."""
        placements = getattr(p, "placements", None)
        if placements is not None and tuple(grad.placements) != tuple(placements):
            return grad.redistribute(placements=placements)
        return grad

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (master weights and moments)."""
        return sum(v.numel() * v.element_size() for s in self.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim() > 0)

    def _init_state(self, p):
        state = self.state[p]
        if not state:
            local = self._local(p.detach())
            state["master"] = local.to(torch.float32, copy=True)
            state["exp_avg"] = torch.zeros_like(state["master"])
            state["exp_avg_sq"] = torch.zeros_like(state["master"])
            # on the master's device: fused AdamW on a GPU refuses a CPU step counter
            state["step"] = torch.zeros((), dtype=torch.float32, device=state["master"].device)
        return state

    def init_states(self):
        """Allocate every state now (as Megatron does when it builds the optimizer), so peak
        memory is reached in the first step and not by surprise later."""
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p)

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim.adamw import adamw

        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p)
                # One parameter at a time, so the fp32 copy of the gradient is transient and small.
                grad = self._local(self._as_param(p, p.grad)).to(torch.float32)
                adamw([state["master"]], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]],
                      fused=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                      weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
                self._local(p.data).copy_(state["master"])
        return loss
