"""The local launcher: the ranks of one job as child processes of this one (like torchrun
--standalone), tied to it, their output filtered, and a failure blamed on the rank that caused it.

- Tied: every rank learns the launcher's pid (LAUNCHER_ENV) and calls `die_with_launcher()`
  first thing, which asks the kernel to kill it when the launcher dies (Linux:
  prctl(PR_SET_PDEATHSIG, SIGKILL); elsewhere a thread that watches the parent pid). A launcher
  killed with `kill -9` therefore leaves no rank measuring on into a ledger that a rerun appends
  to. Each rank runs in a process group of its own, out of the terminal's: Ctrl-C reaches the
  launcher alone, which stops the ranks and says how to resume.
- Filtered: the ranks' standard error passes through the launcher. Lines that are torch's
  profiler chatter (kineto's `USDT: ... profiler_start` / `STAGE: ... Completed Stage` lines,
  printed whenever validate/ reads CPU memory through the profiler) are dropped; rank 0's other
  lines are shown as they come; every rank's last lines are kept for an error message.
- Blamed: when a rank fails, the rank that caused it is named with its own last meaningful
  line: a rank killed by a signal ("rank 1 was killed (SIGKILL)"), else a rank that failed of
  its own accord, else, when the failing ranks only gave up waiting for a peer in a collective,
  the rank still running that they waited for ("rank 1 stopped responding").
"""

from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from perfsim.errors import PerfsimError

LAUNCHER_ENV = "PERFSIM_LAUNCHER_PID"  # set for each rank: the pid it dies with
# kineto's log lines: "USDT:2026-01-02 10:11:12 123:123 SyncActivityProfilerHandler.cpp:52] profiler_start"
PROFILER_NOISE = re.compile(r"^(?:USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] ")
# What a rank says when it failed only because a peer did not answer or went away (gloo, NCCL).
PEER_TROUBLE = re.compile(r"timed out|timeout|connection (?:closed|reset|refused)|closed by peer|broken pipe|"
                          r"socket closed|remote process", re.IGNORECASE)
# glibc serves allocations above 32 MiB with fresh mmap pages, so every large CPU tensor pays
# page faults (2-3 GB/s on the project's VM, against 10-30 GB/s for the kernel itself). Keeping
# freed memory in the heap makes the CPU behave like a GPU's caching allocator; calibration and
# validation ranks both get it (docs/calibration.md). A value already in the environment wins.
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")  # torch's prefix on a failed rank's traceback lines
SOURCE_POSITION = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\] ")  # "[/__w/.../unbound_buffer.cc:78] "
POLL_S = 0.05
PEER_GRACE_S = 2.0  # after a rank failed for a peer, how long the others have to fail in their own words
STOP_S = 10.0  # how long a stopped rank has to exit after SIGTERM before it gets SIGKILL
TAIL_LINES = 20
QUOTE_CHARS = 300


def die_with_launcher(environ=None) -> None:
    """In a rank started by `launch_ranks`: make this process die when the launcher does (nothing
    for a process started otherwise, e.g. by mpiexec). The launcher may already have died while
    this rank started up; then it exits at once."""
    environ = os.environ if environ is None else environ
    text = environ.get(LAUNCHER_ENV, "")
    if not text.isdigit():
        return
    launcher = int(text)
    if not _parent_death_signal(signal.SIGKILL):
        threading.Thread(target=_watch_parent, args=(launcher,), name="perfsim-launcher-watch", daemon=True).start()
    if os.getppid() != launcher:
        os._exit(1)


