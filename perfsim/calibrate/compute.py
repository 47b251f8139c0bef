"""GEMMs: the efficiency model on the first measured dtype and a peak per other dtype; the causal
fused (flash) attention kernel's efficiencies; the attention check."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from perfsim.errors import PerfsimError
from perfsim.calibrate.common import (Fitted, PRIMARY_DTYPE, Quality, TARGETS, least_squares, mape,
                                      measured_times, split_held_out, with_fields)


def _gemms(records):
    from perfsim.cost.layer import Gemm

    s = [r["shape"] for r in records]
    col = lambda k, default=None: np.array([x.get(k, default) for x in s], float)  # noqa: E731
    return Gemm("measured", col("count", 1), col("m"), col("n"), col("k"))


def _k_apart(g) -> bool:
    """Whether GEMM shapes tell the reduction dimension's half-dim from m's and n's: some pair
    differs in k alone (count, m and n equal) and some pair in m or n alone (count and k equal),
    each by 2x or more."""
    def alone(varied, fixed):
        seen: dict = {}
        for i in range(len(g.m)):
            seen.setdefault(tuple(float(getattr(g, f)[i]) for f in fixed), []).append(float(getattr(g, varied)[i]))
        return any(max(v) >= 2 * min(v) for v in seen.values())
    return alone("k", ("count", "m", "n")) and (alone("m", ("count", "n", "k")) or alone("n", ("count", "m", "k")))


def fit_gemms(records, system, kind, ledger):
    """gemm_efficiency and gemm_half_dim (docs/equations.md 3.1) on the first measured dtype, with
    gemm_half_dim_k where the fitted shapes vary k apart from m and n (_k_apart; otherwise k keeps
    the base profile's half-dim, as before): least squares on log time through gemm_time; a peak
    per other dtype."""
    from perfsim.cost.layer import gemm_time
    from perfsim.predict import peak_flops

    values, quality, notes = {}, [], []
    dtypes = [d for d in PRIMARY_DTYPE.get(kind, PRIMARY_DTYPE["cuda"])
              if any(r["suite"] == "gemm" and r["dtype"] == d for r in records)]
    if not dtypes:
        return values, quality, notes, system
    dev = system.device
    primary = dtypes[0]
    fit, held = split_held_out([r for r in records if r["dtype"] == primary], "gemm")
    if len(fit) < 3:
        notes.append(f"only {len(fit)} {primary} GEMM points to fit: GEMM model left as in the base profile")
        return values, quality, notes, system
    peak = peak_flops(system, primary)
    g_fit, t_fit = _gemms(fit), measured_times(fit)

    with_k = _k_apart(g_fit)

    def predict(x, g, peak_value):
        k_field = {"gemm_half_dim_k": math.exp(x[2])} if with_k else {}
        d = dataclasses.replace(dev, gemm_efficiency=math.exp(x[0]), gemm_half_dim=math.exp(x[1]), **k_field)
        return gemm_time(d, peak_value, g)

    x0 = [math.log(dev.gemm_efficiency), math.log(max(dev.gemm_half_dim, 1.0))]
    bounds = ([math.log(1e-4), 0.0], [math.log(10.0), math.log(1e6)])  # half-dims >= 1 element
    if with_k:
        x0.append(math.log(max(dev.gemm_half_dim if dev.gemm_half_dim_k is None else dev.gemm_half_dim_k, 1.0)))
        bounds = (bounds[0] + [0.0], bounds[1] + [math.log(1e6)])
    x = least_squares(lambda x: np.log(predict(x, g_fit, peak) / t_fit), x0, bounds)
    eff, half = math.exp(x[0]), math.exp(x[1])
    half_k = math.exp(x[2]) if with_k else None
    quality.append(Quality(f"gemm {primary}", mape(predict(x, g_fit, peak), t_fit), len(fit),
                           mape(predict(x, _gemms(held), peak), measured_times(held)) if held else float("nan"), len(held),
                           TARGETS["gemm"]))
    where = f"{len(fit)} {primary} GEMM shapes of ledger {ledger} (least squares on log time through perfsim.cost.layer.gemm_time)"
    peaks = {}
    if eff > 1.0:
        notes.append(f"{primary} GEMMs reached {eff:.2f} x peak_flops_{primary}: the base peak is too low; "
                     f"peak raised by that factor, gemm_efficiency 1")
        peaks[primary] = peak * eff
        peaks_source = f"raised to what {primary} GEMMs reached ({eff:.3f} x the base profile's {peak:.4g}), {where}"
        values[f"device.peak_flops_{primary}"] = Fitted(peak * eff, peaks_source)
        eff = 1.0
    also = " and gemm_half_dim_k" if with_k else ""
    values["device.gemm_efficiency"] = Fitted(eff, f"fitted with gemm_half_dim{also} on {where}")
    values["device.gemm_half_dim"] = Fitted(half, f"fitted with gemm_efficiency{also} on {where}")
    if with_k:
        values["device.gemm_half_dim_k"] = Fitted(half_k, f"the reduction dimension's, fitted with gemm_efficiency "
                                                           f"and gemm_half_dim on {where}: shapes differing in k alone "
                                                           f"and in m or n alone tell them apart")
    else:
        notes.append(f"no {primary} GEMM shapes differing in k alone and in m or n alone: one half-dim for m, n and "
                     f"k" + ("" if dev.gemm_half_dim_k is None else ", k's kept as in the base profile"))
    system = with_fields(system, device={"gemm_efficiency": eff, "gemm_half_dim": half,
                                      **({"gemm_half_dim_k": half_k} if with_k else {}),
                                      **{f"peak_flops_{d}": v for d, v in peaks.items()}})
    dev = system.device
    for dtype in dtypes[1:]:
        fit_d, held_d = split_held_out([r for r in records if r["dtype"] == dtype], "gemm")
        if len(fit_d) < 2:
            continue
        base_peak = peak_flops(system, dtype)
        g_d, t_d = _gemms(fit_d), measured_times(fit_d)
        y = least_squares(lambda y: np.log(gemm_time(dev, base_peak * math.exp(y[0]), g_d) / t_d), [0.0],
                           ([math.log(1e-3)], [math.log(1e3)]))
        new_peak = base_peak * math.exp(y[0])
        quality.append(Quality(f"gemm {dtype}", mape(gemm_time(dev, new_peak, g_d), t_d), len(fit_d),
                               mape(gemm_time(dev, new_peak, _gemms(held_d)), measured_times(held_d)) if held_d else float("nan"),
                               len(held_d), TARGETS["gemm"],
                               note=f"peak rescaled x{new_peak / base_peak:.2f}, efficiency model of {primary}"))
        values[f"device.peak_flops_{dtype}"] = Fitted(
            new_peak, f"the {dtype} peak that, with the {primary} efficiency model (gemm_efficiency {eff:.3g}, "
                      f"gemm_half_dim {half:.3g}{'' if half_k is None else f', gemm_half_dim_k {half_k:.3g}'}), predicts {len(fit_d)} {dtype} GEMM shapes of ledger {ledger} "
                      f"(base profile: {base_peak:.4g}); one efficiency model per profile, so the dtype's speed is in its peak")
        system = with_fields(system, device={f"peak_flops_{dtype}": new_peak})
        dev = system.device
    return values, quality, notes, system



def _flash_shapes(records) -> list:
    """(count, m, n, k) columns of attention records: batch x heads sequence-heads of s x s x d."""
    s = [r["shape"] for r in records]
    return [np.array([x["batch"] * x["heads"] for x in s], float), np.array([x["seq"] for x in s], float),
            np.array([x["seq"] for x in s], float), np.array([x["head_dim"] for x in s], float)]


def fit_flash(records, system, kind, ledger):
    """device.flash_forward_efficiency, flash_backward_efficiency and flash_score_s from the causal
    fused attention kernel's measured times (validate.microbench, ops "flash", "flash_backward"), at
    the first measured dtype's peak, through perfsim.cost.layer.flash_curve_times:

    - forward: time less one launch = executed FLOPs / (peak x e) + scores x flash_score_s, linear
      in (1 / e, flash_score_s): non-negative least squares on the relative error, where the fitted
      shapes hold two head dimensions or more (what tells the products' time from the softmax's);
      otherwise flash_score_s is left out and e is the geometric mean of executed FLOPs / (peak x
      (time - launch)) over the shapes;
    - backward: its efficiency, with the softmax's time in the forward's proportion to the
      products, the geometric mean over its shapes.

    An efficiency above 1 (a peak fitted on GEMMs that the kernel beats) is kept at 1, with a note:
    the measured tables then carry the difference."""
    from scipy.optimize import nnls

    from perfsim.cost.layer import CAUSAL_WORK, FLASH_BACKWARD, flash_curve_times
    from perfsim.cost.measured import FLASH_KERNELS
    from perfsim.predict import peak_flops

    values, quality, notes = {}, [], []
    flash = [r for r in records if r["suite"] == "attention" and r["op"] in FLASH_KERNELS and "error" not in r]
    primary = next((d for d in PRIMARY_DTYPE.get(kind, PRIMARY_DTYPE["cuda"]) if any(r["dtype"] == d for r in flash)), None)
    if primary is None:
        return values, quality, notes, system
    dev, peak = system.device, peak_flops(system, primary)
    where = f"shapes of ledger {ledger}, causal scaled_dot_product_attention, {primary}"
    # seconds of the products at 100% of peak and executed scores, per fitted point
    at_peak = lambda rows: 4 * CAUSAL_WORK * np.prod(_flash_shapes(rows), axis=0) / peak  # noqa: E731
    scores = lambda rows: CAUSAL_WORK * np.prod(_flash_shapes(rows)[:3], axis=0)  # noqa: E731
    # less one launch, but never below a tenth of the time: a launch overhead fitted above a tiny
    # kernel's time would otherwise make its efficiency negative or unbounded
    busy = lambda rows: np.maximum(measured_times(rows) - dev.kernel_overhead_s, 0.1 * measured_times(rows))  # noqa: E731
    fitted_points = {}
    for direction, op in enumerate(FLASH_KERNELS):
        fit, held = split_held_out([r for r in flash if r["dtype"] == primary], "attention", (op,))
        if not fit:
            continue
        fitted_points[op] = len(fit)
        if direction == 0:
            score_s = None
            if len(fit) >= 2 and len({r["shape"]["head_dim"] for r in fit}) >= 2:
                t = busy(fit)
                (inverse, score_s), _ = nnls(np.stack([at_peak(fit), scores(fit)], axis=1) / t[:, None], np.ones(len(fit)))
                eff = 1.0 / inverse if inverse > 0 else 1.0
                source = (f"with flash_score_s, non-negative least squares on the relative error over {len(fit)} {where}: "
                          f"time - kernel_overhead_s = executed FLOPs / (peak x efficiency) + scores x flash_score_s")
            else:
                eff = float(np.exp(np.mean(np.log(at_peak(fit) / busy(fit)))))
                source = f"geometric mean over {len(fit)} {where}: executed FLOPs / (peak x (time - kernel_overhead_s))"
            key = "flash_forward_efficiency"
        else:
            softmax = (dev.flash_score_s or 0.0) * system.device.flash_forward_efficiency * scores(fit)
            eff = float(np.exp(np.mean(np.log(FLASH_BACKWARD * (at_peak(fit) + softmax) / busy(fit)))))
            source = (f"geometric mean over {len(fit)} {where}: {FLASH_BACKWARD:g} x (executed FLOPs / peak + the "
                      f"forward's softmax share) / (time - kernel_overhead_s)")
            key = "flash_backward_efficiency"
        if eff > 1.0:
            notes.append(f"flash attention {op} {primary} ran at {eff:.2f} x the fitted peak_flops_{primary}: "
                         f"{key} kept at 1, its measured table carries the rest")
            eff = 1.0
        fields = {key: eff} | ({"flash_score_s": float(score_s)} if direction == 0 and score_s is not None else {})
        system = with_fields(system, device=fields)
        dev = system.device
        curve = lambda rows: flash_curve_times(system.device, peak, *_flash_shapes(rows))[direction]  # noqa: E731
        quality.append(Quality(f"flash attention {op} {primary}", mape(curve(fit), measured_times(fit)), len(fit),
                               mape(curve(held), measured_times(held)) if held else float("nan"), len(held)))
        values[f"device.{key}"] = Fitted(eff, source)
        if direction == 0 and score_s is not None:
            values["device.flash_score_s"] = Fitted(float(score_s), f"fitted with flash_forward_efficiency, {source}")
    return values, quality, notes, system


def check_attention(records, system):
    """Attention measured against perfsim's attention core (scores and context GEMMs, softmax);
    not fitted, a check of the calibrated profile."""
    from perfsim.cost.layer import Gemm, MemoryOp, gemm_time, memory_time
    from perfsim.predict import peak_flops

    quality = []
    for op in ("unfused", "sdpa"):
        rows = [r for r in records if r["suite"] == "attention" and r["op"] == op and "error" not in r]
        if not rows:
            continue
        predicted = []
        for r in rows:
            s = r["shape"]
            bh, seq, d = s["batch"] * s["heads"], s["seq"], s["head_dim"]
            try:
                peak = peak_flops(system, r["dtype"])
            except PerfsimError:
                continue
            e = {"fp32": 4, "bf16": 2, "fp16": 2}[r["dtype"]]
            t = (gemm_time(system.device, peak, Gemm("scores", bh, seq, seq, d))
                 + gemm_time(system.device, peak, Gemm("context", bh, seq, d, seq))
                 + memory_time(system.device, MemoryOp("softmax", 2 * e * bh * seq * seq, "softmax")))
            predicted.append(float(t))
        quality.append(Quality(f"attention {op} (check, not fitted)", mape(predicted, measured_times(rows)), len(rows),
                               float("nan"), 0))
    return quality
