"""Reading a measurement ledger (JSON Lines written by validate/; docs/calibration.md: the format
in section 2, what a reader skips under "Resuming").

A ledger is read line by line and no line is ever fatal: a line that is not UTF-8, not JSON
(cut short, nested too deeply, a number that is not finite or an integer beyond 64 bits), not an
object, or not a record its reader can use (a field missing or of the wrong type) is skipped and
reported as "line N ...". The checks here are what the readers rely on: a record they accept has
every field they read, of the type they read it as, so neither the fit nor the charts can fail
on one. When a key is on more than one line the last copy is used (a point measured again
replaces the earlier one), and each repeated key is reported with the lines it is on.

Two kinds of record: calibration measurements (suites gemm, memory, attention, collective,
tp_overhead: perfsim calibrate) and training steps (suite step: perfsim validate --device).
"""

from __future__ import annotations

import json
import math

from perfsim.errors import one_line
from perfsim.files import MAX_LEDGER_BYTES, open_input

LEDGER_SCHEMA = 1
SUITES = ("gemm", "memory", "attention", "collective", "tp_overhead")
# Collectives a ledger holds beside the profile's operations: expert parallelism's all-to-all
# (validate.microbench.EXPERT_COLLECTIVES), priced by perfsim.cost.experts, checked by calibrate
EXPERT_OPERATIONS = ("all_to_all",)
STEP_SUITE = "step"
MAX_LINE_BYTES = 2**20  # a record is about a kilobyte
LARGEST_SIZE = 2**40  # a shape dimension or byte count above this is not a measurement
LARGEST_GROUP = 2**16  # ranks in a measured collective (the topology model builds the group)
LARGEST_INT = 2**63
WARNINGS_SHOWN = 10  # per ledger; the rest are counted
# What a record of each suite must hold in its shape (positive whole numbers), and the dtypes the
# readers price (an attention point is priced by its element size).
SHAPE_KEYS = {"gemm": ("m", "n", "k"), "memory": ("rows", "cols"), "collective": ("nbytes",),
              "attention": ("batch", "heads", "seq", "head_dim"), "tp_overhead": ("hidden", "seq", "mbs")}
ATTENTION_DTYPES = ("fp32", "bf16", "fp16")
# The measured quantities of a training step (validate.timing reads every one of them on resume).
STEP_MEASURED_KEYS = ("step_time_s", "step_times_s", "peak_memory_bytes", "flops", "comm_bytes",
                      "comm_bytes_by_kind", "activation_bytes")


