"""The flags the commands share: the parser class (one-line errors), the number parsers, the case
flags (--model, --system, --nodes | --devices, --dtype) and the plan flags, and the case those flags
name (perfsim/spec/case.py builds it from plain values). Every command takes its flags from here.
"""

from __future__ import annotations

import argparse
import re

from perfsim.errors import PerfsimError

LARGEST_NUMBER = 2**40  # a flag's whole number above this is a typo, not a plan (predict --gbs 2**40 runs)


class Parser(argparse.ArgumentParser):
    """argparse with its errors as one line, exit status 2, no usage dump."""

    def error(self, message):
        raise PerfsimError(f"{message} (see `{self.prog} --help`)")


def short(text: str) -> str:
    """A flag's text as an error message quotes it: at most 40 characters."""
    return text if len(text) <= 40 else text[:40] + "..."


def positive(text: str) -> int:
    """An argparse type: a whole number from 1 to LARGEST_NUMBER."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {short(text)!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {value}")
    if value > LARGEST_NUMBER:
        raise argparse.ArgumentTypeError(f"{short(text)} is implausibly large (at most {LARGEST_NUMBER})")
    return value


def whole_number(low: int, high: int):
    """An argparse type: a whole number from `low` to `high`. The bounds cap the work a flag asks
    for (steps, threads, ranks) before anything is allocated or launched; the help says them."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}, got {short(text)!r}")
        return value
    return parse


