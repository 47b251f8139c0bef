"""`perfsim scale`: weak or strong scaling of one plan over node counts (perfsim/scaling.py)."""

from __future__ import annotations

import json

from perfsim.errors import PerfsimError

# The SMNG-P2 authors' scaling protocol (docs/validation.md, "SMNG-P2 scaling"): 175B, TP 8, PP 16, micro-batch
# 3, ZeRO-1, full recomputation; weak keeps 100 micro-batches per pipeline, strong a global batch of 2520.
PROTOCOL_MICROBATCHES = 100
PROTOCOL_STRONG_GBS = 2520


def register(sub) -> None:
    from perfsim.commands.flags import add_plan_flags, whole_number

    p = sub.add_parser("scale", help="weak or strong scaling of a plan over node counts")
    p.add_argument("--model", help="preset, key=value spec or .toml (default: gpt3-175b, with the SMNG-P2 protocol)")
    p.add_argument("--system", help="profile name or .toml path (default: smng-p2)")
    p.add_argument("--nodes", default="16,32,64,128", help="comma-separated node counts, first is the base (default 16,32,64,128)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--weak", action="store_true", help="global batch grows with data parallelism")
    how.add_argument("--strong", action="store_true", help="global batch fixed")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32", "fp8"),
                   help="training precision (default bf16; fp8 on a profile with an FP8 peak)")
    add_plan_flags(p)
    p.add_argument("--json", action="store_true", help='one JSON object {"points": [...]}')
    p.add_argument("--uncertainty", action="store_true",
                   help="also P10/P50/P90 of each point's step time and efficiency over draws of the profile's "
                        "ranges, conditioned on its observations (the same draws at every node count)")
    p.add_argument("--samples", type=whole_number(16, 65536), help="draws for --uncertainty (default 512)")
    p.set_defaults(run=run, devices=None)


MAX_NODE_COUNTS = 64  # points of one scaling study: each is a whole prediction


def node_list(text: str, flag: str = "--nodes") -> list[int]:
    """Comma-separated node counts, the first the base: positive, at most MAX_NODE_COUNTS of them."""
    shown = text if len(text) <= 60 else text[:60] + "..."
    try:
        nodes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PerfsimError(f"{flag} must be comma-separated whole numbers, got {shown!r}") from None
    if not nodes or any(n < 1 for n in nodes):
        raise PerfsimError(f"{flag} must list positive node counts, got {shown!r}")
    if len(nodes) > MAX_NODE_COUNTS:
        raise PerfsimError(f"{flag} lists {len(nodes)} node counts; a scaling study takes at most {MAX_NODE_COUNTS}")
    return nodes


def run(args) -> None:
    from perfsim.commands.flags import build_case
    from perfsim.spec.case import BUILTIN_CASE
    from perfsim.scaling import scale
    from perfsim.spec.system import load_system

    nodes = node_list(args.nodes)
    args.nodes = nodes[0]
    if args.model is None and args.system is None:  # the protocol: the built-in case's plan and scaling rules
        per_node = load_system(BUILTIN_CASE["system"]).node.devices_per_node
        for key, value in BUILTIN_CASE["plan"].items():
            if key != "gbs" and getattr(args, key) is None:
                setattr(args, key, value)
        if args.gbs is None:
            dp = nodes[0] * per_node // (args.tp * (args.cp or 1) * args.pp)
            args.gbs = PROTOCOL_MICROBATCHES * args.mbs * dp if args.weak else PROTOCOL_STRONG_GBS
        args.model, args.system = BUILTIN_CASE["model"], BUILTIN_CASE["system"]
    model, system, base = build_case(args)
    if args.samples is not None and not args.uncertainty:
        raise PerfsimError("--samples counts the draws of --uncertainty; give --uncertainty too")
    points = scale(model, system, base, nodes, weak=args.weak, dtype=args.dtype)
    spread = _spread(args, model, system, points)
    if args.json:
        print(json.dumps({"mode": "weak" if args.weak else "strong", "model": model.name, "system": system.name,
                          "points": [p.as_json() | ({"uncertainty": u} if spread else {})
                                     for p, u in zip(points, spread or points)]}, indent=2))
        return
    kind = "weak" if args.weak else "strong"
    cp = f", CP {base.cp}" if base.cp > 1 else ""
    print(f"{kind} scaling of {model.name} on {system.name}: TP {base.tp} {base.tp_mode}{cp}, PP {base.pp}, "
          f"micro-batch {base.mbs}, ZeRO-{base.zero}, recompute {base.recompute}")
    terms = list(points[-1].loss_points)
    print(f"{'nodes':>6} {'devices':>8} {'batch':>6} {'step':>9} {'tokens/s':>11} {'eff':>7}   "
          + "  ".join(f"{k:>9}" for k in terms))
    for p in points:
        pr = p.prediction
        print(f"{p.nodes:>6} {pr.devices:>8} {pr.plan.gbs:>6} {pr.step_time_s:>8.2f}s {pr.tokens_per_s:>11,.0f} "
              f"{p.efficiency:>7.1%}   " + "  ".join(f"{p.loss_points[k]:>+8.1f}p" for k in terms))
    print("after eff: points of efficiency each term costs against the first point (they add up to 100 - eff)")
    if spread:
        what = "posterior conditioned on the profile's observations" if system.observations else "the profile's ranges"
        print(f"\nuncertainty (P10 .. P50 .. P90 over {spread[0]['samples']} draws of {what}, the same draws at every "
              "node count)")
        print(f"{'nodes':>6} {'step time':>28} {'efficiency':>24}")
        for p, u in zip(points, spread):
            t, e = u["step_time_s"], u["efficiency"]
            print(f"{p.nodes:>6} {t['p10']:>8.2f} .. {t['p50']:>6.2f} .. {t['p90']:>6.2f} s "
                  f"{e['p10']:>6.1%} .. {e['p50']:>6.1%} .. {e['p90']:>6.1%}")


def _spread(args, model, system, points):
    """Per point the step time and efficiency over the draws, when --uncertainty is given; what
    the observations cannot explain goes to stderr as a note."""
    if not args.uncertainty:
        return None
    import sys

    from perfsim.uncertainty.posterior import profile_draws
    from perfsim.uncertainty.sampling import DEFAULT_SAMPLES
    from perfsim.uncertainty.scaling import scaling_spreads

    draws, posterior = profile_draws(system, args.samples or DEFAULT_SAMPLES)
    if posterior is not None and posterior.unexplained:
        print(f"perfsim: note: {posterior.unexplained_text()}", file=sys.stderr)
    return scaling_spreads(model, draws, [(points, args.weak)], args.dtype)[0]
