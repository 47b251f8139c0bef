"""One case to price: a model, a system and a plan, from plain values.

`build_case` applies the documented defaults of every command that takes a plan (README.md,
"Use": plan flags left out): dp derived from the device count, the global batch from mbs x dp, the pipeline split of
Megatron-Core's layout flags (docs/equations.md 9.4) and the profile's software stack
(`stack_defaults`). `BUILTIN_CASE` is what `perfsim predict` prices with no flags at all. The
command line turns its flags into these values (perfsim/commands/flags.py); uncertainty,
calibration and charts call the same functions.
"""

from __future__ import annotations

import os

from perfsim.errors import PerfsimError

# `perfsim predict` with no flags: the SMNG-P2 authors' 175B run (README.md, "Set up"; docs/reproduction.md 2).
BUILTIN_CASE = {"model": "gpt3-175b", "system": "smng-p2", "nodes": 16,
                "plan": {"tp": 8, "pp": 16, "mbs": 3, "gbs": 300, "zero": 1, "recompute": "full"}}


def load_case(model=None, system=None, *, moe_balanced: bool = False) -> tuple:
    """(model, system) from names, key=value specs or .toml paths (the built-in case's where None;
    loaded objects pass through); `moe_balanced`: routing forced to balance every expert's tokens."""
    from perfsim.spec.model import load_model
    from perfsim.spec.system import forced_balance, load_system

    system = load_system(BUILTIN_CASE["system"] if system is None else system) if _is_text(system) else system
    if moe_balanced:  # forced-balanced routing (--moe-balanced): no expert rank waits
        system = forced_balance(system)
    model = load_model(BUILTIN_CASE["model"] if model is None else model) if _is_text(model) else model
    return model, system


def _is_text(value) -> bool:
    return value is None or isinstance(value, (str, os.PathLike))


def device_count(system, fields: dict, *, nodes: int | None = None, devices: int | None = None) -> int:
    """`nodes` or `devices`, else the plan's own size (tp x cp x pp x dp, 1 where left out); more than
    perfsim models is an error before any plan is searched or priced."""
    from perfsim.spec.plan import device_count_problem

    if nodes is not None:
        devices = nodes * system.node.devices_per_node
    elif devices is None:
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


def build_case(model, system, *, nodes: int | None = None, devices: int | None = None, moe_balanced: bool = False,
               account_for_embedding: bool = False, account_for_loss: bool = False, **plan_fields) -> tuple:
    """(model, system, plan): `model` and `system` as `load_case` takes them, `nodes` or `devices`
    (else the plan's own size), and the plan fields given (None: left out), with the documented
    defaults applied. A plan that its derived dp leaves invalid is an error that says how dp was
    derived and what to give."""
    from perfsim.spec.plan import Plan, device_product, plan_problems

    given = (model, system)
    model, system = load_case(model, system, moe_balanced=moe_balanced)
    fields = {k: v for k, v in plan_fields.items() if v is not None}
    tp, pp = fields.get("tp", 1), fields.get("pp", 1)
    devices = device_count(system, fields, nodes=nodes, devices=devices)
    derived = "dp" not in fields
    if derived:
        fields["dp"] = derived_dp(devices, tp, pp, fields.get("cp", 1))
    fields.setdefault("gbs", fields.get("mbs", 1) * fields["dp"])
    fields = pipeline_split_fields(model, fields, account_for_embedding=account_for_embedding,
                                   account_for_loss=account_for_loss)
    if fields.get("vpp", 1) > 1:
        fields.setdefault("schedule", "interleaved")
    fields = stack_defaults(system, fields)
    plan = Plan(**fields)
    if plan.devices != devices:
        raise PerfsimError(f"{device_product(plan)} = {plan.devices} does not match the {devices} devices; "
                           "leave --dp out to derive it")
    problems = plan_problems(plan, model) if derived else []
    if problems:
        names = [BUILTIN_CASE[key] if g is None else g if _is_text(g) else o.name
                 for key, g, o in zip(("model", "system"), given, (model, system))]
        raise PerfsimError(_derived_dp_problem(*names, nodes, plan, problems))
    return model, system, plan


def pipeline_split_fields(model, fields: dict, *, account_for_embedding: bool = False,
                          account_for_loss: bool = False) -> dict:
    """`fields` with the pipeline layout read (pp_layout: a string, or a .toml file holding one)
    and its vpp where vpp is left out, and Megatron-Core's --account-for-embedding/loss-in-pipeline-split
    as the first and last stage's layer counts (docs/equations.md 9.4)."""
    from perfsim.spec.layout import load_layout_file, virtual_stages

    embedding, loss = bool(account_for_embedding), bool(account_for_loss)
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


def _derived_dp_problem(model: str, system: str, nodes: int | None, plan, problems: list) -> str:
    """Why a plan with a derived dp is invalid, how dp came about, and which flags would do."""
    import shlex

    where = f"--nodes {nodes}" if nodes is not None else f"--devices {plan.devices}"
    search = (f"perfsim search --model {shlex.quote(str(model))} --system {shlex.quote(str(system))} {where} "
              f"--gbs {plan.gbs}")
    batch = plan.mbs * plan.dp
    if plan.gbs % batch == 0 and (plan.schedule != "interleaved" or plan.microbatches % plan.pp == 0):
        return f"{'; '.join(problems)}; or run `{search}` to find a plan"  # dp is not the trouble
    remedies = ["give --tp/--pp"] + ([f"a --gbs that is a multiple of mbs x dp = {batch}"] if plan.gbs % batch else [])
    cp = f" x cp {plan.cp}" if plan.cp > 1 else ""
    return (f"{'; '.join(problems)} (dp = {plan.devices} devices / (tp {plan.tp}{cp} x pp {plan.pp}) = {plan.dp}, "
            f"derived because --dp was left out); {', or '.join(remedies)}, or run `{search}` to find a plan")
