"""The `perfsim` command line (shared/DESIGN.md). Only argument handling and output live here."""

from __future__ import annotations

import argparse
import json
import sys

from perfsim.errors import PerfsimError, one_line

# `perfsim predict` with no flags: the SMNG-P2 authors' 175B run (shared/reference/published.md).
BUILTIN_CASE = {"model": "gpt3-175b", "system": "smng-p2", "nodes": 16,
                "plan": {"tp": 8, "pp": 16, "mbs": 3, "gbs": 300, "zero": 1, "recompute": "full"}}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit status 2, no usage dump
        raise PerfsimError(f"{message} (see `{self.prog} --help`)")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {_short(text)!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {value}")
    if value > 2**40:
        raise argparse.ArgumentTypeError(f"{_short(text)} is implausibly large (at most {2**40})")
    return value


def _short(text: str) -> str:
    """A flag's text as an error message quotes it: at most 40 characters."""
    return text if len(text) <= 40 else text[:40] + "..."


def whole_number(low: int, high: int):
    """An argparse type: a whole number from `low` to `high`. The bounds cap the work a flag asks
    for (steps, threads, ranks) before anything is allocated or launched; the help says them."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}, got {_short(text)!r}")
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
                                             f"got {_short(text)!r}")
        return value
    return parse


def _add_case_flags(p: argparse.ArgumentParser, model_default: str = "gpt3-175b",
                    system_default: str = "smng-p2") -> None:
    """--model, --system, --nodes | --devices and --dtype, as predict takes them (a command whose
    defaults differ says its own)."""
    p.add_argument("--model", help=f"preset name, key=value spec, or .toml file (default: {model_default})")
    p.add_argument("--system", help=f"profile name in hwprofiles/ or a .toml path (default: {system_default})")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--nodes", type=_positive)
    where.add_argument("--devices", type=_positive)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32", "fp8"),
                   help="training precision (default bf16; fp8: the layers' GEMMs in FP8, docs/equations.md 3.11)")


def _add_plan_flags(p: argparse.ArgumentParser, left_out: str = "the built-in case's plan if no model, system or "
                    "device count is given, else no parallelism, micro-batch 1, one micro-batch per replica") -> None:
    g = p.add_argument_group(f"plan (left out: {left_out})")
    g.add_argument("--tp", type=_positive, help="tensor-parallel size")
    g.add_argument("--tp-mode", dest="tp_mode", choices=("1d", "2d", "2.5d", "3d"))
    g.add_argument("--tp-depth", dest="tp_depth", type=_positive, help="depth d of 2.5d tensor parallelism")
    g.add_argument("--sp", action="store_true", default=None, help="sequence parallelism (1d only)")
    g.add_argument("--cp", type=_positive, help="context-parallel size: ranks sharing each sequence by ring "
                   "attention (1d TP only; the sequence a multiple of 2 x cp)")
    g.add_argument("--pp", type=_positive, help="pipeline stages")
    g.add_argument("--vpp", type=_positive, help="interleaved chunks per device (implies --schedule interleaved)")
    g.add_argument("--first-stage-layers", dest="first_stage_layers", type=_positive,
                   help="layers of the first pipeline stage (default: as the others); the layers the first and "
                        "last stage leave spread evenly over the other stages")
    g.add_argument("--last-stage-layers", dest="last_stage_layers", type=_positive,
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
    g.add_argument("--dp", type=_positive, help="data-parallel size (default: devices / (tp x cp x pp))")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    g.add_argument("--mbs", type=_positive, help="micro-batch size (sequences)")
    g.add_argument("--gbs", type=_positive, help="global batch size (sequences)")
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
    g.add_argument("--ep", type=_positive, help="expert parallelism: ranks sharing each MoE layer's routed experts "
                   "(default 1; etp x ep must divide tp x cp x dp: Megatron-Core's parallel folding)")
    g.add_argument("--etp", type=whole_number(0, 2**40),
                   help="tensor parallelism inside each expert (default, or 0: --tp, as Megatron-Core)")
    g.add_argument("--moe-dispatcher", dest="moe_dispatcher", choices=("alltoall", "allgather"),
                   help="how tokens reach their experts: all-to-all over the EP group, or all-gather and "
                        "reduce-scatter over ETP x EP (default alltoall)")
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


def load_case(args) -> tuple:
    """(model, system) from --model and --system, the built-in case's where left out."""
    from perfsim.spec.model import load_model
    from perfsim.spec.system import load_system

    system = load_system(BUILTIN_CASE["system"] if args.system is None else args.system)
    if getattr(args, "moe_balanced", None):  # forced-balanced routing (--moe-balanced): no expert rank waits
        from perfsim.spec.system import forced_balance

        system = forced_balance(system)
    return load_model(BUILTIN_CASE["model"] if args.model is None else args.model), system


def plan_flags_given(args) -> dict:
    return {k: getattr(args, k) for k in PLAN_FLAGS if getattr(args, k) is not None}


def device_count(args, system, fields: dict) -> int:
    """--nodes or --devices, else the plan's own size (tp x cp x pp x dp, 1 where left out); more than
    perfsim models is an error before any plan is searched or priced."""
    from perfsim.spec.plan import device_count_problem

    if args.nodes is not None:
        devices = args.nodes * system.node.devices_per_node
    elif args.devices is not None:
        devices = args.devices
    else:
        devices = fields.get("tp", 1) * fields.get("cp", 1) * fields.get("pp", 1) * fields.get("dp", 1)
    too_many = device_count_problem(devices)
    if too_many:
        raise PerfsimError(too_many)
    return devices


def derived_dp(devices: int, tp: int, pp: int, cp: int = 1) -> int:
    if devices % (tp * cp * pp):
        what, flags = ("tp x cp x pp", "--tp/--cp/--pp") if cp > 1 else ("tp x pp", "--tp/--pp")
        raise PerfsimError(f"{devices} devices is not a multiple of {what} = {tp * cp * pp}; change {flags} or the device count")
    return devices // (tp * cp * pp)


def build_case(args):
    """(model, system, plan) from parsed flags, applying the documented defaults. A plan that
    its derived dp leaves invalid is an error that says how dp was derived and what to give."""
    from perfsim.spec.plan import Plan, device_product, plan_problems

    builtin = is_builtin(args)
    model, system = load_case(args)
    fields = dict(BUILTIN_CASE["plan"]) if builtin else {}
    fields.update(plan_flags_given(args))
    if builtin:
        args.nodes = BUILTIN_CASE["nodes"]
    tp, pp = fields.get("tp", 1), fields.get("pp", 1)
    devices = device_count(args, system, fields)
    derived = "dp" not in fields
    if derived:
        fields["dp"] = derived_dp(devices, tp, pp, fields.get("cp", 1))
    fields.setdefault("gbs", fields.get("mbs", 1) * fields["dp"])
    fields = pipeline_split_fields(args, model, fields)
    if fields.get("vpp", 1) > 1:
        fields.setdefault("schedule", "interleaved")
    fields = stack_defaults(system, fields)
    plan = Plan(**fields)
    if plan.devices != devices:
        raise PerfsimError(f"{device_product(plan)} = {plan.devices} does not match the {devices} devices; "
                           "leave --dp out to derive it")
    problems = plan_problems(plan, model) if derived else []
    if problems:
        raise PerfsimError(_derived_dp_problem(args, plan, problems))
    return model, system, plan


def pipeline_split_fields(args, model, fields: dict) -> dict:
    """`fields` with the pipeline layout read (--pp-layout: a string, or a .toml file holding one)
    and its vpp where --vpp is left out, and Megatron-Core's --account-for-embedding/loss-in-pipeline-split
    as the first and last stage's layer counts (docs/equations.md 9.4)."""
    import os

    from perfsim.spec.layout import load_layout_file, virtual_stages

    embedding, loss = bool(getattr(args, "account_for_embedding", None)), bool(getattr(args, "account_for_loss", None))
    layout = fields.get("pp_layout")
    if layout is not None:
        if embedding or loss or "first_stage_layers" in fields or "last_stage_layers" in fields:
            raise PerfsimError("--pp-layout places every layer itself: leave out --first-stage-layers, "
                               "--last-stage-layers and --account-for-...-in-pipeline-split")
        if layout.endswith(".toml") or os.path.sep in layout:
            layout = fields["pp_layout"] = load_layout_file(layout)
        stages = len(virtual_stages(layout)[0])
        if "vpp" not in fields and stages % fields.get("pp", 1) == 0:
            fields["vpp"] = stages // fields.get("pp", 1)
    if not (embedding or loss):
        return fields
    if "first_stage_layers" in fields or "last_stage_layers" in fields:
        raise PerfsimError("--account-for-embedding/loss-in-pipeline-split set the first and last stage's layers "
                           "(as in Megatron-Core, not both ways): leave out --first-stage-layers and --last-stage-layers")
    pp, vpp = fields.get("pp", 1), fields.get("vpp", 1)
    slots = model.layers + embedding + loss
    if pp < 2 or slots % (pp * vpp):
        what = f"pp x vpp = {pp * vpp}" if vpp > 1 else f"pp {pp}"
        raise PerfsimError(f"--account-for-...-in-pipeline-split counts the embedding and the loss as layers: "
                           f"{model.layers} layers + {embedding + loss} = {slots} must be a multiple of {what}"
                           + (" (and --pp 2 or more)" if pp < 2 else ""))
    share = slots // pp
    return fields | {"first_stage_layers": share - 1 if embedding else 0, "last_stage_layers": share - 1 if loss else 0}


def stack_defaults(system, fields: dict) -> dict:
    """`fields` with what the profile's software stack does by default where the flags say nothing:
    its attention kernel, and whether it overlaps data-parallel and (1d + SP) tensor-parallel
    communication with compute (an overlap the plan cannot have is left off, not an error)."""
    fw = system.framework
    sp_1d = bool(fields.get("sp")) and fields.get("tp_mode", "1d") == "1d" and fields.get("tp", 1) > 1
    return {"attention": fw.attention, "dp_overlap": bool(fw.dp_overlap) and fields.get("dp", 1) * fields.get("cp", 1) > 1,
            "tp_overlap": bool(fw.tp_overlap) and sp_1d} | fields


def _derived_dp_problem(args, plan, problems: list) -> str:
    """Why a plan with a derived dp is invalid, how dp came about, and which flags would do."""
    import shlex

    where = f"--nodes {args.nodes}" if args.nodes is not None else f"--devices {plan.devices}"
    search = (f"perfsim search --model {shlex.quote(args.model or BUILTIN_CASE['model'])} "
              f"--system {shlex.quote(args.system or BUILTIN_CASE['system'])} {where} --gbs {plan.gbs}")
    batch = plan.mbs * plan.dp
    if plan.gbs % batch == 0 and (plan.schedule != "interleaved" or plan.microbatches % plan.pp == 0):
        return f"{'; '.join(problems)}; or run `{search}` to find a plan"  # dp is not the trouble
    remedies = ["give --tp/--pp"] + ([f"a --gbs that is a multiple of mbs x dp = {batch}"] if plan.gbs % batch else [])
    cp = f" x cp {plan.cp}" if plan.cp > 1 else ""
    return (f"{'; '.join(problems)} (dp = {plan.devices} devices / (tp {plan.tp}{cp} x pp {plan.pp}) = {plan.dp}, "
            f"derived because --dp was left out); {', or '.join(remedies)}, or run `{search}` to find a plan")


def cmd_predict(args) -> None:
    from perfsim.predict import predict

    model, system, plan = build_case(args)
    if args.engine == "sim":
        from perfsim.schedule.simulator import predict_simulated

        result = predict_simulated(model, system, plan, dtype=args.dtype)
    else:
        result = predict(model, system, plan, dtype=args.dtype)
    from perfsim.uncertainty.predict import uncertainty_of_args

    uncertainty = uncertainty_of_args(args, model, system, plan)  # (JSON object, text) or None
    if args.json:
        extra = {"uncertainty": uncertainty[0]} if uncertainty else {}
        print(json.dumps(result.as_json() | {"engine": args.engine} | extra, indent=2))
    else:
        from perfsim.report import format_prediction

        print(format_prediction(result) + (f"\n\n{uncertainty[1]}" if uncertainty else ""))


def cmd_profiles(args) -> None:
    from perfsim.cost.counts import total_params
    from perfsim.spec.model import load_model
    from perfsim.spec.presets import PRESETS
    from perfsim.spec.system import available_systems, load_system

    systems = [load_system(name) for name in available_systems()]
    models = [load_model(name) for name in PRESETS]
    if args.json:
        print(json.dumps({"systems": [{"name": s.name, "description": s.description, "path": s.path} for s in systems],
                          "models": [m.as_dict() | {"params": total_params(m)} for m in models]}, indent=2))
        return
    print("systems (--system NAME, or a path to a .toml profile)")
    for s in systems:
        print(f"  {s.name:<14} {s.node.devices_per_node} x {s.device.name}, "
              f"{s.device.peak_flops_bf16 / 1e12:.1f} TFLOP/s bf16 peak  - {s.description}")
    print("\nmodels (--model NAME, key=value pairs, or a .toml file)")
    for m in models:
        print(f"  {m.name:<14} {total_params(m) / 1e9:8.2f} B params  layers {m.layers:<4} hidden {m.hidden:<6} "
              f"heads {m.heads:<4} seq {m.seq}")


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="perfsim", description="Predict and explain LLM training performance on HPC systems.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("predict", help="predict one plan's step time, throughput and memory")
    _add_case_flags(p)
    _add_plan_flags(p)
    p.add_argument("--engine", default="analytic", choices=("analytic", "sim"),
                   help="step time from the closed form (default) or the event simulation (perfsim simulate)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--uncertainty", action="store_true",
                   help="also P10/P50/P90 over draws of the profile's ranges, conditioned on its observations "
                        "(docs/profile-format.md, Ranges)")
    p.add_argument("--samples", type=whole_number(16, 65536), help="draws for --uncertainty (default 512)")
    p.add_argument("--observe", action="append", metavar="LEDGER",
                   help="with --uncertainty: condition on a calibration ledger measured on this machine too (its "
                        "GEMMs and collectives as observations, docs/validation.md); repeatable")
    p.set_defaults(run=cmd_predict)
    prof = sub.add_parser("profiles", help="list system profiles and model presets")
    prof.add_argument("--json", action="store_true")
    prof.set_defaults(run=cmd_profiles)
    for module in _command_modules():
        module.register(sub)
    return parser


def _command_modules():
    import importlib
    import pkgutil

    from perfsim import commands

    names = sorted(m.name for m in pkgutil.iter_modules(commands.__path__))
    return [importlib.import_module(f"perfsim.commands.{name}") for name in names]


def main(argv=None) -> int:
    try:
        args = make_parser().parse_args(argv)
        args.run(args)
    except PerfsimError as exc:  # one line, whatever a quoted path or value holds
        message = one_line(exc)
        if len(message) > 2000:  # a value quoted whole (a megabyte-long flag, a table)
            message = message[:2000] + "... (cut)"
        print(f"perfsim: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
