"""One plan's prediction: step time, its breakdown, throughput, FLOP rates and peak memory."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from perfsim.cost import counts
from perfsim.cost.columns import FULL, SELECTIVE, Columns, at_dtype, columns_of, rows_of
from perfsim.cost.memory import peak_memory
from perfsim.cost.stage import stage_costs
from perfsim.errors import PerfsimError
from perfsim.schedule.analytic import step_time
from perfsim.spec.model import ModelSpec, load_model
from perfsim.spec.plan import Plan, plan_problems, uneven
from perfsim.spec.system import System, for_dtype, load_system

DTYPES = ("bf16", "fp16", "fp32", "fp8")


@dataclass(frozen=True)
class Prediction:
    devices: int
    step_time_s: float
    tokens_per_s: float
    samples_per_s: float
    model_flops_per_step: float
    hardware_flops_per_step: float
    model_tflops_per_device: float
    hardware_tflops_per_device: float
    megatron_ds_tflops_per_device: float
    mfu: float
    hfu: float
    peak_tflops_per_device: float
    time_breakdown_s: dict
    memory_bytes: dict
    memory_peak_stage: str
    device_memory_bytes: float
    fits: bool
    plan: Plan
    model: ModelSpec
    system: System = field(repr=False)
    dtype: str = "bf16"
    # share of the step's compute time priced by the parametric curves away from any kernel the
    # profile measured (1 for a profile without measured tables; perfsim.cost.measured)
    compute_extrapolated_share: float = 1.0
    # with an uneven split or a layout, what each pipeline stage holds (pipeline_stages); else empty
    pipeline_stages: tuple = ()

    def as_json(self) -> dict:
        """The `perfsim predict --json` object (README.md, "Use"; tests/test_predict_json.py holds its keys)."""
        return {
            "devices": self.devices, "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "samples_per_s": self.samples_per_s, "model_flops_per_step": self.model_flops_per_step,
            "hardware_flops_per_step": self.hardware_flops_per_step,
            "model_tflops_per_device": self.model_tflops_per_device,
            "hardware_tflops_per_device": self.hardware_tflops_per_device,
            "megatron_ds_tflops_per_device": self.megatron_ds_tflops_per_device,
            "mfu": self.mfu, "hfu": self.hfu, "peak_tflops_per_device": self.peak_tflops_per_device,
            "time_breakdown_s": self.time_breakdown_s, "memory_bytes": self.memory_bytes,
            "memory_peak_stage": self.memory_peak_stage, "device_memory_bytes": self.device_memory_bytes,
            "fits": self.fits, "plan": self.plan.as_dict(), "model": self.model.as_dict(),
            "system": self.system.name, "dtype": self.dtype,
            "compute_extrapolated_share": self.compute_extrapolated_share,
        } | ({"pipeline_stages": list(self.pipeline_stages)} if self.pipeline_stages else {})


def peak_flops(system: System, dtype: str) -> float:
    """The peak GEMMs of `dtype` run at and MFU and HFU are measured against. An fp8 step runs its
    layers' GEMMs at device.peak_flops_fp8 (perfsim.cost.layer.gemm_rate) and the rest, attention
    and logits, in bf16: it is measured against the bf16 peak (docs/equations.md 3.11)."""
    if dtype not in DTYPES:
        raise PerfsimError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "fp8":
        if system.device.peak_flops_fp8 is None:
            raise PerfsimError(f"system {system.name} has no FP8 peak (device.peak_flops_fp8): its device cannot "
                               f"train in FP8; use --dtype bf16, or a profile that states one (dgx-h100, dgx-b200)")
        return system.device.peak_flops_bf16
    return getattr(system.device, f"peak_flops_{dtype}")


MEMORY_KEYS = ("weights", "gradients", "optimizer", "activations", "buffers", "total")


def evaluate(model: ModelSpec, system: System, c: Columns, dtype: str = "bf16", fitting_only: bool = False) -> dict:
    """Every number of a prediction for the plans in `c` (numbers or numpy arrays): the one
    computation behind both `predict` and the search. Plans must be valid. `fitting_only`: time
    only the plans of a batch that fit in device memory (memory is the cheaper half of the cost
    and most of a search's plans do not fit); the others' time numbers are NaN (all but the first
    where none fits) and their memory numbers may be a lower bound (peak_memory's `capacity`)."""
    peak = peak_flops(system, dtype)
    c = at_dtype(c, dtype)
    system = for_dtype(system, dtype)
    memory = peak_memory(model, system, c, system.device.memory_bytes if fitting_only else None)
    fits = memory["total"] <= system.device.memory_bytes
    timed = None
    if fitting_only and np.ndim(fits) == 1 and np.ndim(c.tp) == 1 and not fits.all():
        timed = np.flatnonzero(fits) if fits.any() else np.arange(1)  # one row at least: every key has its numbers
    if timed is None:
        costs = stage_costs(model, system, c, peak)
        step, breakdown = step_time(model, system, c, costs)
        share = extrapolated_share(costs, c.pp, c.layout)
    else:
        some = rows_of(c, timed)
        costs = stage_costs(model, system, some, peak)
        step, breakdown = step_time(model, system, some, costs)
        share = extrapolated_share(costs, some.pp, some.layout)
        step, share = _at_rows(step, timed, len(fits)), _at_rows(share, timed, len(fits))
        breakdown = {k: _at_rows(v, timed, len(fits)) for k, v in breakdown.items()}
    recompute = np.where(c.recompute == FULL, counts.recompute_flops_per_sample(model, "full"),
                         np.where(c.recompute == SELECTIVE, counts.recompute_flops_per_sample(model, "selective"), 0.0))
    recompute = recompute + c.flash * counts.flash_recompute_flops_per_sample(model)
    model_flops = c.gbs * counts.model_flops_per_sample(model, c.tp)
    ds_flops = c.gbs * np.where(c.recompute == FULL, counts.megatron_ds_flops_per_sample(model, c.tp, True),
                                counts.megatron_ds_flops_per_sample(model, c.tp, False))
    per_device = step * c.tp * c.cp * c.pp * c.dp
    return {
        "step_time_s": step, "tokens_per_s": c.gbs * model.seq / step, "samples_per_s": c.gbs / step,
        "model_flops_per_step": model_flops, "hardware_flops_per_step": model_flops + c.gbs * recompute,
        "model_tflops_per_device": model_flops / per_device / 1e12,
        "hardware_tflops_per_device": (model_flops + c.gbs * recompute) / per_device / 1e12,
        "megatron_ds_tflops_per_device": ds_flops / per_device / 1e12,
        "mfu": model_flops / per_device / peak, "hfu": (model_flops + c.gbs * recompute) / per_device / peak,
        "time_breakdown_s": breakdown, "memory_bytes": {k: memory[k] for k in MEMORY_KEYS},
        "memory_peak_stage": memory["stage"], "fits": fits, "peak_flops": peak, "compute_extrapolated_share": share,
    }


def _at_rows(values, rows, n: int) -> np.ndarray:
    """`values` of the rows `rows` of n as an array of n, NaN elsewhere."""
    out = np.full(n, np.nan)
    out[rows] = values
    return out


def extrapolated_share(costs, pp, layout=None):
    """Share of a step's compute (and recompute) time priced by the parametric curves alone: the
    stages' curve parts over their compute, the first and last stage once each and pp - 2 middle
    stages (with pp 1 the first stage holds everything), or every stage of a layout once."""
    if layout is not None:
        stages = [s for s, _ in costs.by_position.values()]
        weights = [1.0] * len(stages)
    else:
        weights = (1.0, np.maximum(pp - 2, 0), np.where(pp > 1, 1.0, 0.0))
        stages = (costs.first, costs.middle, costs.last)
    curve = sum(w * s.curve for w, s in zip(weights, stages))
    return np.clip(curve / sum(w * (s.compute + s.recompute) for w, s in zip(weights, stages)), 0.0, 1.0)


def predict(model: ModelSpec | str, system: System | str, plan: Plan, dtype: str = "bf16") -> Prediction:
    """Predict one training step of `model` on `system` under `plan` (names are loaded)."""
    model = load_model(model) if isinstance(model, str) else model
    system = load_system(system) if isinstance(system, str) else system
    problems = plan_problems(plan, model)
    if problems:
        raise PerfsimError("; ".join(problems))
    r = evaluate(model, system, columns_of(plan), dtype)
    scalar = {k: float(r[k]) for k in ("step_time_s", "tokens_per_s", "samples_per_s", "model_flops_per_step",
                                       "hardware_flops_per_step", "model_tflops_per_device",
                                       "hardware_tflops_per_device", "megatron_ds_tflops_per_device", "mfu", "hfu")}
    return Prediction(
        devices=plan.devices, **scalar, peak_tflops_per_device=r["peak_flops"] / 1e12,
        time_breakdown_s={k: float(v) for k, v in r["time_breakdown_s"].items()},
        memory_bytes={k: float(v) for k, v in r["memory_bytes"].items()},
        memory_peak_stage=str(r["memory_peak_stage"]), device_memory_bytes=system.device.memory_bytes,
        fits=bool(r["fits"]), plan=plan, model=model, system=system, dtype=dtype,
        compute_extrapolated_share=float(r["compute_extrapolated_share"]),
        pipeline_stages=pipeline_stages(model, system, plan, dtype) if uneven(plan) else (),
    )


def pipeline_stages(model: ModelSpec, system: System, plan: Plan, dtype: str = "bf16") -> tuple:
    """What each pipeline stage of a valid `plan` holds and does, stage by stage (docs/equations.md
    9.4, 7.3): its chunks in Megatron-Core's layout letters, its decoder layers, parameters, the
    micro-batches each chunk keeps in flight at the stage's activation peak, and its time per
    micro-batch (all chunks)."""
    from perfsim.cost import pipeline
    from perfsim.cost.memory import stage_params

    c = at_dtype(columns_of(plan), dtype)
    costs = stage_costs(model, for_dtype(system, dtype), c, peak_flops(system, dtype))
    out = []
    for i in range(plan.pp):
        pos = pipeline.position_of(c, i)
        layers = pipeline.chunk_layers(model, c, pos)
        edges = pipeline.chunk_edges(c, pos)
        chunks = ["E" * e + "t" * n + "m" * u + "L" * loss for n, (e, loss, u) in zip(layers, edges)]
        _, in_flight = pipeline.peak_state(c, i, [n + u for n, (_, _, u) in zip(layers, edges)])
        out.append({"stage": i, "chunks": chunks, "layers": sum(layers), "mtp_layers": sum(u for _, _, u in edges),
                    "params": float(stage_params(model, c, pos)), "in_flight": in_flight,
                    "time_per_microbatch_s": float(costs.by_position[pos][0].total)})
    return tuple(out)
