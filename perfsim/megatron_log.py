"""Reading a Megatron-DeepSpeed training log: the per-iteration lines its `training_log` prints,

    iteration      20/     100 | consumed samples: ... | elapsed time per iteration (ms): 6312.4 |
    ... | samples per second: 47.526 | ... | TFLOPs: 131.27 |

`elapsed time per iteration (ms)` is the wall time of one step averaged over the logging interval;
`TFLOPs:` is Megatron-DeepSpeed's per-device rate (its count: perfsim.cost.counts.
megatron_ds_flops_per_sample). The first logged interval includes start-up and warm-up (kernel
selection, allocator growth, the first collectives), so the summary leaves it out when there are
later ones, and takes the median of the rest. Where the lines print `global batch size:`, only
the intervals at the last one count (a batch-size ramp-up's smaller batches are not the run's
steps), and perfsim validate refuses a plan whose global batch differs from it.

A time or rate that is not a finite positive number within bounds (a step of at most a day, at
most 100,000 TFLOP/s per device) is an error naming its line; so is a log that is not UTF-8 text.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from perfsim.errors import PerfsimError
from perfsim.files import MAX_LOG_BYTES, decode_text, open_input

_VALUE = r"([^\s|]*)"  # whatever stands there: checked to be a number in bounds
ITERATION = re.compile(r"\biteration\s+([0-9]+)\s*/\s*([0-9]+)")
ELAPSED_MS = re.compile(r"elapsed time per iteration \(ms\):\s*" + _VALUE)
TFLOPS = re.compile(r"\bTFLOPs:\s*" + _VALUE)
GLOBAL_BATCH = re.compile(r"\bglobal batch size:\s*" + _VALUE)
LONGEST_STEP_MS = 86_400e3  # a day
# a microsecond: Megatron prints the step in ms with one decimal, and a positive value far below
# this (5e-324) would underflow to a 0 s step once converted
SHORTEST_STEP_MS = 1e-3
HIGHEST_TFLOPS = 1e5  # per device
LARGEST_BATCH = 2**40


@dataclass(frozen=True)
class LogSummary:
    iterations: list  # the iteration number of each interval kept
    step_times_s: list  # per logged interval
    tflops: list  # per logged interval that printed TFLOPs (may be empty)
    skipped_first: bool
    global_batch_size: int | None = None  # of the intervals kept, where the log prints it
    skipped_ramp: int = 0  # intervals left out for a global batch other than the last one (a ramp-up)

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def tflops_per_device(self) -> float | None:
        return statistics.median(self.tflops) if self.tflops else None


def _number(match, line_no: int, where: str, what: str, high: float, zero_ok: bool = False, whole: bool = False,
            low: float = 0.0):
    """The number a pattern found on a line, checked to be above `low` (or zero) and at most `high`."""
    text = match.group(1)
    try:
        value = int(text) if whole else float(text)
    except ValueError:
        value = None
    if value is None or not (low < value or zero_ok and value == 0) or not value <= high:  # NaN and inf fail too
        kind = "whole number" if whole else "number"
        raise PerfsimError(f"{where} line {line_no}: {what} {text!r} is not a {kind} "
                           f"{'from 0' if zero_ok else f'above {low:g}'} to {high:,.0f}")
    return value


def parse_lines(lines, where: str = "log") -> LogSummary:
    rows = []  # (iteration, step seconds, TFLOPs or None, global batch or None)
    for line_no, line in enumerate(lines, 1):
        elapsed = ELAPSED_MS.search(line)
        if not elapsed:
            continue
        it = ITERATION.search(line)
        tflops, batch = TFLOPS.search(line), GLOBAL_BATCH.search(line)
        rows.append((int(it.group(1)) if it else len(rows) + 1,
                     _number(elapsed, line_no, where, "elapsed time per iteration (ms)", LONGEST_STEP_MS,
                             low=SHORTEST_STEP_MS) / 1e3,
                     _number(tflops, line_no, where, "TFLOPs", HIGHEST_TFLOPS, zero_ok=True) if tflops else None,
                     _number(batch, line_no, where, "global batch size", LARGEST_BATCH, whole=True) if batch else None))
    if not rows:
        raise PerfsimError(f"{where} has no 'elapsed time per iteration (ms):' line; give the stdout of a "
                           f"Megatron-DeepSpeed training run (log-interval lines)")
    skipped = len(rows) > 1
    kept = rows[1:] if skipped else rows
    batch = kept[-1][3]
    at_batch = [r for r in kept if batch is None or r[3] == batch]
    return LogSummary([r[0] for r in at_batch], [r[1] for r in at_batch],
                      [r[2] for r in at_batch if r[2] is not None], skipped, batch, len(kept) - len(at_batch))


def read_log(path: str) -> LogSummary:
    """The summary of a log file: a regular file of UTF-8 text (perfsim.files), read line by line."""
    where = f"Megatron-DeepSpeed log {path}"
    with open_input(path, "Megatron-DeepSpeed log", "log file", MAX_LOG_BYTES) as fh:
        lines = (decode_text(raw, where, number) for number, raw in enumerate(fh, 1))
        return parse_lines((line.rstrip("\r\n") for line in lines), where)
