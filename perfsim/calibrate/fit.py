"""The fit of a whole ledger: every part in order, and `fit_ledger`, which reads, fits, reports and writes."""

from __future__ import annotations

import dataclasses
import math
import os


from perfsim.errors import PerfsimError
from perfsim.files import check_output, write_output
from perfsim.ledger import read_ledger, skipped_lines, step_problem
from perfsim.calibrate.collectives import fit_collectives
from perfsim.calibrate.common import (COLLECTIVE_TIMINGS, Calibration, Fitted, GEMM_TIMINGS, STATISTICS,
                                      TRAINING_DTYPE, statistic_key, with_values)
from perfsim.calibrate.compute import check_attention, fit_flash, fit_gemms
from perfsim.calibrate.drift import steadied
from perfsim.calibrate.host_bound import ASYNCHRONOUS_KINDS, device_times
from perfsim.calibrate.memory import fit_memory
from perfsim.calibrate.overheads import fit_framework_overheads, fit_rank_jitter, fit_tp_overhead, overheads_ledger
from perfsim.calibrate.overlap import fit_overlap, is_concurrent
from perfsim.calibrate.profile import calibrated_profile
from perfsim.calibrate.report import format_report
from perfsim.calibrate.tables import measured_tables


def fit(records: list, base, ledger_name: str, device_kind: str | None = None, statistic: str = "expected",
        clock: str = "auto", step_records: list = (), steps_name: str = "") -> Calibration:
    """Fit `base` (a System) to ledger records; see the module docstring. `statistic` is the
    repetitions' statistic fitted: "expected" (default: what a step pays on average, see
    STATISTICS), "min" (the best of the repetitions, the machine without interference from other
    load), "median", "p25" or "mean". `clock` "auto" fits the CPU
    time of compute points where the ledger has it (one-thread CPU ranks: the time the rank really
    ran, immune to other processes on a shared machine), "wall" the wall clock everywhere.
    `step_records`: the overhead runs' training steps (ledger `steps_name`), which give the
    framework overheads once everything else is fitted."""
    if clock not in ("auto", "wall"):
        raise PerfsimError(f"clock must be auto or wall, got {clock!r}")
    if statistic not in STATISTICS:
        raise PerfsimError(f"statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")
    kinds = sorted({r.get("device", {}).get("kind", "") if isinstance(r.get("device"), dict) else "" for r in records})
    kind = device_kind or (kinds[0] if len(kinds) == 1 and kinds[0] else "cuda")
    # compute points at the machine's typical speed over the campaign (perfsim.calibrate.drift)
    records, drift_notes, references = steadied(records)
    usable = []
    for r in records:
        if "error" in r:
            continue
        stats = r["cpu_stats"] if clock == "auto" and isinstance(r.get("cpu_stats"), dict) else r["stats"]
        t = stats.get(statistic_key(statistic, r["suite"]), stats.get("median_s", r["stats"]["median_s"]))
        if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0:
            usable.append({**r, "_t": float(t)})
    if not usable:
        raise PerfsimError(f"ledger {ledger_name} has no usable measurements to fit")
    # collectives timed beside compute give the overlap efficiency alone (perfsim.calibrate.overlap)
    concurrent = [r for r in usable if is_concurrent(r)]
    usable = [r for r in usable if not is_concurrent(r)]
    base = dataclasses.replace(base, device=dataclasses.replace(base.device, measured=()),  # tables of another ledger
                               collectives=dataclasses.replace(base.collectives, measured=()))
    cpu_clocked = sum(1 for r in usable if clock == "auto" and isinstance(r.get("cpu_stats"), dict))
    what = ("the mean of each compute point's repetitions, the min of each collective's (plus the "
            "step overhead)" if statistic == "expected" else f"the {statistic} of each point's repetitions")
    values, quality, notes = {}, [], [f"times fitted: {what}"
                                      + (f"; CPU time of the rank for {cpu_clocked} compute points" if cpu_clocked else "")]
    notes.extend(drift_notes)
    usable, host_notes = device_times(usable, kind)  # a GPU's kernels apart from the host's time per call
    notes.extend(host_notes)
    if kind in ASYNCHRONOUS_KINDS:
        values["framework.host_overlap"] = Fitted(1.0, f"the ledger's {kind} device runs the kernels the host queues "
                                                       f"asynchronously: the host's own time shows only where it "
                                                       f"exceeds the kernels' (perfsim.cost.host)")
        base = with_values(base, {"framework.host_overlap": values["framework.host_overlap"]})
    for reference, key in (("gemm", "device.speed_reference_gemm_s"), ("memory", "device.speed_reference_norm_s")):
        if reference in references:
            values[key] = Fitted(references[reference], f"median over ledger {ledger_name} of the {reference} reference "
                                                        f"kernel timed before each compute point (validate.microbench.References)")
    if len(kinds) > 1:
        notes.append(f"ledger mixes device kinds {', '.join(k or '?' for k in kinds)}; fitting as {kind}")
    per_node = {r.get("ranks_per_node") for r in usable if r["suite"] == "collective"} - {None}
    if per_node and per_node != {base.node.devices_per_node}:
        notes.append(f"measurements ran {', '.join(map(str, sorted(per_node)))} ranks per node, the base profile has "
                     f"{base.node.devices_per_node}: link classes follow the profile")
    v, q, n = fit_memory(usable, base, ledger_name)
    values.update(v), quality.extend(q), notes.extend(n)
    system = with_values(base, v)
    # GEMMs timed as a step meets them, operands out of cache (validate.microbench.Point.timing)
    usable = _prefer_records(usable, "gemm", "timing", GEMM_TIMINGS, notes,
                             lambda t, rest: f"GEMMs fitted on their {t}-timed points (the ledger also has "
                             f"{', '.join(sorted(x or 'warm' for x in rest))}-timed ones)")
    v, q, n, system = fit_gemms(usable, system, kind, ledger_name)
    values.update(v), quality.extend(q), notes.extend(n)
    v, q, n, system = fit_flash(usable, system, kind, ledger_name)
    values.update(v), quality.extend(q), notes.extend(n)
    # fit the collectives measured most like a step issues them (validate.microbench.Point.timing),
    # in the dtype whose bytes perfsim prices a step's traffic in
    usable = _prefer_records(usable, "collective", "timing", COLLECTIVE_TIMINGS, notes,
                             lambda t, rest: f"collectives fitted on their {t or 'barrier'}-timed points (the ledger "
                             f"also has {', '.join(sorted(x or 'barrier' for x in rest))}-timed ones)")
    timed = usable  # every dtype's collectives, for the measured tables
    usable = _prefer_records(usable, "collective", "dtype", (TRAINING_DTYPE,), notes,
                             lambda t, rest: f"collectives fitted on their {t} measurements (the ledger also has "
                             f"{', '.join(sorted(rest))}; a training step sends {t})")
    v, q, n, system = fit_collectives(usable, system, ledger_name)
    values.update(v), quality.extend(q), notes.extend(n)
    v, n = fit_tp_overhead(usable, ledger_name)
    values.update(v), notes.extend(n)
    system = with_values(system, v)
    v, q, n = fit_overlap(concurrent, ledger_name)
    values.update(v), quality.extend(q), notes.extend(n)
    system = with_values(system, v)
    quality.extend(check_attention(usable, system))
    device_tables, collective_tables, q, n = measured_tables(timed, system, ledger_name, statistic == "expected")
    quality.extend(q), notes.extend(n)
    system = dataclasses.replace(system, device=dataclasses.replace(system.device, measured=device_tables),
                                 collectives=dataclasses.replace(system.collectives, measured=collective_tables))
    v, n = fit_rank_jitter(list(step_records), steps_name)  # before the overheads: their runs wait for it
    values.update(v), notes.extend(n)
    system = with_values(system, v)
    v, q, n = fit_framework_overheads(list(step_records), system, steps_name)
    values.update(v), quality.extend(q), notes.extend(n)
    system = with_values(system, v)
    return Calibration(values, quality, notes, system, device_tables + collective_tables)


