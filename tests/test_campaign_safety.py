"""A campaign's safety (validate.launcher, validate.ledger.LedgerLock): ranks die with their
launcher, one writer per ledger, failures blamed on the rank that caused them with its own last
meaningful line (torch's profiler chatter filtered out), and a `perfsim calibrate` killed with
`kill -9` and rerun at once leaves every point in the ledger exactly once.

The launcher tests run plain Python scripts as ranks (no torch); the last test runs the real
command on two CPU ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from perfsim.errors import PerfsimError
from validate.launcher import LAUNCHER_ENV, Blame, blame, is_noise, launch_ranks
from validate.ledger import Ledger, LedgerLock

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
NOISE = "USDT:2026-11-24 22:58:12 10386:10386 SyncActivityProfilerHandler.cpp:52] profiler_start"
STAGE = "STAGE:2026-11-24 23:09:32 25707:25707 SyncActivityProfilerHandler.cpp:60] Completed Stage: Collection"


def ranks_script(body: str) -> list:
    """python argv of a rank running `body` (RANK is its rank), tied to its launcher."""
    return ["-c", "import os, sys, time\nfrom validate.launcher import die_with_launcher\ndie_with_launcher()\n"
            "rank = int(os.environ['RANK'])\n" + textwrap.dedent(body)]


def test_profiler_lines_are_noise_and_nothing_else_is():
    assert is_noise(NOISE) and is_noise(STAGE)
    for line in ("RuntimeError: Timed out waiting 8000ms", "[1/42, 0 s] gemm matmul fp32 64x384x128: 0.19 ms",
                 "USDT is a tracing facility", "  warnings.warn("):
        assert not is_noise(line)


@pytest.mark.parametrize("failed, running, tails, expected", [
    # killed by a signal: that rank, however the others ended
    ({0: 1, 1: -9}, [], {0: ["RuntimeError: Connection closed by peer [127.0.0.1]:5"], 1: ["[3/9] gemm"]},
     Blame(1, "was killed (SIGKILL) by another process or the system's out-of-memory killer", "[3/9] gemm")),
    # a rank failed of its own accord; another only lost it as a peer
    ({0: 1, 1: 1}, [], {0: ["RuntimeError: Connection reset by peer"], 1: ["ValueError: bad shape"]},
     Blame(1, "exited with status 1", "ValueError: bad shape")),
    # the failed rank only timed out waiting: the rank still running stopped responding
    ({0: 1}, [1], {0: ["[rank0]: RuntimeError: Timed out waiting 8000ms for recv"], 1: []},
     Blame(1, "stopped responding (rank 0 gave up waiting for it: RuntimeError: Timed out waiting 8000ms for recv)",
           "")),
    # a rank that died without a word
    ({1: 3}, [0], {0: ["[2/9] step"]}, Blame(1, "exited with status 3", "")),
])
def test_blame_falls_on_the_cause(failed, running, tails, expected):
    assert blame(failed, running, tails) == expected


def test_a_killed_rank_is_named_with_its_last_meaningful_line(capsys):
    script = ranks_script(f"""
        if rank == 1:
            print("[3/9] measuring gemm", file=sys.stderr, flush=True)
            print({NOISE!r}, file=sys.stderr, flush=True)
            time.sleep(0.3)
            os.kill(os.getpid(), 9)
        print({NOISE!r}, file=sys.stderr, flush=True)
        print("rank 0 says hello", file=sys.stderr, flush=True)
        time.sleep(60)
    """)
    start = time.monotonic()
    with pytest.raises(PerfsimError) as err:
        launch_ranks(script, 2, what="test:", resume="rerun")
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert message.startswith("test: rank 1 was killed (SIGKILL)") and message.endswith("; rerun")
    assert "its last output: [3/9] measuring gemm" in message and "USDT" not in message
    shown = capsys.readouterr().err  # rank 0's output, shown live without the profiler's lines
    assert "rank 0 says hello" in shown and "USDT" not in shown


def test_a_hung_rank_is_blamed_not_the_one_that_timed_out():
    script = ranks_script("""
        if rank == 0:
            print("waiting in all_reduce", file=sys.stderr, flush=True)
            time.sleep(0.5)
            sys.exit("RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 500ms for recv")
        print("step 2 of 9", file=sys.stderr, flush=True)
        time.sleep(60)
    """)
    with pytest.raises(PerfsimError, match=r"^validation: rank 1 stopped responding \(rank 0 gave up waiting for it: "
                                           r"RuntimeError: Timed out waiting 500ms for recv\); its last output: "
                                           r"step 2 of 9; resume"):
        launch_ranks(script, 2, what="validation:", resume="resume")


def test_a_rank_that_fails_after_its_peer_noticed_is_blamed():
    """Rank 0 sees the connection drop first; rank 1's own error comes half a second later, within
    the grace the launcher gives it."""
    script = ranks_script("""
        if rank == 0:
            time.sleep(0.2)
            sys.exit("RuntimeError: Connection closed by peer [127.0.0.1]:29500")
        time.sleep(0.7)
        sys.exit("ValueError: the plan uses 4 devices but 2 ranks were started")
    """)
    with pytest.raises(PerfsimError, match="rank 1 exited with status 1; its last output: ValueError: the plan uses"):
        launch_ranks(script, 2, what="x")


@linux
def test_ranks_die_with_a_killed_launcher(tmp_path):
    pids = tmp_path / "pids"
    launcher = textwrap.dedent(f"""
        from validate.launcher import launch_ranks
        launch_ranks({ranks_script(f"open({str(pids)!r} + str(rank), 'w').write(str(os.getpid()))" + chr(10)
                                   + "time.sleep(120)")!r}, 2)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher])
    deadline = time.monotonic() + 60
    while not all(os.path.exists(f"{pids}{r}") and open(f"{pids}{r}").read() for r in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    ranks = [int(open(f"{pids}{r}").read()) for r in (0, 1)]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not _survivors(ranks), "a rank outlived its launcher"


def test_a_rank_whose_launcher_is_already_gone_exits_at_once():
    """The launcher died while the rank started up (before it asked to die with it)."""
    env = dict(os.environ, **{LAUNCHER_ENV: str(os.getpid() + 1)})  # its parent is this process, not that one
    done = subprocess.run([sys.executable, "-c", "from validate.launcher import die_with_launcher\n"
                           "die_with_launcher()\nprint('still here')"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "still here" not in done.stdout


def _survivors(pids: list) -> list:
    """The processes of `pids` still running 5 s on; killed, so that a failing test leaves none."""
    alive = [pid for pid in pids if not _gone(pid, 5.0)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


def _gone(pid: int, within_s: float) -> bool:
    """Whether process `pid` ended (or is a zombie waiting to be reaped) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


# --- one writer per ledger ---

def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    path = str(tmp_path / "l.jsonl")
    with LedgerLock(path, "perfsim calibrate --device cpu"):
        with pytest.raises(PerfsimError) as err:
            Ledger(path)
        message = str(err.value)
        assert message.startswith(f"ledger {path} is in use by `perfsim calibrate --device cpu` (pid {os.getpid()} on ")
        assert "--ledger" in message and "\n" not in message
    with Ledger(path) as ledger:  # released: the next writer gets it
        assert os.path.exists(path + ".lock")
        assert ledger.keys == set()
    assert not os.path.exists(path + ".lock")  # removed with the lock
    assert Ledger(path, lock=False)._lock is None


def test_the_lock_goes_with_a_killed_holder(tmp_path):
    path = str(tmp_path / "l.jsonl")
    holder = subprocess.Popen([sys.executable, "-c", f"from validate.ledger import LedgerLock\n"
                               f"lock = LedgerLock({path!r}).acquire()\nprint('held', flush=True)\n"
                               "import time\ntime.sleep(120)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(PerfsimError, match=f"pid {holder.pid} "):
        LedgerLock(path).acquire()
    holder.kill()
    holder.wait()
    holder.stdout.close()
    with LedgerLock(path):  # the file is still there, its lock is not
        assert json.loads(open(path + ".lock").read())["pid"] == os.getpid()


# --- the real command, killed and rerun ---

MODEL = "layers=2,hidden=128,heads=4,seq=64,vocab=512"


def _keys(path) -> list:
    """The key of every whole record line of a ledger, repeats included."""
    keys = []
    for line in open(path, "rb").read().splitlines():
        try:
            keys.append(json.loads(line)["key"])
        except (ValueError, KeyError, TypeError):
            pass  # the line a kill cut short
    return keys


def _children(pid: int) -> list:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError):
                pass
    return out


@linux
@pytest.mark.multiprocess
def test_calibrate_killed_with_kill_9_and_rerun_at_once(tmp_path):
    """`kill -9` of `perfsim calibrate` half-way: no rank survives it; a second campaign on the
    ledger while it ran was refused at once; the rerun measures only what is missing, every key
    is in the ledger once, and its fit is the fit of those points written by one uninterrupted run."""
    from perfsim.calibrate import fit_ledger, read_ledger
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan
    from validate import microbench as mb

    ledger = tmp_path / "calibration-cpu.jsonl"
    argv = [sys.executable, "-m", "perfsim.cli", "calibrate", "--device", "cpu", "--nproc", "2", "--quick",
            "--suites", "gemm,memory", "--dtypes", "fp32", "--tp", "1", "--model", MODEL, "--ledger", str(ledger),
            "--min-time", "0.05", "--repeats", "2", "--warmup", "0", "--threads", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.Popen(argv + ["--no-fit"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while len(_keys(ledger) if ledger.exists() else []) < 4:
        assert first.poll() is None and time.monotonic() < deadline, "the campaign ended before the kill"
        time.sleep(0.02)
    ranks = _children(first.pid)
    assert len(ranks) == 2

    second = subprocess.run(argv + ["--no-fit"], env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert f"perfsim: error: ledger {ledger} is in use by " in second.stderr and f"(pid {first.pid} " in second.stderr

    first.send_signal(signal.SIGKILL)
    first.wait()
    assert not _survivors(ranks), "a rank outlived its launcher"
    before = set(_keys(ledger))

    out = tmp_path / "resumed.toml"
    rerun = subprocess.run(argv + ["--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "already in" in rerun.stderr and "USDT" not in rerun.stderr
    keys = _keys(ledger)
    assert len(keys) == len(set(keys)), "a point was recorded twice"
    points = mb.build_points("cpu", ("fp32",), load_model(MODEL), Plan(tp=1, dp=2, gbs=2), 2, 2,
                             mb.default_sweep("cpu", quick=True), ("gemm", "memory"))
    assert set(keys) == {p.key("cpu", 2) for p in points} and before < set(keys)

    # the same points as one uninterrupted run writes them: in the campaign's order, each once
    records = {r["key"]: r for r in read_ledger(str(ledger))[0]}
    (tmp_path / "whole").mkdir()
    whole = tmp_path / "whole" / ledger.name
    whole.write_text("".join(json.dumps(records[p.key("cpu", 2)]) + "\n" for p in points))
    resumed = fit_ledger(str(ledger), "cpu-example", None, report=lambda m: None)
    uninterrupted = fit_ledger(str(whole), "cpu-example", None, report=lambda m: None)
    assert {k: v.value for k, v in resumed.values.items()} == pytest.approx(
        {k: v.value for k, v in uninterrupted.values.items()}, rel=1e-9)
    assert out.exists()


def test_a_fit_of_a_ledger_with_repeated_points_says_which_copy_it_used(tmp_path):
    """An older ledger that two campaigns wrote at once: the fit warns, names the copy it used
    (the last), and fits exactly what a ledger holding only those copies gives."""
    from ledger_sample import synthetic_ledger

    from perfsim.calibrate import fit_ledger
    from perfsim.spec.system import load_system

    path = tmp_path / "twice.jsonl"
    synthetic_ledger(path, load_system("cpu-example"))
    lines = [x for x in path.read_text().splitlines() if x.endswith("}")]
    slow = [json.loads(x) for x in lines[:3]]
    for record in slow:  # the same points again, 1.4x slower (the machine ran both campaigns)
        record["stats"]["median_s"] *= 1.4
    path.write_text("\n".join(lines + [json.dumps(r) for r in slow]) + "\n")
    warnings = []
    twice = fit_ledger(str(path), "cpu-example", None, report=lambda m: None, warn=warnings.append)
    assert sum("the last copy (line" in w for w in warnings) == 3
    assert any("3 point(s) measured more than once; the fit uses the last copy of each" in w for w in warnings)
    once = tmp_path / "once" / path.name
    once.parent.mkdir()
    once.write_text("\n".join(lines[3:] + [json.dumps(r) for r in slow]) + "\n")
    alone = fit_ledger(str(once), "cpu-example", None, report=lambda m: None, warn=lambda m: None)
    assert {k: v.value for k, v in twice.values.items()} == pytest.approx({k: v.value for k, v in alone.values.items()})
