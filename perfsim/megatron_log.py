"""Reading a Megatron-DeepSpeed training log: the per-iteration lines its `training_log` prints,

    iteration      20/     100 | consumed samples: ... | elapsed time per iteration (ms): 6312.4 |
    ... | samples per second: 47.526 | ... | TFLOPs: 131.27 |

`elapsed time per iteration (ms)` is the wall time of one step averaged over the logging interval;
`TFLOPs:` is Megatron-DeepSpeed's per-device rate (its count: perfsim.cost.counts.
megatron_ds_flops_per_sample). The first logged interval includes start-up and warm-up (kernel
selection, allocator growth, the first collectives), so the summary leaves it out when there are
later ones, and takes the median of the rest.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from perfsim.errors import PerfsimError
from perfsim.files import MAX_LOG_BYTES, open_input

_NUMBER = r"([0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?)"
ITERATION = re.compile(r"\biteration\s+([0-9]+)\s*/\s*([0-9]+)")
ELAPSED_MS = re.compile(r"elapsed time per iteration \(ms\):\s*" + _NUMBER)
TFLOPS = re.compile(r"\bTFLOPs:\s*" + _NUMBER)


@dataclass(frozen=True)
class LogSummary:
    iterations: list  # the iteration number of each interval kept
    step_times_s: list  # per logged interval
    tflops: list  # per logged interval that printed TFLOPs (may be empty)
    skipped_first: bool

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def tflops_per_device(self) -> float | None:
        return statistics.median(self.tflops) if self.tflops else None


def parse_lines(lines, where: str = "log") -> LogSummary:
    rows = []
    for line in lines:
        elapsed = ELAPSED_MS.search(line)
        if not elapsed:
            continue
        it = ITERATION.search(line)
        tflops = TFLOPS.search(line)
        rows.append((int(it.group(1)) if it else len(rows) + 1, float(elapsed.group(1)) / 1e3,
                     float(tflops.group(1)) if tflops else None))
    if not rows:
        raise PerfsimError(f"{where} has no 'elapsed time per iteration (ms):' line; give the stdout of a "
                           f"Megatron-DeepSpeed training run (log-interval lines)")
    skipped = len(rows) > 1
    kept = rows[1:] if skipped else rows
    if any(t <= 0 for _, t, _ in kept):
        raise PerfsimError(f"{where}: an elapsed time per iteration is not positive")
    return LogSummary([i for i, _, _ in kept], [t for _, t, _ in kept],
                      [f for _, _, f in kept if f is not None], skipped)


def read_log(path: str) -> LogSummary:
    with open_input(path, "Megatron-DeepSpeed log", "log file", MAX_LOG_BYTES) as fh:
        text = fh.read().decode("utf-8", errors="replace")
    return parse_lines(text.splitlines(), f"Megatron-DeepSpeed log {path}")