class _Damaged(ValueError):
    """A line that is JSON only in form: a non-finite number or an integer too large to be one."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Damaged(f"a number out of range, {text[:20]}")
    return value


def _int(text: str) -> int:
    if len(text) > 19 or abs(int(text)) >= LARGEST_INT:
        raise _Damaged(f"an integer beyond 64 bits, {text[:20]}...")
    return int(text)


def _constant(name: str):
    raise _Damaged(f"a non-finite number, {name}")


def parse_line(raw: bytes):
    """(record, None) for one ledger line, or (None, why it is damaged)."""
    if len(raw) > MAX_LINE_BYTES:
        return None, f"longer than {MAX_LINE_BYTES >> 20} MiB"
    if b"\0" in raw:
        return None, "binary"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    try:
        return json.loads(text, parse_float=_finite, parse_int=_int, parse_constant=_constant), None
    except _Damaged as exc:
        return None, str(exc)
    except json.JSONDecodeError as exc:
        return None, exc.msg
    except RecursionError:
        return None, "nested too deeply"
    except ValueError as exc:  # anything else json refuses
        return None, (str(exc) or "not JSON").splitlines()[0][:80]


def read_ledger(path: str, check=None, duplicates: list | None = None) -> tuple[list, list]:
    """(records, problems): every usable record (the last copy of each key, in the order of the
    keys' last lines), and one line of text per damaged or unusable line ("line N is damaged
    (...)", "line N has no ..."). `check` (record -> reason or None) judges a record; default:
    calibration_problem. `duplicates`, when given, receives one line of text per key that is on
    more than one line, naming the lines and the copy used. A missing or unreadable file is a
    PerfsimError; nothing inside it is."""
    check = check or calibration_problem
    records, lines_of, problems = {}, {}, []
    with open_input(path, "ledger", ".jsonl file", MAX_LEDGER_BYTES) as fh:
        for number, raw in enumerate(fh, 1):
            raw = raw.strip()
            if not raw:
                continue
            record, damage = parse_line(raw)
            why = f"is damaged ({damage})" if damage else check(record)
            key = record.get("key") if isinstance(record, dict) else None
            if why or not isinstance(key, str):  # a caller's `check` may not ask for the key
                problems.append(f"line {number} {why or 'has no key'}")
                continue
            records.pop(key, None)  # the last copy counts, in its place
            records[key] = record
            lines_of.setdefault(key, []).append(number)
    if duplicates is not None:
        for key, lines in lines_of.items():
            if len(lines) > 1:
                shown = ", ".join(map(str, lines[:5])) + (f" and {len(lines) - 5} more" if len(lines) > 5 else "")
                duplicates.append(f"key {key!r} is on lines {shown}; the last copy (line {lines[-1]}) is used")
    return list(records.values()), problems


def skipped_lines(path: str, problems: list, duplicates: list = ()) -> list:
    """Warning lines (without the "perfsim: warning: " prefix) for what read_ledger reported: the
    first WARNINGS_SHOWN of each kind, then how many more there are."""
    out = []
    for items, after, rest in ((problems, "; skipped", "lines skipped"), (duplicates, "", "keys repeated")):
        out += [f"ledger {path}: {item}{after}" for item in items[:WARNINGS_SHOWN]]
        if len(items) > WARNINGS_SHOWN:
            out.append(f"ledger {path}: {len(items) - WARNINGS_SHOWN} more {rest}")
    return [one_line(line) for line in out]


# --- what a reader relies on ---

def _whole(value, low: int = 1, high: int = LARGEST_SIZE) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _number(value, low: float = 0.0) -> bool:
    """A finite number >= low (the parser already refused non-finite ones and huge integers)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low


def _seconds_table(stats) -> bool:
    """A table of timing statistics: every "*_s" entry a number >= 0."""
    return isinstance(stats, dict) and all(_number(v) for k, v in stats.items() if k.endswith("_s"))


def _header_problem(record, suites) -> str | None:
    """What every record needs: an object of this schema with a key, a known suite, op and dtype,
    and the optional context fields of the types readers group and sort them by."""
    if not isinstance(record, dict):
        return "is not a JSON object"
    schema = record.get("schema")
    if isinstance(schema, bool) or schema != LEDGER_SCHEMA:
        return f"has schema {schema!r}, this perfsim reads {LEDGER_SCHEMA}"
    for key in ("key", "suite", "op", "dtype"):
        if not isinstance(record.get(key), str) or not record[key]:
            return f"has no {key}"
    if record["suite"] not in suites:
        if record["suite"] == STEP_SUITE:
            return "is a training step (perfsim validate), not a calibration measurement"
        return f"has unknown suite {record['suite']!r}"
    device = record.get("device")
    if device is not None and not (isinstance(device, dict) and all(
            isinstance(device.get(k), str) for k in ("kind", "name") if k in device)):
        return "has a device that is not a table with a kind and name"
    for key in ("host", "timing"):
        if key in record and not isinstance(record[key], str):
            return f"has a {key} that is not a string"
    if "ranks_per_node" in record and not _whole(record["ranks_per_node"]):
        return "has a ranks_per_node that is not a positive whole number"
    return None


def _group_problem(record, low: int) -> str | None:
    group = record.get("group")
    if not (isinstance(group, list) and len(group) == 2 and _whole(group[0], low, LARGEST_GROUP)
            and _whole(group[1])):
        return f"has no group [size, stride] (size {low} to {LARGEST_GROUP}, stride a positive whole number)"
    return None


def calibration_problem(record) -> str | None:
    """Why a ledger line is not a usable calibration measurement (None if it is)."""
    why = _header_problem(record, SUITES)
    if why or "error" in record:  # a failed point: counted by the readers, never measured
        return why
    suite = record["suite"]
    stats = record.get("stats")
    if not _seconds_table(stats) or not _number(stats.get("median_s")) or stats["median_s"] <= 0:
        return "has no positive stats.median_s"
    if "cpu_stats" in record and not _seconds_table(record["cpu_stats"]):
        return "has a cpu_stats that is not a table of times"
    if "reference_s" in record and not (isinstance(record["reference_s"], dict)
                                        and all(_number(v) and v > 0 for v in record["reference_s"].values())):
        return "has a reference_s that is not a table of positive times"
    if "predicted_s" in record and not _number(record["predicted_s"]):
        return "has a predicted_s that is not a number"
    shape = record.get("shape")
    if not isinstance(shape, dict) or not all(_whole(v) for v in shape.values()) \
            or any(k not in shape for k in SHAPE_KEYS[suite]):
        return f"has no shape of positive whole numbers with {', '.join(SHAPE_KEYS[suite])}"
    if suite == "collective":
        from perfsim.spec.system import OPERATIONS

        if record["op"] not in OPERATIONS + EXPERT_OPERATIONS:
            return f"has unknown collective op {record['op']!r}"
        if not _whole(record.get("nbytes")):
            return "has no nbytes"
        if record.get("timing") == "concurrent" and not all(  # perfsim.calibrate.overlap reads both sides
                _seconds_table(record.get(k)) and _number(record[k].get("median_s")) and record[k]["median_s"] > 0
                for k in ("alone_stats", "burst_stats")):
            return "is timed concurrent without alone_stats and burst_stats holding a positive median_s"
        return _group_problem(record, 2)
    if suite == "memory" and not (_number(record.get("nbytes")) and 0 < record["nbytes"] <= LARGEST_SIZE):
        return "has no nbytes"
    if suite == "attention" and record["dtype"] not in ATTENTION_DTYPES:
        return f"has dtype {record['dtype']!r}, an attention point is one of {', '.join(ATTENTION_DTYPES)}"
    if suite == "tp_overhead":
        diffs = record.get("overhead_s")
        if not (isinstance(diffs, list) and diffs and all(_number(v, -math.inf) for v in diffs)):
            return "has no overhead_s list"
        if "reference_stats" in record and not (_seconds_table(record["reference_stats"])
                                                and _number(record["reference_stats"].get("median_s"))):
            return "has a reference_stats without median_s"
        return _group_problem(record, 1)
    return None


def step_problem(record) -> str | None:
    """Why a ledger line is not a usable training-step record (None if it is)."""
    if isinstance(record, dict) and record.get("suite") in SUITES:
        return "is a calibration measurement (perfsim calibrate), not a training step"
    why = _header_problem(record, (STEP_SUITE,))
    if why:
        return why
    measured = record.get("measured")
    if not isinstance(measured, dict) or any(k not in measured for k in STEP_MEASURED_KEYS):
        return f"has no measured {', '.join(STEP_MEASURED_KEYS)}"
    if not (_number(measured["step_time_s"]) and measured["step_time_s"] > 0):
        return "has no positive measured step_time_s"
    times = measured["step_times_s"]
    if not (isinstance(times, list) and times and all(_number(t) for t in times)):
        return "has no measured step_times_s list"
    if not all(_number(measured[k]) for k in ("peak_memory_bytes", "flops", "comm_bytes", "activation_bytes")):
        return "has a measured byte or FLOP count that is not a number"
    if not (isinstance(measured["comm_bytes_by_kind"], dict)
            and all(_number(v) for v in measured["comm_bytes_by_kind"].values())):
        return "has no measured comm_bytes_by_kind table"
    for key in ("at_speed", "probe_s", "norm_probe_s"):  # per timed step, where recorded
        value = measured.get(key)
        if value is not None and not (isinstance(value, list) and len(value) == len(times)):
            return f"has a measured {key} that is not one entry per timed step"
    for key in ("probe_s", "norm_probe_s"):
        if not all(v is None or _number(v) for v in measured.get(key) or []):
            return f"has a measured {key} that is not a list of times"
    for key in ("probe_expected_s", "norm_probe_expected_s"):
        if measured.get(key) is not None and not _number(measured[key]):
            return f"has a measured {key} that is not a number"
    ranks = measured.get("rank_step_times_s")  # every rank's time per timed step, where recorded
    if ranks is not None and not (isinstance(ranks, list) and len(ranks) == len(times) and all(
            isinstance(r, list) and r and all(_number(t) and t > 0 for t in r) for r in ranks)):
        return "has a measured rank_step_times_s that is not every rank's time per timed step"
    if not isinstance(record.get("plan"), dict):
        return "has no plan"
    predicted = record.get("predicted")
    if predicted is not None and not (isinstance(predicted, dict) and _number(predicted.get("step_time_s"))):
        return "has a predicted that is not a table with step_time_s"
    return None


def any_problem(record) -> str | None:
    """Why a ledger line is neither a usable calibration measurement nor a training step."""
    if isinstance(record, dict) and record.get("suite") == STEP_SUITE:
        return step_problem(record)
    return calibration_problem(record)
