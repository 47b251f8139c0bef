"""Dropout inside the fused attention kernel (docs/equations.md 8.6).

Megatron-LM trains with attention dropout 0.1 unless told otherwise (megatron/training/arguments.py:
--attention-dropout, default 0.1; its GPT examples leave it), and Transformer Engine passes it to
the fused kernel, which draws a Philox random number per score it keeps, forward, and draws the
same numbers again in the backward (it stores no mask). The kernel benchmarks that give
device.flash_forward_efficiency and flash_backward_efficiency run without dropout (FlashAttention-3,
Shah et al. 2024, Figs. 5-6), so a step of a model with dropout pays what the random numbers add:
the fused kernel runs at device.flash_dropout_forward_ratio (forward) and
flash_dropout_backward_ratio (backward) of its rate without dropout. Measured for FlashAttention-4
and cuDNN 9.24 on GB200 at dropout 0.125: forward 75-85%, backward 60-70% of the no-dropout
TFLOP/s, roughly constant over the sequence length (Dao-AILab/flash-attention pull request #2597).
A profile without the keys prices none (the kernel's time as without dropout); a model without
dropout pays none, and neither does the unfused core, whose dropout is an element-wise op of its
own (docs/equations.md 3.5).
"""

from __future__ import annotations

import numpy as np

from perfsim.cost.counts import ATTENTION_CORE
from perfsim.cost.layer import Work, flash_attention_times


def fused_dropout_work(device, peak_flops: float, model, gemms: list, flash) -> Work:
    """What dropout adds to the fused attention kernel of a layer whose GEMMs are `gemms`, forward
    and backward, all of it in the attention core (selective recomputation repeats it): the
    kernel's time over its ratio, less the time; nothing where the profile names no ratio, the
    model has no dropout or the plan (`flash`, 0 or 1 or an array of them) runs the unfused core."""
    forward_ratio, backward_ratio = device.flash_dropout_forward_ratio, device.flash_dropout_backward_ratio
    if (forward_ratio is None and backward_ratio is None) or not model.dropout or not np.any(flash):
        return Work()
    forward = backward = 0.0
    for scores in (g for g in gemms if g.name == ATTENTION_CORE[0]):  # one, or one per kind of attention
        times = flash_attention_times(device, peak_flops, scores)
        forward, backward = forward + times[0], backward + times[1]
    extra_forward = flash * forward * (1.0 / (1.0 if forward_ratio is None else forward_ratio) - 1.0)
    extra_backward = flash * backward * (1.0 / (1.0 if backward_ratio is None else backward_ratio) - 1.0)
    return Work(time_s=extra_forward, core_time_s=extra_forward, backward_s=extra_backward,
                core_backward_s=extra_backward, curve_s=extra_forward + extra_backward)
