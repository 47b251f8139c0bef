"""The measurement ledger: one JSON object per line, appended and flushed record by record.

A record holds the schema version, its point's key, what was measured (suite, op, shape, dtype,
group), the timing statistics, and where and how (device, host, software versions, the
environment variables that change results, world size, backend, time stamp). The format is
described in docs/calibration.md; perfsim.calibrate.read_ledger reads it (damaged lines are
reported and skipped, never fatal).

One writer at a time: whoever appends to a ledger holds its lock (LedgerLock: an exclusive flock
on LEDGER.lock beside it, which names the holder's pid), for as long as a campaign or validation
runs; a second one on the same ledger is refused at once, naming the holder. The kernel drops the
lock when its holder dies, however it dies, so a killed run never blocks the next one.

Resuming: a campaign opens its ledger, skips every point whose key is already recorded, and
appends the rest. A record is one `write` of a whole line followed by flush and fsync, so a run
killed at any moment loses at most the line being written; that damaged tail is reported on
the next open, a newline is added after it so that new records start on a line of their own,
and its point is measured again.
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import socket
import sys
import time

from perfsim.calibrate import LEDGER_SCHEMA, read_ledger
from perfsim.errors import PerfsimError

# Environment variables that change measurements (names or prefixes); nothing else is recorded.
ENV_PREFIXES = ("ZE_", "CCL_", "SYCL_", "UR_", "FI_", "I_MPI_", "NCCL_", "CUDA_VISIBLE_DEVICES", "OMP_",
                "MKL_", "KMP_", "TORCH_", "ENABLE_SDP_FUSION", "IPEX_", "PALS_", "PMI_RANK", "PMI_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_JOB_ID", "SLURM_NNODES",
                "SLURM_JOB_PARTITION", "SLURM_CPUS_PER_TASK", "MALLOC_")
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL")
LOCK_SUFFIX = ".lock"
# Set by validate.campaign.launch_local for its ranks: the real path of the ledger whose lock the
# launcher holds for them (rank 0 then writes without taking it).
LEDGER_HELD_ENV = "PERFSIM_LEDGER_HELD"


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


class LedgerLock:
    """The exclusive right to append to the ledger at `path`, as a context manager (or acquire()
    and release()): an flock on `path` + LOCK_SUFFIX, whose text names the holder (pid, host,
    command, since when) for the refusal another run gets. Released by release(), or by the
    kernel when the holder dies; release() also removes the file. On a file system without locks
    a warning is said and the run goes on unlocked."""

    def __init__(self, path: str, command: str | None = None, report=None):
        self.path, self.lock_path = path, path + LOCK_SUFFIX
        self.command = command or " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))
        self.report = report or (lambda message: print(f"perfsim: warning: {message}", file=sys.stderr, flush=True))
        self._fd = None

    def acquire(self) -> "LedgerLock":
        import fcntl

        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise PerfsimError(f"ledger {self.path}: its lock file {self.lock_path} cannot be created "
                                   f"({exc.strerror or exc}); check the folder's permissions") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _holder(fd)
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise PerfsimError(f"ledger {self.path} is in use by {holder}; wait for it to end, or stop it "
                                       "(its launcher's ranks end with it), or give another --ledger") from None
                self.report(f"ledger {self.path}: the file system does not lock files ({exc.strerror or exc}); "
                            "going on without a lock: run one campaign on this ledger at a time")
                return self
            # the previous holder may have removed the file between our open and our lock
            try:
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": self.command[:200],
                                  "since": timestamp()}) + "\n").encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.lock_path)  # while still holding it: a waiting opener sees a new file
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _holder(fd: int) -> str:
    """Who holds a lock file, in words, from the text it wrote (read again for a moment: the
    holder writes it just after taking the lock)."""
    for _ in range(20):
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode() or "null")
        except (OSError, ValueError):
            info = None
        if isinstance(info, dict) and "pid" in info:
            command = str(info.get("command", "another run"))
            command = command if len(command) <= 80 else command[:80] + "..."
            return (f"`{command}` (pid {info['pid']} on {info.get('host', '?')}, since {info.get('since', '?')})")
        time.sleep(0.01)
    return "another run (its pid is not recorded)"


def held_for_me(path: str, environ=None) -> bool:
    """Whether this process's launcher holds `path`'s lock for it (LEDGER_HELD_ENV)."""
    environ = os.environ if environ is None else environ
    return environ.get(LEDGER_HELD_ENV) == os.path.realpath(path)


def timestamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


class Ledger:
    """Append-only JSON Lines file. `context` (device, software, environment, ...) goes into every
    record; `report(message)` hears about damaged lines (default: standard error); `check` judges
    a record as perfsim.calibrate.read_ledger's `check` does. `records` holds the readable ones.
    The ledger's lock (LedgerLock) is held until close(), unless `lock` is False (the caller
    holds it)."""

    def __init__(self, path: str, context: dict | None = None, report=None, check=None, lock: bool = True):
        check_path(path)
        self.path, self.context = path, dict(context or {})
        self.report = report or (lambda message: print(f"perfsim: warning: {message}", file=sys.stderr, flush=True))
        self._lock = LedgerLock(path, report=self.report).acquire() if lock else None
        try:
            self._open(check)
        except BaseException:
            self.close()
            raise

    def _open(self, check) -> None:
        path = self.path
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
        if getattr(self, "_fh", None) is not None:
            self._fh.close()
        if self._lock is not None:
            self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
