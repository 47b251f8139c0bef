"""Observations: published results and measurements a profile must reproduce, as a TOML file
the profile names (`observations = "observations/<name>.toml"`, docs/profile-format.md).

    schema = 1
    [[observation]]
    name = "175B at 10% of peak"
    source = "where the number comes from, and which FLOP count and peak it is"
    model = "gpt3-175b"                      # preset, key=value spec or .toml file
    plan = { tp = 8, pp = 16, dp = 1, mbs = 3, gbs = 300, zero = 1, recompute = "full" }
    devices = 128                            # the plan's tp x pp x dp; for scaling, the scaled count
    quantity = "megatron_ds_tflops_per_device"
    value = 41.9
    tolerance = 6.3                          # same unit as value: a draw within value +- tolerance agrees

A quantity is one of the prediction's numbers (QUANTITIES) or a scaling efficiency at `devices`
from the plan's own size (weak: micro-batches per replica kept; strong: global batch kept; as
perfsim scale computes them).

The file may also name calibration ledgers measured on the machine, relative to its folder
(`ledgers = ["../ledgers/calibration-cpu.jsonl"]`): their kernels become observations too
(perfsim.uncertainty.ledger_observations), as `perfsim predict --uncertainty --observe` makes them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from perfsim.errors import PerfsimError
from perfsim.spec._toml import read_toml

QUANTITIES = ("step_time_s", "tokens_per_s", "samples_per_s", "model_tflops_per_device", "hardware_tflops_per_device",
              "megatron_ds_tflops_per_device", "mfu", "hfu")
SCALING = {"weak_scaling_efficiency": True, "strong_scaling_efficiency": False}
_PARTS = ("name", "source", "model", "plan", "devices", "quantity", "value", "tolerance")


@dataclass(frozen=True)
class Observation:
    name: str
    source: str
    model: object  # ModelSpec
    plan: object  # Plan
    devices: int
    quantity: str
    value: float
    tolerance: float

    def plans(self) -> tuple:
        """The plans whose predictions the quantity needs: the plan, and for a scaling efficiency
        the plan scaled to `devices`."""
        if self.quantity not in SCALING:
            return (self.plan,)
        from perfsim.scaling import scaled_plan

        return (self.plan, scaled_plan(self.plan, self.plan.devices, self.devices, SCALING[self.quantity]))

    def predicted(self, results: list) -> np.ndarray:
        """The quantity from the evaluate() results of plans(), one value per draw."""
        if self.quantity not in SCALING:
            return results[0][self.quantity]
        ideal_ratio = 1.0 if SCALING[self.quantity] else self.plan.devices / self.devices
        return results[0]["step_time_s"] * ideal_ratio / results[1]["step_time_s"]


def _number(where: str, key: str, raw, whole: bool = False) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int if whole else (int, float)) or not math.isfinite(raw) or raw <= 0:
        raise PerfsimError(f"{where}: {key} must be a positive {'whole number' if whole else 'number'}, got {raw!r}")
    return raw


def _observation(where: str, i: int, raw, system) -> Observation:
    from perfsim.spec.case import stack_defaults
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan, plan_problems

    key = f"observation[{i}]"
    if not isinstance(raw, dict):
        raise PerfsimError(f"{where}: {key} must be a table")
    for part in raw:
        if part not in _PARTS:
            raise PerfsimError(f"{where}: unknown key {key}.{part}; an observation holds {', '.join(_PARTS)}")
    for part in _PARTS:
        if part not in raw:
            raise PerfsimError(f"{where}: {key} has no {part}")
    for part in ("name", "source", "model"):
        if not isinstance(raw[part], str) or not raw[part].strip():
            raise PerfsimError(f"{where}: {key}.{part} must be a non-empty string")
    quantity = raw["quantity"]
    if quantity not in QUANTITIES + tuple(SCALING):
        raise PerfsimError(f"{where}: {key}.quantity must be one of {', '.join(QUANTITIES + tuple(SCALING))}, "
                           f"got {quantity!r}")
    if not isinstance(raw["plan"], dict):
        raise PerfsimError(f"{where}: {key}.plan must be an inline table of plan fields, e.g. {{ tp = 8, pp = 16 }}")
    try:
        plan = Plan(**stack_defaults(system, dict(raw["plan"])))
    except TypeError as exc:
        raise PerfsimError(f"{where}: {key}.plan: {exc}") from None
    model = load_model(raw["model"])
    problems = plan_problems(plan, model)
    if problems:
        raise PerfsimError(f"{where}: {key}.plan: {'; '.join(problems)}")
    devices = _number(where, f"{key}.devices", raw["devices"], whole=True)
    if quantity not in SCALING and devices != plan.devices:
        raise PerfsimError(f"{where}: {key}.devices is {devices} but the plan has tp x pp x dp = {plan.devices}")
    if quantity in SCALING and devices % plan.devices:
        raise PerfsimError(f"{where}: {key}.devices {devices} must be a multiple of the plan's {plan.devices} devices")
    obs = Observation(raw["name"], raw["source"], model, plan, devices, quantity,
                      float(_number(where, f"{key}.value", raw["value"])),
                      float(_number(where, f"{key}.tolerance", raw["tolerance"])))
    for scaled in obs.plans()[1:]:
        problems = plan_problems(scaled, model)
        if problems:
            raise PerfsimError(f"{where}: {key}: the plan at {devices} devices: {'; '.join(problems)}")
    return obs


def load_observations(path: str, system) -> tuple:
    """Every observation of the file at `path`, checked (plans valid for their models)."""
    data = read_toml(path, "observations file")
    where = f"observations file {path}"
    if data.get("schema") != 1 or isinstance(data.get("schema"), bool):
        raise PerfsimError(f"{where}: schema must be 1, got {data.get('schema')!r}")
    for key in data:
        if key not in ("schema", "description", "observation", "ledgers"):
            raise PerfsimError(f"{where}: unknown key {key}; the file holds schema, description, ledgers and "
                               "[[observation]] tables")
    ledgers = data.get("ledgers", [])
    if not isinstance(ledgers, list) or not all(isinstance(x, str) and x.strip() for x in ledgers):
        raise PerfsimError(f"{where}: ledgers must be a list of ledger paths (relative to the file's folder)")
    raws = data.get("observation", [])
    if not isinstance(raws, list):
        raise PerfsimError(f"{where}: observation must be [[observation]] tables")
    if not (raws or ledgers):
        raise PerfsimError(f"{where}: no [[observation]] tables and no ledgers")
    from perfsim.uncertainty.ledger_observations import ledger_observations

    folder = os.path.dirname(path)
    return tuple(_observation(where, i, raw, system) for i, raw in enumerate(raws)) + tuple(
        obs for ledger in ledgers for obs in ledger_observations(os.path.join(folder, ledger), system))
