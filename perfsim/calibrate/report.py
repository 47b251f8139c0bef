"""The calibration report: fitted values against the base profile, and the quality rows."""

from __future__ import annotations

import math


from perfsim.calibrate.common import Calibration, Quality, profile_value


def format_quality_row(q: Quality) -> str:
    def pct(x):
        return "   -  " if not math.isfinite(x) else f"{100 * x:5.1f}%"
    verdict = "" if q.passed is None else (f"  target {100 * q.target:.0f}%: " + ("met" if q.passed else "NOT met"))
    note = f"  ({q.note})" if q.note else ""
    return f"{q.name:<66} fit {pct(q.fit_mape)} ({q.fit_points:4d})  held-out {pct(q.held_mape)} ({q.held_points:4d}){verdict}{note}"


def format_report(calibration: Calibration, base) -> str:
    lines = ["fitted values (calibrated):"]
    for key, fitted in calibration.values.items():
        old = profile_value(base, key)
        if isinstance(fitted.value, str):
            lines.append(f"  {key:<48} {fitted.value:<12} (base {old})")
        else:  # an optional number the base profile does not state reads None
            lines.append(f"  {key:<48} {fitted.value:<12.4g} (base {'not stated' if old is None else f'{old:.4g}'})")
    lines.append("fit quality, mean absolute percentage error:")
    lines += [f"  {format_quality_row(q)}" for q in calibration.quality]
    if calibration.notes:
        lines.append("notes:")
        lines += [f"  {n}" for n in calibration.notes]
    return "\n".join(lines)
