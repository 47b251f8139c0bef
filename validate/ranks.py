"""The frame every rank of a check runs in (validate.tp_check, validate.pp_dp_check,
validate.multidim_check): the shared command line, one gloo process group with a timeout, every
rank's result of a case gathered on all ranks, and rank 0's JSON file.

    args = check_parser("python -m validate.x_check", MODEL, "comma list of ... or all").parse_args(argv)
    with gloo_ranks(args.timeout) as ranks:
        cases = [{"case": name, "ranks": every_rank(run_case(...))} for name in ...]
        write_on_rank0(ranks, args.out, model=args.model, cases=cases)

No torch is imported until gloo_ranks starts, so a check's module imports without it.
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import contextmanager


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
    """This process as one rank of a gloo process group (validate.campaign.rank_environment's
    rank and world, OMP_NUM_THREADS torch threads, default 1); yields its Ranks. A collective
    that waits longer than `timeout_s` raises, so a dead rank ends the check instead of hanging it."""
    from datetime import timedelta

    from validate.launcher import die_with_launcher

    die_with_launcher()
    import torch
    import torch.distributed as dist

    from validate.campaign import rank_environment

    ranks = rank_environment()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", rank=ranks.rank, world_size=ranks.world, timeout=timedelta(seconds=timeout_s))
    try:
        yield ranks
        dist.barrier()  # no rank tears gloo down while another still talks to it (else: abort at exit)
    finally:
        dist.destroy_process_group()


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
