"""The measurement ledger: one JSON object per line, appended and flushed record by record.

A record holds the schema version, its point's key, what was measured (suite, op, shape, dtype,
group), the timing statistics, and where and how (device, host, software versions, the
environment variables that change results, world size, backend, time stamp). The format is
described in docs/calibration.md; perfsim.calibrate.read_ledger reads it (damaged lines are
reported and skipped, never fatal).

Resuming: a campaign opens its ledger, skips every point whose key is already recorded, and
appends the rest. A record is one `write` of a whole line followed by flush and fsync, so a run
killed at any moment loses at most the line being written; that damaged tail is reported on
the next open, a newline is added after it so that new records start on a line of their own,
and its point is measured again.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import sys

from perfsim.calibrate import LEDGER_SCHEMA, read_ledger
from perfsim.errors import PerfsimError

# Environment variables that change measurements (names or prefixes); nothing else is recorded.
ENV_PREFIXES = ("ZE_", "CCL_", "SYCL_", "UR_", "FI_", "I_MPI_", "NCCL_", "CUDA_VISIBLE_DEVICES", "OMP_",
                "MKL_", "KMP_", "TORCH_", "ENABLE_SDP_FUSION", "IPEX_", "PALS_", "PMI_RANK", "PMI_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_JOB_ID", "SLURM_NNODES",
                "SLURM_JOB_PARTITION", "SLURM_CPUS_PER_TASK", "MALLOC_")
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL")


def relevant_env(environ=None) -> dict:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items())
            if k.startswith(ENV_PREFIXES) and not any(w in k.upper() for w in SECRET_WORDS)}


def check_path(path: str) -> None:
    """Raise a PerfsimError when `path` cannot hold a ledger."""
    if os.path.isdir(path):
        raise PerfsimError(f"ledger {path} is a directory; give a file name such as {os.path.join(path, 'ledger.jsonl')}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise PerfsimError(f"ledger {path}: folder {folder} does not exist; create it or choose another --ledger")
    if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
        raise PerfsimError(f"ledger {path} cannot be read and written; check its permissions")
    if not os.path.exists(path) and not os.access(folder, os.W_OK):
        raise PerfsimError(f"ledger {path}: folder {folder} is not writable")


def timestamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


class Ledger:
    """Append-only JSON Lines file. `context` (device, software, environment, ...) goes into every
    record; `report(message)` hears about damaged lines (default: standard error); `check` judges
    a record as perfsim.calibrate.read_ledger's `check` does. `records` holds the readable ones."""

    def __init__(self, path: str, context: dict | None = None, report=None, check=None):
        check_path(path)
        self.path, self.context = path, dict(context or {})
        self.report = report or (lambda message: print(f"perfsim: warning: {message}", file=sys.stderr, flush=True))
        self.keys: set = set()
        self.records: dict = {}
        if os.path.exists(path):
            records, problems = read_ledger(path, check)
            for problem in problems:
                self.report(f"ledger {path}: {problem}; skipped (its point will be measured again)")
            self.keys = {r["key"] for r in records}
            self.records = {r["key"]: r for r in records}
        self._fh = open(path, "ab")
        self._end_line()

    def _end_line(self) -> None:
        """Make sure the next record starts a line (after a tail cut short by a kill)."""
        size = os.path.getsize(self.path)
        if size:
            with open(self.path, "rb") as fh:
                fh.seek(size - 1)
                last = fh.read(1)
            if last != b"\n":
                self._fh.write(b"\n")
                self._fh.flush()

    def done(self, key: str) -> bool:
        return key in self.keys

    def append(self, record: dict) -> dict:
        if "key" not in record:
            raise ValueError("a ledger record needs its point's key")
        full = {"schema": LEDGER_SCHEMA, **record, **self.context, "host": self.context.get("host") or socket.gethostname(),
                "timestamp": timestamp()}
        line = json.dumps(full, sort_keys=False, separators=(",", ":"), allow_nan=False) + "\n"
        self._fh.write(line.encode())
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.keys.add(record["key"])
        return full

    def close(self) -> None:
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
