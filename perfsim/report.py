"""Human-readable text for a prediction and for the profile listing."""

from __future__ import annotations

from perfsim.predict import Prediction
from perfsim.spec.plan import plan_summary


def _bytes(n: float) -> str:
    return f"{n / 2**30:8.1f} GiB"


def _time(s: float) -> str:
    return f"{s * 1e3:10.1f} ms" if s < 1 else f"{s:10.2f} s "


def format_prediction(p: Prediction) -> str:
    lines = [
        f"{p.model.name} on {p.devices} x {p.system.device.name} ({p.system.name}), {p.dtype}",
        f"plan: {plan_summary(p.plan, long=True)}",
        "",
        f"step time          {_time(p.step_time_s)}",
        f"throughput         {p.tokens_per_s:12,.0f} tokens/s   {p.samples_per_s:.3f} samples/s",
        f"per device         {p.model_tflops_per_device:8.1f} TFLOP/s model (MFU {p.mfu:6.1%})",
        f"                   {p.hardware_tflops_per_device:8.1f} TFLOP/s hardware, with recompute (HFU {p.hfu:6.1%})",
        f"                   {p.megatron_ds_tflops_per_device:8.1f} TFLOP/s as Megatron-DeepSpeed logs it "
        f"(peak {p.peak_tflops_per_device:.1f})",
        "",
        "where the step goes (exposed time)",
    ]
    for key, seconds in p.time_breakdown_s.items():
        share = seconds / p.step_time_s if p.step_time_s else 0.0
        lines.append(f"  {key:<12} {_time(seconds)}  {share:6.1%}")
    if p.system.device.measured:  # a calibrated profile: how much of the compute its measurements cover
        lines.append(f"  compute from measured kernels: {1 - p.compute_extrapolated_share:.0%}, from the fitted curves "
                     f"far from any: {p.compute_extrapolated_share:.0%}")
    lines += _stage_lines(p.pipeline_stages)
    where = f"pipeline {p.memory_peak_stage}" if p.memory_peak_stage.startswith("stage") else \
        f"{p.memory_peak_stage} pipeline stage"
    lines += ["", f"peak memory per device ({where})"]
    for key, n in p.memory_bytes.items():
        lines.append(f"  {key:<12} {_bytes(n)}")
    verdict = "fits" if p.fits else "DOES NOT FIT"
    lines.append(f"  {'capacity':<12} {_bytes(p.device_memory_bytes)}  -> {verdict}")
    return "\n".join(lines)


def _stage_lines(stages) -> list:
    """The pipeline's stages (an uneven split or a layout), alike neighbours on one line: their
    chunks in Megatron-Core's letters, decoder layers, parameters, the micro-batches each chunk keeps
    in flight at the stage's peak (first stage .. last stage of the line) and the time per micro-batch."""
    if not stages:
        return []
    lines = ["", "pipeline stages (chunks: E embedding, t layer, m MTP layer, L loss; in flight per chunk at the peak)"]
    groups: list = []
    for s in stages:
        if groups and groups[-1][-1]["chunks"] == s["chunks"] and groups[-1][-1]["params"] == s["params"] \
                and groups[-1][-1]["time_per_microbatch_s"] == s["time_per_microbatch_s"]:
            groups[-1].append(s)
        else:
            groups.append([s])
    for group in groups:
        a, b = group[0], group[-1]
        name = f"stage {a['stage']}" if a is b else f"stages {a['stage']}-{b['stage']}"
        flight = "|".join(map(str, a["in_flight"])) + ("" if a is b else " .. " + "|".join(map(str, b["in_flight"])))
        lines.append(f"  {name:<14} {'|'.join(c or '-' for c in a['chunks']):<24} {a['layers']:>4} layers "
                     f"{a['params'] / 1e9:8.2f} B params  in flight {flight:<18} {_time(a['time_per_microbatch_s'])}"
                     f" per micro-batch")
    return lines