def finite_number(low: float, high: float):
    """An argparse type: a number above `low` and at most `high` (nan and inf are neither)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not low < value <= high:
            raise argparse.ArgumentTypeError(f"expected a number above {low:g} and at most {high:g}, "
                                             f"got {short(text)!r}")
        return value
    return parse


def slurm_name(text: str) -> str:
    """A Slurm partition or account: one word, written into an #SBATCH line (a newline or a space
    would end that line and put the rest into the script as shell)."""
    if not re.fullmatch(r"[A-Za-z0-9_.,:+-]{1,100}", text):
        raise argparse.ArgumentTypeError(f"expected a Slurm name such as general or pn12ab (letters, digits, "
                                         f"_ . , : + -), got {text[:40]!r}")
    return text


def walltime(text: str) -> str:
    """A Slurm time limit: [days-]hours:minutes:seconds."""
    if not re.fullmatch(r"(\d+-)?\d{1,2}:\d{2}:\d{2}", text):
        raise argparse.ArgumentTypeError(f"expected a Slurm time like 01:30:00 or 1-00:00:00, got {text!r}")
    return text


def add_case_flags(p: argparse.ArgumentParser, model_default: str = "gpt3-175b",
                   system_default: str = "smng-p2") -> None:
    """--model, --system, --nodes | --devices and --dtype, as predict takes them (a command whose
    defaults differ says its own)."""
    p.add_argument("--model", help=f"preset name, key=value spec, or .toml file (default: {model_default})")
    p.add_argument("--system", help=f"profile name in hwprofiles/ or a .toml path (default: {system_default})")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--nodes", type=positive)
    where.add_argument("--devices", type=positive)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32", "fp8"),
                   help="training precision (default bf16; fp8: the layers' GEMMs in FP8, docs/equations.md 3.11)")


def add_plan_flags(p: argparse.ArgumentParser, left_out: str = "the built-in case's plan if no model, system or "
                   "device count is given, else no parallelism, micro-batch 1, one micro-batch per replica") -> None:
    g = p.add_argument_group(f"plan (left out: {left_out})")
    g.add_argument("--tp", type=positive, help="tensor-parallel size")
    g.add_argument("--tp-mode", dest="tp_mode", choices=("1d", "2d", "2.5d", "3d"))
    g.add_argument("--tp-depth", dest="tp_depth", type=positive, help="depth d of 2.5d tensor parallelism")
    g.add_argument("--sp", action="store_true", default=None, help="sequence parallelism (1d only)")
    g.add_argument("--cp", type=positive, help="context-parallel size: ranks sharing each sequence by ring "
                   "attention (1d TP only; the sequence a multiple of 2 x cp)")
    g.add_argument("--pp", type=positive, help="pipeline stages")
    g.add_argument("--vpp", type=positive, help="interleaved chunks per device (implies --schedule interleaved)")
    g.add_argument("--first-stage-layers", dest="first_stage_layers", type=positive,
                   help="layers of the first pipeline stage (default: as the others); the layers the first and "
                        "last stage leave spread evenly over the other stages")
    g.add_argument("--last-stage-layers", dest="last_stage_layers", type=positive,
                   help="layers of the last pipeline stage (default: as the others)")
    g.add_argument("--account-for-embedding-in-pipeline-split", dest="account_for_embedding", action="store_true",
                   default=None, help="count the embedding as a layer of the first stage's first chunk, as Megatron-Core "
                   "does: one layer fewer there (layers + 1, or + 2 with the loss, a multiple of pp x vpp)")
    g.add_argument("--account-for-loss-in-pipeline-split", dest="account_for_loss", action="store_true", default=None,
                   help="count the loss as a layer of the last stage's last chunk: one layer fewer there")
    g.add_argument("--pp-layout", dest="pp_layout", metavar="LAYOUT",
                   help="Megatron-Core's pipeline layout (--pipeline-model-parallel-layout), e.g. 'Et*3|(tt|)*29,m|L': "
                        "E embedding, t decoder layer, m MTP layer, L loss, | a virtual stage boundary; or a .toml file "
                        "holding one (docs/equations.md 9.4); its virtual stages / pp give --vpp")
    g.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"))
    g.add_argument("--dp", type=positive, help="data-parallel size (default: devices / (tp x cp x pp))")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    g.add_argument("--mbs", type=positive, help="micro-batch size (sequences)")
    g.add_argument("--gbs", type=positive, help="global batch size (sequences)")
    g.add_argument("--recompute", choices=("none", "selective", "full"))
    g.add_argument("--order", help="rank order, innermost first (default tp-dp-pp)")
    g.add_argument("--tp-axes", dest="tp_axes",
                   help="tensor-parallel grid axes innermost first, e.g. input-weight-output for 3d, row-col for 2d "
                        "(default auto: heaviest traffic on the fastest links)")
    g.add_argument("--tp-regather", dest="tp_regather", action="store_true", default=None,
                   help="3d: re-gather inputs and weights in backward instead of keeping the gathered copies")
    g.add_argument("--attention", choices=("unfused", "flash"),
                   help="attention core: two GEMMs around a softmax, or one fused (flash) kernel "
                        "(default: the profile's framework.attention)")
    g.add_argument("--dp-overlap", dest="dp_overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap data-parallel reductions and weight gathers with compute, bucket by bucket "
                        "(default: the profile's framework.dp_overlap)")
    g.add_argument("--tp-overlap", dest="tp_overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="1d + SP: pipeline the all-gathers and reduce-scatters with their GEMMs "
                        "(default: the profile's framework.tp_overlap where the plan has --sp)")
    g.add_argument("--ep", type=positive, help="expert parallelism: ranks sharing each MoE layer's routed experts "
                   "(default 1; etp x ep must divide tp x cp x dp: Megatron-Core's parallel folding)")
    g.add_argument("--etp", type=whole_number(0, LARGEST_NUMBER),
                   help="tensor parallelism inside each expert (default, or 0: --tp, as Megatron-Core)")
    g.add_argument("--moe-dispatcher", dest="moe_dispatcher", choices=("alltoall", "allgather", "flex"),
                   help="how tokens reach their experts: all-to-all over the EP group, all-gather and "
                        "reduce-scatter over ETP x EP, or flex (Megatron-Core's DeepEP backend: one copy of a "
                        "token per node over the network, forwarded over NVLink) (default alltoall)")
    g.add_argument("--ep-overlap", dest="ep_overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap one micro-batch's all-to-alls with another's compute (Megatron-Core's "
                        "--overlap-moe-expert-parallel-comm; default off)")
    g.add_argument("--moe-balanced", dest="moe_balanced", action="store_true", default=None,
                   help="routing forced to balance every expert's tokens (Megatron-Core's "
                        "--moe-router-force-load-balancing, as benchmarks run): moe.imbalance 1 instead of the profile's")


PLAN_FLAGS = ("tp", "tp_mode", "tp_depth", "sp", "pp", "vpp", "schedule", "dp", "zero", "mbs", "gbs", "recompute", "order",
              "tp_axes", "tp_regather", "attention", "dp_overlap", "tp_overlap", "cp", "first_stage_layers",
              "last_stage_layers", "pp_layout", "ep", "etp", "moe_dispatcher", "ep_overlap")


def is_builtin(args) -> bool:
    """No model, system or device count given: the built-in case, plan flags included."""
    return args.model is None and args.system is None and args.nodes is None and args.devices is None


def plan_flags_given(args) -> dict:
    return {k: getattr(args, k) for k in PLAN_FLAGS if getattr(args, k) is not None}


def load_case(args) -> tuple:
    """(model, system) from --model and --system, the built-in case's where left out."""
    from perfsim.spec.case import load_case as load

    return load(args.model, args.system, moe_balanced=bool(getattr(args, "moe_balanced", None)))


def device_count(args, system, fields: dict) -> int:
    """--nodes or --devices, else the plan's own size (perfsim.spec.case.device_count)."""
    from perfsim.spec.case import device_count as count

    return count(system, fields, nodes=args.nodes, devices=args.devices)


def build_case(args) -> tuple:
    """(model, system, plan) from parsed case and plan flags (perfsim.spec.case.build_case): the
    built-in case, plan flags given on top, when no model, system or device count is given (then
    args.nodes is set to its node count)."""
    from perfsim.spec.case import BUILTIN_CASE, build_case as build

    fields = plan_flags_given(args)
    if is_builtin(args):
        fields = dict(BUILTIN_CASE["plan"]) | fields
        args.nodes = BUILTIN_CASE["nodes"]
    return build(args.model, args.system, nodes=args.nodes, devices=args.devices,
                 moe_balanced=bool(getattr(args, "moe_balanced", None)),
                 account_for_embedding=bool(getattr(args, "account_for_embedding", None)),
                 account_for_loss=bool(getattr(args, "account_for_loss", None)), **fields)
