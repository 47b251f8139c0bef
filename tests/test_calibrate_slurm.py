"""`perfsim calibrate --emit-slurm`: the SMNG-P2 batch script is valid bash and matches the golden
file byte for byte (regenerate it with PERFSIM_UPDATE_GOLDEN=1 after an intended change)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden" / "calibrate-smng-p2.sbatch"
ARGS = ("calibrate", "--emit-slurm", "job.sbatch", "--nodes", "4", "--time", "02:00:00", "--partition", "general",
        "--account", "pn12ab", "--setup", "module load intel-oneapi-compilers",
        "--setup", 'source "$HOME/venvs/torch-xpu/bin/activate"', "--ledger", "smng-p2.jsonl",
        "--out", "smng-p2-calibrated.toml")


@pytest.fixture
def emitted(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run_cli(*ARGS)
    assert r.code == 0, r.err
    assert "sbatch job.sbatch" in r.out
    return tmp_path / "job.sbatch"


def test_script_matches_golden_file(emitted):
    text = emitted.read_text()
    if os.environ.get("PERFSIM_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_script_passes_bash_syntax_check(emitted):
    result = subprocess.run(["bash", "-n", str(emitted)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(emitted, os.X_OK)


def test_script_carries_the_smng_p2_settings(emitted):
    text = emitted.read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "export ZE_FLAT_DEVICE_HIERARCHY=FLAT",
                 "export ZE_AFFINITY_MASK=0,1,2,3,4,5,6,7", "export CCL_OP_SYNC=1", "export CCL_SKIP_SCHEDULER=1",
                 "export CCL_ALLGATHERV_MEDIUM_SIZE_THRESHOLD=0", "export ZE_ENABLE_PCI_ID_DEVICE_ORDER=1",
                 "export MASTER_ADDR MASTER_PORT"):
        assert line in text.splitlines()
    mpiexec = next(line for line in text.splitlines() if line.startswith("mpiexec"))
    assert '-n "$NRANKS" -ppn 8 perfsim calibrate --worker --device xpu' in mpiexec
    assert "--tp 8" in mpiexec and "--ledger smng-p2.jsonl" in mpiexec
    assert "perfsim calibrate --fit smng-p2.jsonl --system smng-p2 --device xpu --out smng-p2-calibrated.toml" in text


def test_script_workers_parse_as_perfsim_arguments(emitted):
    """The worker line is a valid `perfsim calibrate` command line (the parser accepts it)."""
    import shlex

    from perfsim import cli

    mpiexec = next(line for line in emitted.read_text().splitlines() if line.startswith("mpiexec"))
    argv = shlex.split(mpiexec.split(" -ppn 8 ", 1)[1])[1:]
    args = cli.make_parser().parse_args(argv)
    assert args.worker and args.device == "xpu" and args.tp == 8 and args.ledger == "smng-p2.jsonl"


def test_emit_slurm_rejects_other_devices_and_bad_times(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run_cli("calibrate", "--emit-slurm", "j.sbatch", "--nodes", "2", "--device", "cuda")
    assert r.code == 2 and "SMNG-P2 (XPU)" in r.err
    r = run_cli("calibrate", "--emit-slurm", "j.sbatch", "--nodes", "2", "--time", "90 minutes")
    assert r.code == 2 and "Slurm time" in r.err


def test_emit_slurm_and_fit_never_import_torch(tmp_path):
    """perfsim imports torch only in the commands that measure: writing the job script and
    fitting a ledger work on a login node without it."""
    import sys

    code = ("import sys; from perfsim import cli; "
            "assert cli.main(['calibrate', '--emit-slurm', 'j.sbatch', '--nodes', '2']) == 0; "
            "assert cli.main(['calibrate', '--fit', 'none.jsonl', '--system', 'smng-p2']) == 2; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
