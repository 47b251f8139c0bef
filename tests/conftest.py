"""Shared helpers and published reference data for the perfsim test suite.

The reference data is written from the papers (shared/reference/published.md), not from perfsim's
own code, so that tests compare perfsim against an independent derivation.
"""

from __future__ import annotations

import json

import pytest

from perfsim import cli

# Narayanan et al., SC21, Table 1: preset, published params (B), heads, hidden, layers, TP, PP, GPUs, batch.
SC21_TABLE1 = [
    ("sc21-1.7b", 1.7, 24, 2304, 24, 1, 1, 32, 512),
    ("sc21-3.6b", 3.6, 32, 3072, 30, 2, 1, 64, 512),
    ("sc21-7.5b", 7.5, 32, 4096, 36, 4, 1, 128, 512),
    ("sc21-18.4b", 18.4, 48, 6144, 40, 8, 1, 256, 1024),
    ("sc21-39.1b", 39.1, 64, 8192, 48, 8, 2, 512, 1536),
    ("sc21-76.1b", 76.1, 80, 10240, 60, 8, 4, 1024, 1792),
    ("sc21-145.6b", 145.6, 96, 12288, 80, 8, 8, 1536, 2304),
    ("sc21-310.1b", 310.1, 128, 16384, 96, 8, 16, 1920, 2160),
    ("sc21-529.6b", 529.6, 128, 20480, 105, 8, 35, 2520, 2520),
    ("sc21-1t", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072),
]
SC21_SEQ = 2048
SC21_VOCAB = 51200

GPT2_VOCAB = 50257


def pieces_exposed(total: float, window: float, pieces: int) -> float:
    """Hand count of overlapped communication: `pieces` equal pieces of `total` seconds, piece j
    ready after j/pieces of a `window`-second compute phase, sent one after another; how long the
    last one ends after the window (written out piece by piece, not as perfsim's closed form)."""
    end = 0.0
    for j in range(1, pieces + 1):
        end = max(end, window * j / pieces) + total / pieces
    return end - window


def padded_vocab(vocab: int, tp: int, divisor: int = 128) -> int:
    """Megatron's padding: the smallest multiple of divisor x tp that holds the vocabulary."""
    multiple = divisor * tp
    return ((vocab + multiple - 1) // multiple) * multiple


def search_rows_checked(model, devices: int, gbs: int, fixes: dict) -> list:
    """The search's raw candidates (rank order tp-dp-pp) as (plan, rejected by the search's own
    rules), each checked to be rejected exactly when spec.plan.plan_problems finds a problem."""
    from perfsim.search import candidates, plan_at, rejection_reasons
    from perfsim.spec.plan import plan_problems

    rows = []
    for mode, cols in candidates(model, devices, gbs, fixes):
        invalid = sum(mask for _, mask in rejection_reasons(model, mode, cols)) > 0
        for i in range(len(cols["tp"])):
            plan = plan_at(mode, "tp-dp-pp", cols, i)
            assert bool(invalid[i]) == bool(plan_problems(plan, model)), (plan, plan_problems(plan, model))
            rows.append((plan, bool(invalid[i])))
    return rows


class CliResult:
    def __init__(self, code: int, out: str, err: str):
        self.code, self.out, self.err = code, out, err

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def run_cli(capsys):
    """Run `perfsim.cli.main(argv)` in-process; returns exit code, stdout and stderr."""

    def run(*argv: str) -> CliResult:
        capsys.readouterr()  # drop anything printed before
        code = cli.main(list(argv))
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


def run_rank_check(tmp_path_factory, module: str, world: int, *args: str) -> dict:
    """Run `python -m MODULE OUT ARGS...` as `world` gloo ranks of one thread each
    (validate.launcher.launch_ranks) and return what rank 0 wrote, checked to come from `world` ranks."""
    from validate.launcher import launch_ranks

    out = tmp_path_factory.mktemp(module.rsplit(".", 1)[-1]) / f"world{world}.json"
    launch_ranks(["-W", "ignore::FutureWarning", "-m", module, str(out), *args], world, threads=1,
                 what=f"{module} check", resume="see the rank's error above")
    data = json.loads(out.read_text())
    assert data["world"] == world
    return data


def each_rank(results: dict):
    """(case, rank) for every rank of every case a rank check wrote (run_rank_check)."""
    for case in results["cases"]:
        for rank in case["ranks"]:
            yield case, rank


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A one-rank gloo process group in this process, for harness code that needs a group but no
    peers; yields the group."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
