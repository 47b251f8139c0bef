"""Scaling studies: one plan's step time and efficiency over a list of node counts.

Weak scaling keeps the work per replica (tensor and pipeline sizes, micro-batch, micro-batches per
pipeline) and grows data parallelism with the nodes, so the global batch grows too. Strong scaling
keeps the global batch and the tensor and pipeline sizes; data parallelism grows and each pipeline
runs fewer micro-batches. This is the SMNG-P2 authors' protocol (docs/validation.md, "SMNG-P2 scaling").

Efficiency is relative to the first point: weak, throughput per device; strong, speed-up over the
ideal N/N0. Its loss splits exactly over the breakdown terms: with T the step time, the ideal step
time T* (T0 for weak, T0 N0/N for strong) and per-term ideal times b*_k (b0_k, or b0_k N0/N),
    1 - efficiency = sum_k (b_k - b*_k) / T,
so each term's share says how many points of efficiency it costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from perfsim.errors import PerfsimError
from perfsim.predict import Prediction, predict
from perfsim.spec.model import ModelSpec
from perfsim.spec.plan import Plan, plan_problems
from perfsim.spec.system import System


@dataclass(frozen=True)
class ScalePoint:
    nodes: int
    prediction: Prediction
    efficiency: float
    loss_points: dict  # breakdown term -> points of efficiency it costs against the first point

    def as_json(self) -> dict:
        p = self.prediction
        return {"nodes": self.nodes, "devices": p.devices, "global_batch": p.plan.gbs, "step_time_s": p.step_time_s,
                "tokens_per_s": p.tokens_per_s, "efficiency": self.efficiency, "time_breakdown_s": p.time_breakdown_s,
                "efficiency_loss_points": self.loss_points, "plan": p.plan.as_dict(), "fits": p.fits}


def scaled_plan(base: Plan, base_devices: int, devices: int, weak: bool) -> Plan:
    """The base plan on `devices` devices: data parallelism takes the difference."""
    replica = base.tp * base.cp * base.pp
    if devices % replica:
        what = "tp x cp x pp" if base.cp > 1 else "tp x pp"
        raise PerfsimError(f"{devices} devices is not a multiple of {what} = {replica}")
    dp = devices // replica
    if weak:
        return base.replace(dp=dp, gbs=base.microbatches * base.mbs * dp)
    if base.gbs % (base.mbs * dp):
        raise PerfsimError(f"strong scaling: global batch {base.gbs} is not a multiple of mbs x dp = {base.mbs * dp} "
                           f"at {devices} devices; choose --gbs divisible by every mbs x dp")
    return base.replace(dp=dp)


def scale(model: ModelSpec, system: System, base: Plan, nodes: list[int], weak: bool, dtype: str = "bf16") -> list:
    if not nodes or any(n < 1 for n in nodes):
        raise PerfsimError("--nodes needs a list of positive node counts, e.g. 16,32,64,128")
    per_node = system.node.devices_per_node
    points = []
    for n in nodes:
        plan = scaled_plan(base, base.devices, n * per_node, weak)
        problems = plan_problems(plan, model)
        if problems:
            raise PerfsimError(f"at {n} nodes: " + "; ".join(problems))
        points.append((n, predict(model, system, plan, dtype)))
    n0, p0 = points[0]
    out = []
    for n, p in points:
        ratio = 1.0 if weak else n0 / n  # ideal step time relative to the first point's
        ideal = p0.step_time_s * ratio
        loss = {k: (v - p0.time_breakdown_s[k] * ratio) / p.step_time_s * 100 for k, v in p.time_breakdown_s.items()}
        out.append(ScalePoint(n, p, ideal / p.step_time_s, loss))
    return out