def _prefer_records(usable: list, suite: str, field: str, order: tuple, notes: list, say) -> list:
    """Of the `suite` records, keep those whose `field` is the first of `order` the ledger has,
    when it has more than one value; `say(chosen, others)` is the note."""
    values = {r.get(field, "") for r in usable if r["suite"] == suite}
    chosen = next((v for v in order if v in values), None)
    if len(values) < 2 or chosen is None:
        return usable
    notes.append(say(chosen, values - {chosen}))
    return [r for r in usable if r["suite"] != suite or r.get(field, "") == chosen]




def fit_ledger(ledger: str, base_name: str, out: str | None, name: str | None = None, device_kind=None,
               report=print, warn=None, statistic: str = "expected", clock: str = "auto",
               description: str | None = None) -> Calibration:
    """Read a ledger, fit the base profile, print the report, write the calibrated profile to `out`
    (named `name`, described by `description`; both have defaults from the files and the ledger)."""
    from perfsim.spec.system import load_system

    if out:
        check_output(out, "--out", "calibrated.toml")  # before the fit
    base = load_system(base_name)
    duplicates: list = []
    records, problems = read_ledger(ledger, duplicates=duplicates)
    if not records:
        if read_ledger(ledger, step_problem)[0]:
            raise PerfsimError(f"ledger {ledger} holds training steps (perfsim validate), not calibration "
                               f"measurements; draw them with `perfsim chart validation --ledger {ledger} --out "
                               f"FILE.html`, or fit a ledger written by `perfsim calibrate --device ...`")
        raise PerfsimError(f"ledger {ledger} holds no measurements"
                           + (f" ({len(problems)} lines skipped: {problems[0]}, ...)" if problems else "")
                           + "; run `perfsim calibrate --device ...` first")
    for line in skipped_lines(ledger, problems, duplicates):
        (warn or report)(f"perfsim: warning: {line}")
    if duplicates:  # which copy, and why that one (docs/calibration.md, "One campaign per ledger")
        (warn or report)(f"perfsim: warning: ledger {ledger}: {len(duplicates)} point(s) measured more than once; "
                         "the fit uses the last copy of each (the latest measurement). Copies written by two "
                         "campaigns at once (possible before perfsim locked its ledgers) were measured on a machine "
                         "running both: measure those points again into a fresh --ledger")
    steps_path = overheads_ledger(ledger)
    steps = read_ledger(steps_path, step_problem)[0] if os.path.exists(steps_path) else []
    calibration = fit(records, base, os.path.basename(ledger), device_kind, statistic, clock, steps,
                      os.path.basename(steps_path))
    report(format_report(calibration, base))
    if out:
        name = name or os.path.splitext(os.path.basename(out))[0]
        hosts = sorted({r.get("host", "?") for r in records})
        devices = sorted({(r.get("device") or {}).get("name", "?") for r in records if isinstance(r.get("device"), dict)})
        description = description or (f"{base.name} calibrated by perfsim calibrate on {', '.join(hosts)[:80]} "
                       f"({', '.join(devices)[:80] or 'unknown device'}) from ledger {os.path.basename(ledger)}; "
                       f"machine-specific: measured numbers hold for that machine and software stack only")
        text = calibrated_profile(base.path, calibration, os.path.basename(ledger), name, description)
        write_output(out, "--out", text, example="calibrated.toml")
        report(f"wrote {out}")
    return calibration
