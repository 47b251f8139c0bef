"""The order in which one pipeline stage runs its passes, per schedule (docs/simulator.md, section 2).

A pass is (kind, micro-batch, chunk): kind F (forward), B (backward; with a zero-bubble schedule only
the input gradient) or W (the weight gradient of a zero-bubble schedule). `stage_order(schedule,
stage, p, m, v)` lists a stage's passes in the order its compute stream issues them; the simulator
adds the data dependencies between stages and lets time decide the rest.

- gpipe: all forwards, then all backwards (micro-batches in order both times).
- 1f1b: Megatron-LM's non-interleaved schedule: stage i runs min(p - i - 1, m) warm-up forwards,
  then alternates one forward and one backward, then drains the remaining backwards.
- interleaved: Megatron-LM's interleaved 1F1B with v chunks per stage (m a multiple of p):
  (p - i - 1) * 2 + (v - 1) * p warm-up forwards (all of them when m = p), then one forward and one
  backward alternately. Forwards go through the chunks in groups of p micro-batches (chunk 0 for
  micro-batches 0..p-1, chunk 1 for the same, ..., then the next p micro-batches), backwards the
  same with the chunks reversed.
- zb-h1: Qi et al.'s ZB-H1 (Zero Bubble Pipeline Parallelism, ICLR 2024): 1F1B's order of F and B,
  with each W (weight gradient) split from its backward and issued after the backward of the
  micro-batch i later on stage i, so that every stage keeps p micro-batches in flight (the first
  stage's count under 1F1B: peak memory does not grow). The W passes left at the end run after the
  last backward. On the last stages they fill what would be the drain bubble.
"""

from __future__ import annotations

# the pass orders stage_order lays out: the plan's schedules (spec.plan.SCHEDULES) and zero bubble H1,
# which only the event simulation runs
SIMULATED_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
F, B, W = "F", "B", "W"


def stage_order(schedule: str, stage: int, p: int, m: int, v: int = 1) -> list[tuple[str, int, int]]:
    """Passes (kind, micro-batch, chunk) of `stage` (0-based) of a p-stage pipeline, m micro-batches."""
    if schedule not in SIMULATED_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SIMULATED_SCHEDULES)}, got {schedule!r}")
    if schedule == "interleaved":
        return _interleaved(stage, p, m, v)
    if v != 1:
        raise ValueError(f"the {schedule} schedule has one chunk per stage, got v = {v}")
    if schedule == "gpipe":
        return [(F, j, 0) for j in range(m)] + [(B, j, 0) for j in range(m)]
    order = _one_f_one_b(stage, p, m)
    return _zb_h1(order, stage, m) if schedule == "zb-h1" else order


def _one_f_one_b(stage: int, p: int, m: int) -> list:
    warmup = min(p - stage - 1, m)
    order = [(F, j, 0) for j in range(warmup)]
    for j in range(m - warmup):
        order += [(F, warmup + j, 0), (B, j, 0)]
    return order + [(B, j, 0) for j in range(m - warmup, m)]


def _zb_h1(order: list, stage: int, m: int) -> list:
    out, done = [], 0
    for kind, j, c in order:
        out.append((kind, j, c))
        if kind == B and j - stage >= 0:
            out.append((W, j - stage, c))
            done = j - stage + 1
    return out + [(W, j, 0) for j in range(done, m)]


def _interleaved(stage: int, p: int, m: int, v: int) -> list:
    if p < 2 or v < 2 or m % p:
        raise ValueError(f"the interleaved schedule needs p >= 2, v >= 2 and m a multiple of p; "
                         f"got p={p}, v={v}, m={m}")
    total = m * v

    def pass_of(k: int, forward: bool):
        group, position = divmod(k, p * v)
        chunk = position // p
        return (F if forward else B, group * p + position % p, chunk if forward else v - 1 - chunk)

    warmup = total if m == p else min((p - stage - 1) * 2 + (v - 1) * p, total)
    order = [pass_of(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [pass_of(warmup + k, True), pass_of(k, False)]
    return order + [pass_of(k, False) for k in range(total - warmup, total)]
