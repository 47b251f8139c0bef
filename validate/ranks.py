"""The frame every rank of a check runs in (validate.tp_check, validate.pp_dp_check,
validate.multidim_check): the shared command line, one gloo process group with a timeout, every
rank's result of a case gathered on all ranks, and rank 0's JSON file.

    args = check_parser("python -m validate.x_check", MODEL, "comma list of ... or all").parse_args(argv)
    with gloo_ranks(args.timeout) as ranks:
        cases = [{"case": name, "ranks": every_rank(run_case(...))} for name in ...]
        write_on_rank0(ranks, args.out, model=args.model, cases=cases)

Every rank also finds its place in the job here (rank_environment): RANK / WORLD_SIZE /
LOCAL_RANK (torchrun and the local launcher), else PMI_RANK / PMI_SIZE / PALS_LOCAL_RANKID
(mpiexec on SMNG-P2, Cray PALS), else Open MPI's or Slurm's.

No torch is imported until gloo_ranks starts, so a check's module imports without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

from perfsim.errors import PerfsimError

RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
LOCAL_RANK_VARS = ("LOCAL_RANK", "PALS_LOCAL_RANKID", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "PALS_LOCAL_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    local_rank: int
    local_world: int


def _first_int(environ, names, default):
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise PerfsimError(f"environment variable {name}={value!r} is not a whole number") from None
    return default


def rank_environment(environ=None) -> Ranks:
    """This process's place in the job, from the launcher's environment."""
    environ = os.environ if environ is None else environ
    rank = _first_int(environ, RANK_VARS, 0)
    world = _first_int(environ, SIZE_VARS, 1)
    local_rank = _first_int(environ, LOCAL_RANK_VARS, rank)
    local_world = _first_int(environ, LOCAL_SIZE_VARS, 0)
    if not local_world:
        per_node = _first_int(environ, ("SLURM_NTASKS_PER_NODE",), 0)
        local_world = per_node or world
    if not 0 <= rank < world:
        raise PerfsimError(f"rank {rank} is outside a world of {world} ranks; check the launcher's environment")
    return Ranks(rank, world, local_rank, min(local_world, world))


def check_parser(prog: str, model: str, cases_help: str) -> argparse.ArgumentParser:
    """The arguments every check takes (OUT, --model, --cases, --timeout); a check adds its own."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("out")
    parser.add_argument("--model", default=model)
    parser.add_argument("--cases", default="all", help=cases_help)
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a collective may wait for the other ranks before this rank fails (a dead rank)")
    return parser


@contextmanager
def gloo_ranks(timeout_s: float):
    """This process as one rank of a gloo process group (rank_environment's
    rank and world, OMP_NUM_THREADS torch threads, default 1); yields its Ranks. A collective
    that waits longer than `timeout_s` raises, so a dead rank ends the check instead of hanging it."""
    from datetime import timedelta

    from validate.launcher import die_with_launcher

    die_with_launcher()
    import torch
    import torch.distributed as dist

    ranks = rank_environment()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world, timeout=timedelta(seconds=timeout_s))
    try:
        yield ranks
        dist.barrier()  # no rank tears gloo down while another still talks to it (else: abort at exit)
    finally:
        dist.destroy_process_group()


def leave(code: int = 0) -> None:
    """End a rank's process with exit status `code`, without the interpreter's teardown: a C++
    thread of torch's runtime that is still joinable at exit aborts the process now and then
    ("terminate called without an active exception", SIGABRT) after all its work is done and
    written, which fails a check that passed (seen in tests/test_validate_gpt.py, session 28)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def every_rank(mine) -> list:
    """Every rank's `mine` (any picklable object), in rank order, on every rank."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def write_on_rank0(ranks, path: str, **fields) -> None:
    """Rank 0 writes {"world": ..., **fields} to `path` as JSON (the file the check's pytest reads)."""
    if ranks.rank == 0:
        with open(path, "w") as fh:
            json.dump({"world": ranks.world, **fields}, fh, indent=1)
