"""Every `perfsim ...` command line in README.md and docs/*.md runs: each is read from the code
blocks and indented blocks (backslash continuations joined, trailing `# comments` dropped) and run
in-process through perfsim.cli.main in a scratch folder (hwprofiles/ linked in, so the documents'
repository paths work, and every --out/--html/--trace/--emit-slurm file lands there and is
checked). A command that measures a machine with torch ranks or needs hardware this box lacks is
not run: it is listed below with the reason, and the test fails when that list and the documents
disagree, so a new command in the documents has to be run or classified. Synopses (with
[options] and PLACEHOLDERS) run in a concrete form listed beside them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from perfsim.cli import main, make_parser

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OUTPUT_FLAGS = ("--out", "--html", "--trace", "--emit-slurm")

# The small mixture of experts docs/real-steps-experts.md measures.
EXPERTS_MODEL = ("layers=2,hidden=64,heads=4,kv_heads=2,ffn=160,activation=swiglu,norm=rmsnorm,bias=false,"
                 "learned_positions=false,seq=32,vocab=512,tied_embeddings=false,dropout=false,experts=4,topk=2,"
                 "expert_ffn=32,shared_expert_ffn=64")
MINUTES = "starts torch ranks and measures for minutes (even --quick ran over ten minutes on the 2-core test VM)"
# Written command (its words joined by single spaces) -> why it is not run. Each is still parsed
# by perfsim's argument parser, so a renamed or removed flag is caught.
NOT_RUN = {
    "perfsim calibrate --device cpu --nproc 2": MINUTES,
    "perfsim calibrate --device cuda --nproc 8 --system dgx-a100 --out my-dgx.toml": "needs 8 CUDA GPUs",
    "perfsim calibrate --device cpu --nproc 2 --suites memory --no-fit --ledger hwprofiles/ledgers/calibration-cpu.jsonl":
        MINUTES + "; it would also append to the committed ledger",
    "perfsim validate --device cpu --nproc 2": "runs real training steps of 15 plans on torch ranks: minutes",
    "perfsim validate --device cpu --nproc 2 --plans tp=2;pp=2,gbs=8 --model layers=2,hidden=64,heads=8,kv_heads=2,"
    "ffn=160,activation=swiglu,norm=rmsnorm,bias=false,learned_positions=false,tied_embeddings=false,dropout=false,"
    "seq=32,vocab=512": "real training steps on torch ranks (tests/test_validate_llama.py runs such a command)",
    "perfsim calibrate --device cpu --nproc 2 --system cpu-calibrated --out cpu-HOST.toml":
        MINUTES + " (the command validate's mismatch warning prints)",
    "perfsim validate --device cpu --nproc 2 --steps 4 --rounds 6 --ledger hwprofiles/ledgers/validation-cpu.jsonl":
        "runs real training steps for an hour; it would also append to the committed ledger",
    "perfsim calibrate --device cpu --nproc 2 --suites collective --model " + EXPERTS_MODEL
    + " --plans dp=2,ep=2;tp=2,sp=true,ep=2,etp=1 --dtypes bf16 --no-fit --ledger a2a.jsonl":
        "measures all-to-all points on torch ranks: minutes (docs/real-steps-experts.md)",
    "perfsim validate --device cpu --nproc 2 --model " + EXPERTS_MODEL
    + " --system cpu-calibrated-a2a.toml --ledger v2.jsonl --json":
        "real expert-parallel steps on torch ranks (tests/test_validate_ep_steps.py runs such steps)",
    "perfsim validate --device cpu --nproc 4 --model " + EXPERTS_MODEL
    + " --system cpu-calibrated-a2a.toml --ledger v4.jsonl --json":
        "real expert-parallel steps on 4 torch ranks",
    "perfsim validate --device cpu --nproc 2 --model " + EXPERTS_MODEL
    + " --system host-ops.toml --ledger host-ops-validation.jsonl --rounds 3":
        "reads back the ledger the line above copies, against the profile the fit above writes "
        "(tests/test_validate_ep_steps.py reads the table back that way)",
}
# Synopses: written command -> (what runs instead, why). None: not run, only the reason.
SYNOPSES = {
    "perfsim calibrate --fit LEDGER --system BASE --out FILE [--statistic min|median|p25|mean]":
        ("perfsim calibrate --fit hwprofiles/ledgers/calibration-cpu.jsonl --system cpu-example --out fitted.toml",
         "placeholders filled with the committed CPU ledger"),
    "perfsim validate --device cpu --nproc 2 [--model SPEC] [--plans tp=2,sp=true;pp=2,gbs=8] [--steps 3] "
    "[--warmup 1] [--rounds 1] [--ledger validation-cpu.jsonl] [--timeout 300] [--json]":
        (None, "a synopsis of real training steps on torch ranks: minutes"),
    "perfsim validate --device cuda --nproc 1 --system h200.toml --model M --plans P --steps 5 --speed-tolerance inf "
    "--ledger copy-of-validation.jsonl":
        (None, "reads the H200's nine steps back from a copy of their ledger, each model with its plans "
               "(tests/test_h200_ledger.py runs it)"),
    "perfsim validate --device cpu --nproc 2 ... --system cpu-HOST.toml":
        (None, "validate's mismatch warning ('...': the options of the run just made); real training steps: minutes"),
    "perfsim validate --megatron-log train.log --model sc21-1.7b --system dgx-a100 --devices 8 --tp 2 --mbs 4 "
    "--gbs 64 [--json]":
        ("perfsim validate --megatron-log train.log --model sc21-1.7b --system dgx-a100 --devices 8 --tp 2 --mbs 4 "
         "--gbs 64 --json", "with --json, on a log written by the test (tests/test_validate_megatron_log.py)"),
    "perfsim validate --emit-slurm validate.sbatch --nodes 2 "
    "--model layers=4,hidden=512,heads=16,seq=256,vocab=8192,tied_embeddings=false,dropout=false "
    "--plans tp=16,sp=true,recompute=selective;tp=8,pp=2,gbs=8 [--system smng-p2-calibrated.toml] "
    "[--steps 3 --warmup 1 --dtype bf16 --timeout 300 --ledger validation-xpu.jsonl] "
    "[--time 01:00:00 --partition P --account A --setup source venv/bin/activate]":
        ("perfsim validate --emit-slurm validate.sbatch --nodes 2 "
         "--model layers=4,hidden=512,heads=16,seq=256,vocab=8192,tied_embeddings=false,dropout=false "
         "--plans 'tp=16,sp=true,recompute=selective;tp=8,pp=2,gbs=8' --steps 3 --warmup 1 --dtype bf16 "
         "--timeout 300 --time 01:00:00 --partition P --account A --setup 'source venv/bin/activate'",
         "the optional parts given, but --system (a calibrated profile written by perfsim calibrate) "
         "and --ledger (the job's own output)"),
}


def _code_lines(text: str):
    """(line number, line) of the lines inside ``` fences and of indented (4+ spaces) lines."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith(("    ", "\t")):
            yield number, line.strip()


def _subcommands() -> set:
    parser = make_parser()
    return set(next(a for a in parser._actions if a.dest == "command").choices)


def documented_commands() -> dict:
    """Command (words joined by single spaces) -> (words, [where, ...]) for every `perfsim`
    command line.
    A line counts when `perfsim` opens it (or follows `&&`) and a subcommand or a flag comes next,
    so prose that wraps to `perfsim prices ...` in an indented list item is not taken."""
    found: dict = {}
    names = _subcommands()
    for path in DOCUMENTS:
        pending = None
        for number, line in _code_lines(path.read_text(encoding="utf-8")):
            if pending is None:
                match = re.search(r"(?:^|&&\s*)(perfsim(?:\s.*)?)$", line)
                if not match:
                    continue
                pending = (number, match.group(1))
            else:
                pending = (pending[0], pending[1] + " " + line)
            if pending[1].endswith("\\"):
                pending = (pending[0], pending[1][:-1].rstrip())
                continue
            words = shlex.split(pending[1], comments=True)
            if len(words) == 1 or words[1] in names or words[1].startswith("-"):
                found.setdefault(" ".join(words), (words, []))[1].append(f"{path.relative_to(ROOT)}:{pending[0]}")
            pending = None
    return found


FOUND = documented_commands()
TO_RUN = {command: found for command, found in FOUND.items() if command not in NOT_RUN and command not in SYNOPSES}
RUNS = [(command, words, where) for command, (words, where) in TO_RUN.items()] + \
       [(command, shlex.split(instead), FOUND.get(command, (None, ["?"]))[1])
        for command, (instead, _) in SYNOPSES.items() if instead]


def test_the_documents_hold_commands_and_every_unrun_one_is_classified():
    assert len(FOUND) >= 30, sorted(FOUND)
    assert "perfsim predict" in FOUND and any(c.startswith("perfsim report") for c in FOUND)
    listed = set(NOT_RUN) | set(SYNOPSES)
    assert listed <= set(FOUND), f"listed but in no document any more: {sorted(listed - set(FOUND))}"
    measuring = {c for c in FOUND if c.split()[1:2] in (["calibrate"], ["validate"])
                 and not {"--emit-slurm", "--fit", "--help", "--megatron-log"} & set(c.split())}
    assert measuring - listed == set(), "a command that measures with torch must be listed in NOT_RUN with why"
    assert not [c for c in TO_RUN if "[" in c or re.search(r"\b[A-Z]{3,}\b", c)], "a synopsis must be in SYNOPSES"
    assert {c for c in FOUND if c not in TO_RUN} == listed


@pytest.mark.parametrize("command", sorted(NOT_RUN))
def test_commands_not_run_still_parse(command):
    args = make_parser().parse_args(shlex.split(command)[1:])
    assert args.command == command.split()[1]


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A folder with hwprofiles/ linked in and the files a documented command reads that a user
    brings along (a Megatron-DeepSpeed log)."""
    from test_validate_megatron_log import write_log

    (tmp_path / "hwprofiles").symlink_to(ROOT / "hwprofiles", target_is_directory=True)
    write_log(tmp_path / "train.log", [(10, 100, 9000.0, 80.0), (20, 100, 5000.0, 120.0), (30, 100, 5200.0, 118.0)])
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("written, words, where", RUNS, ids=[r[2][0] for r in RUNS])
def test_documented_command_runs(written, words, where, scratch, capsys):
    argv = words[1:]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, f"{', '.join(where)}: `{written}` exited {code}: {err.strip()[-1500:]}"
    assert out.strip() or "wrote" in err, f"{where}: `{written}` printed nothing"
    for flag in OUTPUT_FLAGS:
        if flag in argv:
            path = scratch / argv[argv.index(flag) + 1]
            assert path.is_file() and path.stat().st_size > 0, f"{where}: {flag} {path.name} was not written"
