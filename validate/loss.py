"""The next-token cross-entropy as Megatron computes it, shared by every real step in validate/.

The statistics are fp32 whatever the logits' dtype, and the vocabulary may be split over a group
of ranks (each holds the logits of vocabulary entries start ... start + V_local): the row maximum,
the target's logit and the sum of exponentials are all-reduced over the group, as Megatron's
vocabulary-parallel cross-entropy does. Memory follows Megatron too: an fp32 copy of the local
logits becomes the softmax in place and is the only [tokens, V_local] tensor kept for backward,
whose gradient is computed in that same buffer (softmax - one-hot, scaled) and returned in the
logits' dtype. torch's F.cross_entropy (and loss_parallel) keeps the same fp32 tensor but its
backward allocates two more of that size; perfsim's memory model, like Megatron, has neither
(docs/real-steps-timing.md).
"""

from __future__ import annotations

import torch


def _no_group(tensor, op):
    return tensor


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start, reduce, scale):
        x = logits.float()
        if x.data_ptr() == logits.data_ptr():  # fp32 logits: work on a copy, not on the caller's tensor
            x = x.clone()
        vocab = x.shape[-1]
        top = reduce(x.amax(-1), "max")
        mine = (targets >= start) & (targets < start + vocab)
        local = (targets - start).clamp(0, vocab - 1)
        target = reduce(torch.where(mine, x.gather(-1, local.unsqueeze(-1)).squeeze(-1), torch.zeros_like(top)), "sum")
        x.sub_(top.unsqueeze(-1)).exp_()
        total = reduce(x.sum(-1), "sum")
        x.div_(total.unsqueeze(-1))  # the softmax, in the fp32 copy's buffer
        ctx.save_for_backward(x, local, mine)
        ctx.scale, ctx.dtype = scale, logits.dtype
        return (torch.log(total) + top - target).sum() * scale

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        return logits_gradient(softmax, local, mine, grad * ctx.scale, ctx.dtype), None, None, None, None


def logits_gradient(softmax, local, mine, scale, dtype):
    """The logits' gradient in `dtype`, computed in the kept fp32 softmax's own buffer (it is not
    needed again: backward runs once): softmax minus the one-hot of the targets this rank holds,
    times `scale`. validate.microbench times these kernels as the loss's backward."""
    softmax.scatter_add_(-1, local.unsqueeze(-1), -mine.to(softmax.dtype).unsqueeze(-1))
    softmax.mul_(scale)
    return softmax.to(dtype)


def cross_entropy(logits, targets, start: int = 0, reduce=_no_group, scale: float | None = None):
    """Cross-entropy of [N, V_local] logits and [N] targets: the sum over the N tokens times
    `scale` (default 1 / N: the mean). With the vocabulary split, `start` is this rank's first
    vocabulary entry and `reduce(tensor, "max" | "sum")` all-reduces a [N] fp32 tensor over the
    vocabulary group and returns it; every member then holds the same loss."""
    return _CrossEntropy.apply(logits, targets, start, reduce, 1.0 / targets.numel() if scale is None else scale)
