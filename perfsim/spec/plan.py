"""Parallel plans: immutable values, and every reason a plan cannot run a model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from perfsim.spec.model import ModelSpec

TP_MODES = ("1d", "2d", "2.5d", "3d")
MODELLED_TP_MODES = ("1d",)  # the multi-dimensional modes arrive with the topology model
SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
DIMENSIONS = ("tp", "dp", "pp")
DEFAULT_ORDER = "tp-dp-pp"  # Megatron: tensor innermost, then data, then pipeline outermost


@dataclass(frozen=True)
class Plan:
    """One way to lay a training step over devices. Field names are the knob names everywhere."""

    tp: int = 1
    tp_mode: str = "1d"
    tp_depth: int = 1
    sp: bool = False
    pp: int = 1
    vpp: int = 1
    schedule: str = "1f1b"
    dp: int = 1
    zero: int = 0
    mbs: int = 1
    gbs: int = 1
    recompute: str = "none"
    order: str = DEFAULT_ORDER

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def microbatches(self) -> int:
        """Micro-batches each pipeline runs per step (the gradient-accumulation count)."""
        return self.gbs // (self.mbs * self.dp)

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan_problems(plan: Plan, model: ModelSpec, devices: int | None = None) -> list[str]:
    """Every reason `plan` cannot train `model` (on `devices` devices, when given); empty if none."""
    reasons = []
    for name in ("tp", "tp_depth", "pp", "vpp", "dp", "mbs", "gbs"):
        value = getattr(plan, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            reasons.append(f"{name} must be a positive whole number, got {value!r}")
    if reasons:
        return reasons
    if plan.tp_mode not in TP_MODES:
        reasons.append(f"tp_mode must be one of {', '.join(TP_MODES)}, got {plan.tp_mode!r}")
    elif plan.tp_mode not in MODELLED_TP_MODES and plan.tp > 1:
        reasons.append(f"tp_mode {plan.tp_mode} is not modelled yet; use --tp-mode 1d")
    if plan.schedule not in SCHEDULES:
        reasons.append(f"schedule must be one of {', '.join(SCHEDULES)}, got {plan.schedule!r}")
    if plan.recompute not in RECOMPUTE:
        reasons.append(f"recompute must be one of {', '.join(RECOMPUTE)}, got {plan.recompute!r}")
    if plan.zero not in (0, 1, 2, 3):
        reasons.append(f"zero must be 0, 1, 2 or 3, got {plan.zero!r}")
    if sorted(plan.order.split("-")) != sorted(DIMENSIONS):
        reasons.append(f"order must list tp, dp and pp innermost first, like {DEFAULT_ORDER}; got {plan.order!r}")
    if plan.sp and plan.tp_mode != "1d":
        reasons.append("sequence parallelism (--sp) applies to 1d tensor parallelism only")
    if plan.tp_depth != 1 and plan.tp_mode != "2.5d":
        reasons.append("tp_depth applies to --tp-mode 2.5d only")

    if plan.tp_mode == "1d":
        if model.heads % plan.tp:
            reasons.append(f"tp {plan.tp} must divide the {model.heads} attention heads")
        elif model.kv_head_count % plan.tp:
            reasons.append(f"tp {plan.tp} must divide the {model.kv_head_count} key/value heads")
        if model.ffn_size % plan.tp:
            reasons.append(f"tp {plan.tp} must divide the MLP width {model.ffn_size}")
        if plan.sp and model.seq % plan.tp:
            reasons.append(f"with --sp, tp {plan.tp} must divide the sequence length {model.seq}")
    if model.layers % (plan.pp * plan.vpp):
        what = f"pp x vpp = {plan.pp * plan.vpp}" if plan.vpp > 1 else f"pp {plan.pp}"
        reasons.append(f"{what} must divide the {model.layers} layers")
    if plan.schedule == "interleaved" and plan.vpp < 2:
        reasons.append("the interleaved schedule needs --vpp 2 or more")
    if plan.vpp > 1 and plan.schedule != "interleaved":
        reasons.append(f"--vpp {plan.vpp} needs --schedule interleaved")
    if plan.schedule == "interleaved" and plan.pp < 2:
        reasons.append("the interleaved schedule needs pp of 2 or more")
    if plan.gbs % (plan.mbs * plan.dp):
        reasons.append(f"global batch {plan.gbs} must be a multiple of mbs x dp = {plan.mbs * plan.dp}")
    elif plan.schedule == "interleaved" and plan.microbatches % plan.pp:
        reasons.append(f"the interleaved schedule needs the {plan.microbatches} micro-batches to be a multiple of pp {plan.pp}")
    if devices is not None and devices != plan.devices:
        reasons.append(f"tp x pp x dp = {plan.tp} x {plan.pp} x {plan.dp} = {plan.devices} does not match the {devices} devices")
    return reasons
