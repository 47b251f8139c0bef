"""Framework overheads measured by construction: the tensor-parallel layer overhead (tp_overhead
points), and the per-step, per-layer and per-micro-batch host time of the training loop, fitted on
real training steps of a calibration model whose shape is its own, never the validation model's
(docs/equations.md 8.2, docs/calibration.md).

The step runs (`perfsim calibrate`, suite "overheads", through validate.timing) train the
calibration model with L layers and m micro-batches per step under data parallelism over every
rank. Each run's measured step time T, less what the calibrated profile predicts for it with the
three overheads at 0 (P0: its kernels, collectives and optimizer), is the loop's own time:

    T - P0 = step_overhead_s + m x microbatch_overhead_s + m L x layer_overhead_s

fitted by non-negative least squares on OVERHEAD_RUNS[:-1]; the last run, (2 layers, 2
micro-batches), is held out and predicted. T is each run's step time moved to the profile's speed
by the speed probes of its steps (`at_profile_speed`): a run that met a slow spell would otherwise
fit the spell into the overheads.

With more than one rank the suite also runs the held-out run's replica alone on every rank at once
(`alone_case`: each rank its own copy, no collective inside the step), whose ranks' step times
spread as their speeds do: framework.rank_jitter, fitted first (`fit_rank_jitter`), since every
synchronised run above waits that much for its slowest rank (docs/equations.md 9.5).
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import numpy as np

from perfsim.calibrate.common import Fitted, Quality, mape
from perfsim.probed_speed import speed_shifts


TP_OVERHEAD_KEYS = {"1d": ("framework.tp_layer_overhead_s", "1d"), "1d_sp": ("framework.sp_layer_overhead_s", "1d + SP")}


def fit_tp_overhead(records, ledger) -> tuple:
    """(values, notes): the host time DTensor's 1d layer adds, without and with SP, from the
    tp_overhead points (every round's difference of the two layers; their median, floored at 0:
    a machine's noise can make a small overhead read negative)."""
    values, notes = {}, []
    for op, (key, label) in TP_OVERHEAD_KEYS.items():
        points = [r for r in records if r["suite"] == "tp_overhead" and r["op"] == op]
        if not points:
            continue
        diffs = sorted(d for r in points for d in r["overhead_s"])
        value = max(0.0, float(np.median(diffs)))
        d = points[0]["shape"]
        seqs = " / ".join(str(s) for s in sorted({r["shape"]["seq"] for r in points}))
        layers = sorted(r["reference_stats"]["median_s"] * 1e3 for r in points if "reference_stats" in r)
        span = f"; Megatron's layer {layers[0]:.3g}-{layers[-1]:.3g} ms" if layers else ""
        values[key] = Fitted(value, f"median of {len(diffs)} alternating rounds of ledger {ledger}: validate.gpt's "
                                    f"layer under DTensor ({label}) against "
                                    f"Megatron's, forward + backward, hidden {d['hidden']}, {seqs} tokens x {d['mbs']}, "
                                    f"tp {points[0]['group'][0]}{span} (validate/tp_overhead.py)")
        notes.append(f"tensor-parallel overhead {label}: {value * 1e3:.3g} ms a layer and micro-batch "
                     f"(rounds' differences {diffs[0] * 1e3:.3g} to {diffs[-1] * 1e3:.3g} ms)")
    return values, notes


# The calibration model: small enough that its steps are mostly the loop's own time on any device,
# and unlike the validation model (validate.timing.DEFAULT_MODEL) in every dimension.
CALIBRATION_MODEL = "layers={layers},hidden=256,heads=4,seq=128,vocab=2048,tied_embeddings=false,dropout=false"
OVERHEAD_RUNS = ((1, 1), (3, 1), (1, 3), (3, 3), (2, 2))  # (layers, micro-batches); the last held out
QUICK_RUNS = ((1, 1), (2, 1), (1, 2), (2, 2))
# Layers of other variants at (2 layers, 2 micro-batches), held out of the fit: their host time is
# the calibration layer's scaled by the ops they dispatch (perfsim.cost.host.HARNESS_LAYER_OPS), which
# these runs check on the machine (not in --quick).
VARIANT_RUNS = ({"attention": "flash"}, {"recompute": "full"})
OVERHEAD_KEYS = ("framework.step_overhead_s", "framework.microbatch_overhead_s", "framework.layer_overhead_s")


TRAINING_DTYPE = "bf16"  # what validation and training steps run in (perfsim validate's default)


def overheads_dtype(dtypes) -> str:
    """The dtype of the overhead runs among the calibration's `dtypes`: the training dtype where it
    is one of them (a CPU's host time per op is its dtype's: the host model's layer took 0.42 ms in
    fp32 and 0.74 ms in bf16 on the project VM), else the first."""
    return TRAINING_DTYPE if TRAINING_DTYPE in dtypes else next(iter(dtypes), TRAINING_DTYPE)


def overhead_cases(nproc: int, quick: bool = False) -> list:
    """[(model spec, [Plan, ...]), ...] of the overhead runs, grouped by model (one launch list
    each): data parallelism over the `nproc` ranks, micro-batches of one sequence."""
    from perfsim.spec.plan import Plan

    by_layers: dict = {}
    for layers, m in QUICK_RUNS if quick else OVERHEAD_RUNS:
        by_layers.setdefault(layers, []).append(Plan(dp=nproc, mbs=1, gbs=m * nproc))
    layers, m = OVERHEAD_RUNS[-1]
    for variant in () if quick else VARIANT_RUNS:
        by_layers[layers].append(Plan(dp=nproc, mbs=1, gbs=m * nproc, **variant))
    return [(CALIBRATION_MODEL.format(layers=layers), plans) for layers, plans in by_layers.items()]


def rank_spread(measured: dict) -> dict | None:
    """How the ranks' own step times spread over a plan's timed steps (those at the profile's speed,
    else all; validate.steps gathers every rank's): `cv`, the coefficient of variation of a rank's
    time about its step's mean over the ranks, pooled over the steps (the root of the mean of each
    step's unbiased variance of the ranks' times over their mean: the part the ranks share, a
    machine-wide slow spell, drops out, as in framework.rank_jitter); `wait`, the mean over the
    steps of the slowest rank's time over the ranks' mean, less 1 (what a step whose ranks meet only
    at its end waits for its slowest rank, the quantity docs/equations.md 9.5 prices). A synchronised plan's
    ranks wait for each other at every collective, so only what follows its last collective (and
    the barrier's release) spreads; a plan run `alone` on every rank spreads as the ranks' speeds
    do. None for records from before per-rank times were gathered, and from one rank."""
    per_step = measured.get("rank_step_times_s")
    if not per_step or len(per_step[0]) < 2:
        return None
    flags = measured.get("at_speed") or [True] * len(per_step)
    chosen = [ranks for ranks, ok in zip(per_step, flags) if ok] or per_step
    variances, excess = [], []
    for ranks in chosen:
        mean = statistics.fmean(ranks)
        variances.append(statistics.variance([t / mean for t in ranks]))
        excess.append(max(ranks) / mean - 1)
    return {"ranks": len(per_step[0]), "steps": len(chosen), "cv": statistics.fmean(variances) ** 0.5,
            "wait": statistics.fmean(excess), "alone": bool(measured.get("alone"))}


# Timed steps of the run alone: each gives one variance of the ranks' times (n - 1 degrees of
# freedom), so 6 put the spread within about 30% on two ranks, 10% on eight.
ALONE_STEPS, QUICK_ALONE_STEPS = 6, 3


def alone_case(nproc: int) -> tuple | None:
    """(model spec, [Plan]) of the run alone on every rank: the held-out run's replica on one device
    (perfsim.calibrate.overheads module docstring); None on one rank, whose spread is no one's."""
    from perfsim.spec.plan import Plan

    if nproc < 2:
        return None
    layers, m = OVERHEAD_RUNS[-1]
    return CALIBRATION_MODEL.format(layers=layers), [Plan(mbs=1, gbs=m)]


# The host model: the calibration model's layer at its smallest shapes, whose kernels are a small part
# of its time on any device, a CPU core included. On a CPU core the calibration model's layers are
# mostly kernels (a layer took 8.2 ms in fp32 on the project VM, its kernels predicted at 8.85), so
# a few percent of kernel error outweighs their host time and the step runs' layer term took it
# (0.1 to 5 ms over the transfer ledgers' profiles, 0 on the VM's calibration of 2026-11-28, whose
# host runs measured 0.78 ms). Its runs, alone on every rank (no collective to wait at), at
# HOST_RUNS (layers, micro-batches), give framework.layer_overhead_s (fit_layer_overhead).
HOST_MODEL = "layers={layers},hidden=32,heads=2,seq=16,vocab=256,tied_embeddings=false,dropout=false"
HOST_RUNS = ((1, 2), (3, 2))
HOST_STEPS, QUICK_HOST_STEPS = 10, 3


def host_cases() -> list:
    """[(model spec, [Plan]), ...] of the host model's runs, each a one-device plan run alone on every
    rank (validate.timing.run_plans(alone=True))."""
    from perfsim.spec.plan import Plan

    return [(HOST_MODEL.format(layers=layers), [Plan(mbs=1, gbs=m)]) for layers, m in HOST_RUNS]


def is_host_run(record) -> bool:
    """Whether a steps-ledger record is one of the host model's runs."""
    return record.get("model") in {HOST_MODEL.format(layers=layers) for layers, _ in HOST_RUNS}


def fit_rank_jitter(step_records: list, ledger: str) -> tuple:
    """(values, notes): framework.rank_jitter from the runs alone on every rank, the sigma whose priced
    wait sigma x E[max of n normals] is the wait they measured (rank_spread's `wait`, pooled over their
    steps; docs/equations.md 9.5); none, with a note saying why, where the ledger has no such run.
    The note names the ranks' coefficient of variation beside it (above sigma where a few slow steps
    make the spread's tails heavier than a normal's) and the synchronised runs' spread, which is
    what follows their last collective: a lower bound."""
    from perfsim.cost.synchrony import expected_max_normal

    step_records = [r for r in step_records if not is_host_run(r)]  # fit_layer_overhead's
    if not step_records:
        return {}, []
    alone = [r for r in step_records if r["measured"].get("alone")]
    spreads = [x for r in alone if (x := rank_spread(r["measured"])) is not None]
    together = [x for r in step_records if not r["measured"].get("alone") and (x := rank_spread(r["measured"]))]
    span = sorted({f"{100 * x['cv']:.2g}%" for x in together}, key=lambda t: float(t[:-1]))
    lower = (f"; the synchronised runs' ranks spread {' to '.join(dict.fromkeys((span[0], span[-1])))} (what "
             f"follows their last collective: a lower bound)") if together else ""
    if not spreads:
        why = ("has no run alone on every rank (the overheads suite runs one with more than one rank; "
               "ledgers before it have none)") if not alone else "has runs alone on one rank only"
        return {}, [f"rank jitter: ledger {ledger} {why}; framework.rank_jitter left as in the base profile{lower}"]
    steps = sum(x["steps"] for x in spreads)
    ranks = spreads[0]["ranks"]
    wait = sum(x["steps"] * x["wait"] for x in spreads) / steps
    cv = (sum(x["steps"] * x["cv"] ** 2 for x in spreads) / steps) ** 0.5
    sigma = wait / expected_max_normal(ranks)
    where = (f"the ranks' own step times of {len(spreads)} run(s) of the calibration model alone on each of {ranks} "
             f"ranks at once ({steps} timed steps, no collective inside a step) in ledger {ledger}: the slowest "
             f"rank's mean excess over the ranks' mean, {100 * wait:.2g}%, over E[max of {ranks} normals] "
             f"(perfsim.calibrate.overheads.fit_rank_jitter)")
    note = (f"rank jitter {100 * sigma:.2g}% from {steps} steps alone on {ranks} ranks: the slowest rank "
            f"{100 * wait:.2g}% above their mean; their coefficient of variation {100 * cv:.2g}%{lower}")
    return {"framework.rank_jitter": Fitted(float(sigma), where)}, [note]


def _variant(plan) -> bool:
    """Whether an overhead run's layers are another variant than the calibration layer's."""
    return plan.attention != "unfused" or plan.recompute != "none"


def overheads_ledger(ledger: str) -> str:
    """The step ledger of the overhead runs beside a calibration ledger: NAME-overheads.jsonl."""
    stem, ext = os.path.splitext(ledger)
    return f"{stem}-overheads{ext or '.jsonl'}"


def master_adam_bytes(element: int) -> int:
    """Bytes validate.optim.MasterAdam moves per parameter with `element`-byte parameters and
    gradients: the gradient read and written as an fp32 copy (no copy when it is fp32 already),
    that copy read by the fused AdamW with the fp32 master weight, momentum and variance (read and
    written), then the master read and written to the parameter (docs/equations.md 6.3)."""
    from perfsim.cost.layer import FP32
    from perfsim.cost.memory import OPTIMIZER_BYTES_PER_PARAM

    cast = element + FP32 if element != FP32 else 0
    return cast + FP32 + 2 * OPTIMIZER_BYTES_PER_PARAM + FP32 + element


def as_trained(system, dtype: str, device_kind: str = "cpu"):
    """The profile as the harness trains in `dtype` on a `device_kind` device: gradients in the
    parameters' dtype, accumulated over micro-batches by autograd's in-place adds, updated by
    validate.optim.MasterAdam and freed after the step (zero_grad(set_to_none=True)), with none of
    Megatron-Core's passes over a gradient buffer (perfsim.cost.grad_passes), its buffers' padding,
    Transformer Engine's workspace or FP8 weights (perfsim.cost.stack_memory, fp8); on a GPU the
    host queueing kernels ahead of the device (framework.host_overlap) and, in bf16, the step under
    torch.autocast (validate.gpt.autocast_for: framework.autocast)."""
    from perfsim.calibrate.host_bound import ASYNCHRONOUS_KINDS
    from perfsim.cost.columns import ELEMENT_BYTES

    gpu = device_kind in ASYNCHRONOUS_KINDS
    element = ELEMENT_BYTES[dtype]
    framework = dataclasses.replace(system.framework, grad_bytes_per_param=element,
                                    optimizer_bytes_per_param=float(master_adam_bytes(element)),
                                    grad_accumulation_bytes_per_param=3.0 * element, grads_set_to_none=1.0,
                                    grad_buffer_pass_bytes_per_param=None, workspace_bytes=None,
                                    buffer_alignment_elements=None, fp8_param_gather=None,
                                    host_overlap=float(gpu), autocast=float(gpu and dtype == "bf16"))
    return dataclasses.replace(system, framework=framework)


def _run(record) -> tuple:
    """(model, plan, dtype, layers, micro-batches, device kind) of a step record."""
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan

    known = {f.name for f in dataclasses.fields(Plan)}
    plan = Plan(**{k: v for k, v in record["plan"].items() if k in known})
    model = load_model(record["model"])
    device = record["measured"].get("device")
    return model, plan, record["dtype"], model.layers, plan.microbatches, device.get("kind", "cpu") if isinstance(device, dict) else "cpu"


def at_profile_speed(measured: dict, breakdown: dict) -> float:
    """A run's step time moved to the profile's speed: the median, over the steps its step time is
    taken from (those at speed, else all), of each step less what its probes' speed added to the
    parts `breakdown` (perfsim.probed_speed). A run that met a slow spell in every step then still
    measures the loop's own time, not the spell. As measured for records without probes."""
    shifts = speed_shifts(measured, breakdown)
    if shifts is None:
        return float(measured["step_time_s"])
    steps = list(zip(measured["step_times_s"], shifts))
    flags = measured.get("at_speed") or [True] * len(steps)
    chosen = [t - shift for (t, shift), ok in zip(steps, flags) if ok] or [t - shift for t, shift in steps]
    return float(np.median(chosen))


def fit_layer_overhead(host_records: list, system) -> tuple | None:
    """(layer_overhead_s, note) from the host model's runs (HOST_RUNS), or None without two of
    them: each run's step at the profile's speed less its kernels where the host runs them
    (1 - host_overlap of P0, the prediction with the three overheads at 0), over the ranks' wait
    (the runs' step is their slowest rank's, docs/equations.md 9.5); the layer's time is the
    difference of the two runs over their difference in layers x micro-batches, floored at 0."""
    from perfsim.cost.synchrony import expected_max_normal, rank_jitter
    from perfsim.predict import predict

    zero = dataclasses.replace(system, framework=dataclasses.replace(
        system.framework, step_overhead_s=0.0, microbatch_overhead_s=0.0, layer_overhead_s=0.0))
    runs = {}
    for r in host_records:
        model, plan, dtype, layers, m, kind = _run(r)
        trained = as_trained(zero, dtype, kind)
        p0 = predict(model, trained, plan, dtype)
        t = at_profile_speed(r["measured"], p0.time_breakdown_s)
        wait = 1.0 + rank_jitter(system) * expected_max_normal(int(r["measured"].get("world", 1)))
        runs[layers * m] = (t / wait - (1 - trained.framework.host_overlap) * p0.step_time_s, t, p0.step_time_s)
    if len(runs) < 2:
        return None
    ordered = sorted(runs.items())
    (few, (low, t_low, p_low)), (many, (high, t_high, p_high)) = ordered[0], ordered[-1]
    value = max(0.0, (high - low) / (many - few))
    note = (f"layer overhead {value * 1e3:.3g} ms a layer and micro-batch from the host model's runs alone "
            f"({few} and {many} layers x micro-batches: {t_low * 1e3:.3g} and {t_high * 1e3:.3g} ms measured, "
            f"{p_low * 1e3:.3g} and {p_high * 1e3:.3g} ms of kernels, collectives and optimizer predicted)")
    return value, note


def fit_framework_overheads(step_records: list, system, ledger: str) -> tuple:
    """(values, quality rows, notes): step_overhead_s, microbatch_overhead_s and layer_overhead_s
    from the overhead runs' step records (module docstring), against `system`, the profile
    calibrated from the kernels."""
    from perfsim.cost.synchrony import expected_max_normal, rank_jitter
    from perfsim.predict import predict
    from scipy.optimize import nnls

    host = fit_layer_overhead([r for r in step_records if is_host_run(r)], system)
    step_records = [r for r in step_records if not r["measured"].get("alone")]  # fit_rank_jitter's, the host's
    if not step_records:
        return {}, [], []
    zero = dataclasses.replace(system, framework=dataclasses.replace(
        system.framework, step_overhead_s=0.0, microbatch_overhead_s=0.0, layer_overhead_s=0.0))
    rows, overlapped = [], []
    for r in step_records:
        model, plan, dtype, layers, m, kind = _run(r)
        trained = as_trained(zero, dtype, kind)
        p0 = predict(model, trained, plan, dtype)
        t = at_profile_speed(r["measured"], p0.time_breakdown_s)
        rows.append((layers, m, t, p0.step_time_s, (layers, m) == OVERHEAD_RUNS[-1], (model, trained, plan, dtype)))
        overlapped.append(trained.framework.host_overlap)
    variants = [x for x in rows if _variant(x[5][2])]
    rows = [x for x in rows if not _variant(x[5][2])]
    fitted = [x for x in rows if not x[4]]
    if len(fitted) < 3:
        return {}, [], [f"overheads: {len(fitted)} step runs of the calibration model, 3 needed to fit the step, "
                        f"micro-batch and layer overheads; keys left as in the base profile"]
    # each run waits for its slowest rank on the overheads too (docs/equations.md 9.5)
    waits = lambda xs: np.array([[1.0 + rank_jitter(system) * expected_max_normal(x[5][2].devices)] for x in xs])  # noqa: E731
    design = lambda xs: np.array([[1.0, m, m * layers] for layers, m, *_ in xs]) * waits(xs)  # noqa: E731
    # The host's time is the step less its kernels where the host runs them (a CPU rank); where it
    # queues them for a GPU, the calibration model's kernels, a fraction of its host time by
    # construction, run beside it, and the step is the host's time (cost/host.py).
    hidden = max(overlapped)
    gap = np.array([t - (1 - hidden) * p0 for _, _, t, p0, *_ in fitted])
    if host is None:
        coefficients, _ = nnls(design(fitted), gap)
    else:  # the layer's time measured by the host model's runs: the step and micro-batch terms fitted beside it
        a = design(fitted)
        loop, _ = nnls(a[:, :2], gap - a[:, 2] * host[0])
        coefficients = np.array([loop[0], loop[1], host[0]])

    def predicted(xs):  # each run through the whole model with the fitted overheads
        out = []
        for *_, (model, trained, plan, dtype) in xs:
            framework = dataclasses.replace(trained.framework, **{key.split(".")[1]: float(v)
                                                                  for key, v in zip(OVERHEAD_KEYS, coefficients)})
            out.append(predict(model, dataclasses.replace(trained, framework=framework), plan, dtype).step_time_s)
        return np.array(out)

    measured = lambda xs: np.array([x[2] for x in xs])  # noqa: E731
    held = [x for x in rows if x[4]]
    kernels_alone = mape([x[3] for x in rows], measured(rows))
    runs = ", ".join(f"{layers} layer{'s' * (layers > 1)} x {m} micro-batch{'es' * (m > 1)}" for layers, m, *_ in fitted)
    where = (f"{len(fitted)} runs of real training steps of the calibration model ({runs}; {CALIBRATION_MODEL.format(layers='L')}, "
             f"data parallelism over {int(_run(step_records[0])[1].dp)} ranks) in ledger {ledger}: measured step less the "
             f"calibrated profile's prediction without overheads{' (kernels beside the host: not subtracted)' if hidden else ''}, "
             f"non-negative least squares over "
             f"[1, micro-batches{', micro-batches x layers' if host is None else ''}] (perfsim.calibrate.overheads)")
    values = {key: Fitted(float(v), where) for key, v in zip(OVERHEAD_KEYS, coefficients)}
    if host is not None:
        values["framework.layer_overhead_s"] = Fitted(float(coefficients[2]), (
            f"the host model's runs alone on every rank ({HOST_MODEL.format(layers='L')}; (layers, micro-batches) "
            f"{' and '.join(map(str, HOST_RUNS))}) in ledger {ledger}: the difference of their steps less the "
            f"calibrated profile's prediction without overheads, over their difference in layers x micro-batches "
            f"(perfsim.calibrate.overheads.fit_layer_overhead); the step and micro-batch overheads fitted beside it"))
    quality = [Quality("framework overheads (real steps of the calibration model)", mape(predicted(fitted), measured(fitted)),
                       len(fitted), mape(predicted(held), measured(held)) if held else float("nan"), len(held),
                       note=f"kernels, collectives and optimizer alone: {100 * kernels_alone:.1f}% on all runs")]
    if variants:
        names = ", ".join(sorted({"flash attention" if x[5][2].attention != "unfused" else f"{x[5][2].recompute} recomputation"
                                  for x in variants}))
        quality.append(Quality(f"  other layers ({names}), host time by their ops", float("nan"), 0,
                               mape(predicted(variants), measured(variants)), len(variants),
                               note="held out: perfsim.cost.host.HARNESS_LAYER_OPS against the machine"))
    step, mb, layer = coefficients
    notes = [host[1]] if host is not None else []
    notes += [f"framework overheads from {len(rows)} step runs of the calibration model: {step * 1e3:.3g} ms a step, "
              f"{mb * 1e3:.3g} ms a micro-batch, {layer * 1e3:.3g} ms a layer and micro-batch "
              f"(the profile's kernels alone predicted {100 * kernels_alone:.1f}% off)"]
    return values, quality, notes