def _parent_death_signal(sig) -> bool:
    """Linux: have the kernel send `sig` to this process when its parent exits; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    PR_SET_PDEATHSIG = 1  # <sys/prctl.h>
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(0.5)
    os._exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_noise(line: str) -> bool:
    """Whether a line of a rank's output is chatter the user never needs (torch's profiler)."""
    return bool(PROFILER_NOISE.match(line))


class _Output:
    """A reader of one rank's standard error: drops the noise, shows the rest when `show`, keeps
    the last TAIL_LINES meaningful lines."""

    def __init__(self, pipe, show):
        self.tail = collections.deque(maxlen=TAIL_LINES)
        self._show = show
        self._thread = threading.Thread(target=self._pump, args=(pipe,), daemon=True)
        self._thread.start()

    def _pump(self, pipe) -> None:
        with pipe:
            for raw in pipe:
                line = raw.decode(errors="replace").rstrip("\r\n")
                if is_noise(line):
                    continue
                if line.strip():
                    self.tail.append(line.strip())
                if self._show is not None:
                    try:
                        self._show.write(line + "\n")
                        self._show.flush()
                    except (OSError, ValueError):  # our own stderr went away: keep reading
                        self._show = None

    def finish(self, timeout_s: float = 2.0) -> list:
        self._thread.join(timeout_s)
        return list(self.tail)


@dataclass(frozen=True)
class Blame:
    """Which rank ended a job, and how, in words."""
    rank: int
    what: str  # "was killed (SIGKILL)", "exited with status 3", "stopped responding"
    said: str  # its last meaningful line, or ""

    def message(self) -> str:
        quote = f"; its last output: {_short(self.said)}" if self.said else "; it printed nothing"
        return f"rank {self.rank} {self.what}{quote}"


def _short(line: str) -> str:
    """A rank's line as an error message quotes it: without torch's "[rank0]: " prefix and the
    C++ source position gloo puts first, at most QUOTE_CHARS long."""
    line = SOURCE_POSITION.sub("", RANK_PREFIX.sub("", line))
    return line if len(line) <= QUOTE_CHARS else line[:QUOTE_CHARS] + "..."


def _ended(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " by another process or the system's out-of-memory killer" if -code == signal.SIGKILL else ""
        return f"was killed ({name}){why}"
    return f"exited with status {code}"


def blame(failed: dict, running: list, tails: dict) -> Blame:
    """The rank that ended a job. `failed`: rank -> exit status (negative: killed by that signal)
    of the ranks that failed, in the order they were seen to; `running`: ranks still running
    then; `tails`: rank -> its last meaningful lines. A rank killed by a signal comes first;
    then one that failed for a reason of its own; if every failed rank only gave up on a peer,
    the first rank still running is the one they waited for (it hangs, or is too slow)."""
    def last(rank):
        lines = tails.get(rank) or []
        return lines[-1] if lines else ""

    killed = [r for r, code in failed.items() if code < 0]
    if killed:
        return Blame(killed[0], _ended(failed[killed[0]]), last(killed[0]))
    own = [r for r in failed if not _peer_trouble(tails.get(r))]
    if own:
        return Blame(own[0], _ended(failed[own[0]]), last(own[0]))
    if failed and running:
        waiter = next(iter(failed))
        what = (f"stopped responding (rank {waiter} gave up waiting for it: {_short(last(waiter))})"
                if last(waiter) else f"stopped responding (rank {waiter} gave up waiting for it)")
        return Blame(running[0], what, last(running[0]))
    first = next(iter(failed))
    return Blame(first, _ended(failed[first]), last(first))


def launch_ranks(python_argv: list, nproc: int, device: str = "cpu", threads: int | None = None,
                 what: str = "calibration",
                 resume: str = "the ledger keeps what was measured, run the same command again to resume",
                 env: dict | None = None, on_poll=None) -> None:
    """Run `python python_argv...` as `nproc` ranks on this machine and wait for them; if one
    fails, stop the others and raise a PerfsimError that blames the rank that caused it (`what`,
    or what the callable `what` returns then, starts the message, `resume` ends it). `env`: more
    environment variables for the ranks; `on_poll`: called while they run, every POLL_S (to take
    their results as they come)."""
    base = dict(os.environ, **(env or {}))
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), **{LAUNCHER_ENV: str(os.getpid())})
    if device == "cpu":
        base.setdefault("OMP_NUM_THREADS", str(threads or max(1, (os.cpu_count() or 1) // nproc)))
        base.update({k: base.get(k, v) for k, v in CPU_ALLOCATOR_ENV.items()})
    procs, outputs = [], []
    try:
        for rank in range(nproc):
            procs.append(subprocess.Popen([sys.executable] + list(python_argv),
                                          env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank)),
                                          stdout=None if rank == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          start_new_session=True))
            outputs.append(_Output(procs[-1].stderr, sys.stderr if rank == 0 else None))
        failed = _wait(procs, outputs, on_poll)
    except KeyboardInterrupt:
        _stop(procs)
        raise PerfsimError(f"interrupted; {resume}") from None
    except BaseException:
        _stop(procs)
        raise
    running = [r for r, p in enumerate(procs) if p.poll() is None]
    _stop(procs)
    if failed:
        tails = {r: out.finish() for r, out in enumerate(outputs)}
        raise PerfsimError(f"{what() if callable(what) else what} {blame(failed, running, tails).message()}; {resume}")
    for out in outputs:
        out.finish()


def _wait(procs: list, outputs: list, on_poll=None) -> dict:
    """Wait until every rank exited or one failed; rank -> status of the failed ones, in the
    order seen. While every failed rank only gave up on a peer, the others get PEER_GRACE_S to
    fail in their own words or be seen killed, so that the blame falls on the cause."""
    failed, grace_ends = {}, None
    while True:
        for rank, p in enumerate(procs):
            if rank not in failed and p.poll() not in (None, 0):
                failed[rank] = p.returncode
        if all(p.poll() is not None for p in procs):
            return failed
        if failed:
            if any(code < 0 or not _peer_trouble(outputs[r].finish(0.5)) for r, code in failed.items()):
                return failed
            grace_ends = grace_ends or time.monotonic() + PEER_GRACE_S
            if time.monotonic() > grace_ends:
                return failed
        if on_poll is not None:
            on_poll()
        time.sleep(POLL_S)


def _peer_trouble(tail: list) -> bool:
    """Whether a rank's last words say it failed because a peer did not answer or went away."""
    return bool(tail) and bool(PEER_TROUBLE.search(tail[-1]))


def _stop(procs: list) -> None:
    """Stop every rank still running (its process group: SIGTERM, then SIGKILL) and reap them."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + STOP_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p, sig) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass
