"""`perfsim search`: the best plans for a model on a machine (perfsim/search.py)."""

from __future__ import annotations

import json

from perfsim.errors import PerfsimError


def register(sub) -> None:
    from perfsim.commands.flags import finite_number, positive, whole_number

    p = sub.add_parser("search", help="find the best parallel plans for a model, system and device count")
    p.add_argument("--model", required=True, help="preset name, key=value spec, or .toml file")
    p.add_argument("--system", required=True, help="profile name in hwprofiles/ or a .toml path")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--nodes", type=positive)
    where.add_argument("--devices", type=positive)
    p.add_argument("--gbs", type=positive, required=True, help="global batch size (sequences)")
    p.add_argument("--top", type=positive, default=10, help="how many plans to show (default 10)")
    p.add_argument("--fix", action="append", default=[], metavar="KNOB=VALUE",
                   help="restrict a knob (plan field names): tp_mode=1d, zero=1, pp=8,16, mbs=1..4, sp=true; repeatable; "
                        "a range may be of any size; a space of more than 10 million plans is refused")
    p.add_argument("--rank", default="throughput", choices=("throughput", "time-to-train", "device-hours", "memory-headroom"),
                   help="order of the results; for a fixed device count the first three agree (default throughput)")
    p.add_argument("--tokens", type=finite_number(0, 1e18), default=300e9,
                   help="training tokens for the time-to-train and device-hours columns, up to 1e18 (default 300e9)")
    p.add_argument("--dtype", default=("bf16",), type=_dtypes,
                   help="training precision, or several comma-separated to rank their plans together (default bf16; "
                        "fp8 on a profile with an FP8 peak; any: bf16, and fp8 where the profile has an FP8 peak)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="one JSON object: evaluated, feasible, rejected, plans, pareto")
    out.add_argument("--csv", action="store_true", help="the top plans as CSV")
    p.add_argument("--moe-balanced", dest="moe_balanced", action="store_true",
                   help="routing forced to balance every expert's tokens (as MoE benchmarks run): moe.imbalance 1")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--robust", action="store_true",
                   help="rank every plan of the space over draws of the profile's ranges (its posterior where it "
                        "names observations): P(best) and P(within 5%%) per plan; a bound spares pricing the plans "
                        "that are never within 5%% of the best (docs/validation.md)")
    p.add_argument("--samples", type=whole_number(16, 4096), help="draws for --robust (default 256)")
    p.set_defaults(run=run)


def _dtypes(text: str) -> tuple:
    import argparse

    allowed = ("bf16", "fp16", "fp32", "fp8", "any")
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in items if x not in allowed]
    if not items or bad:
        raise argparse.ArgumentTypeError(f"expected one or more of {', '.join(allowed)}, comma-separated; got {text!r}")
    return items


def run(args) -> None:
    from perfsim.search import parse_fixes, precisions, search_precisions, stderr_progress
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import device_count_problem
    from perfsim.spec.system import load_system

    model, system = load_model(args.model), load_system(args.system)
    if args.moe_balanced:  # docs/equations.md 12.4
        from perfsim.spec.system import forced_balance

        system = forced_balance(system)
    devices = args.devices if args.devices is not None else args.nodes * system.node.devices_per_node
    too_many = device_count_problem(devices)
    if too_many:  # before enumerating the plans
        raise PerfsimError(too_many)
    if args.samples is not None and not args.robust:
        raise PerfsimError("--samples counts the draws of --robust; give --robust too")
    if args.robust and args.rank != "throughput":
        raise PerfsimError("--robust ranks by step time over the draws; leave out --rank")
    dtypes = precisions(system, args.dtype)
    if args.robust and len(dtypes) > 1:
        raise PerfsimError("--robust ranks plans of one training precision; give one --dtype")
    args.dtype = dtypes[0] if len(dtypes) == 1 else ",".join(dtypes)
    progress = None if args.quiet else stderr_progress
    if args.robust:
        from perfsim.uncertainty.robust import ROBUST_SAMPLES, print_robust, robust_search

        found = robust_search(model, system, devices, args.gbs, parse_fixes(args.fix), args.samples or ROBUST_SAMPLES,
                              args.dtype, top=args.top, progress=progress)
        print_robust(found, model, system, devices, args)
        return
    result = search_precisions(model, system, devices, args.gbs, dtypes, parse_fixes(args.fix), top=args.top,
                               rank=args.rank, progress=progress)
    if args.json:
        print(json.dumps({"evaluated": result.evaluated, "feasible": result.feasible, "candidates": result.candidates,
                          "seconds": result.seconds, "rejected": result.rejected,
                          "plans": [p.as_json() for p in result.plans],
                          "pareto": [p.as_json() for p in result.pareto]}, indent=2))
    elif args.csv:
        print(_csv(result.plans, args.tokens))
    else:
        print(_table(result, model, system, devices, args))


def _table(result, model, system, devices, args) -> str:
    from perfsim.spec.plan import plan_summary

    lines = [f"{model.name} on {devices} x {system.device.name} ({system.name}), global batch {args.gbs}",
             f"{result.candidates:,} candidates, {result.evaluated:,} valid plans evaluated in {result.seconds:.2f} s "
             f"({result.evaluated / max(result.seconds, 1e-9):,.0f} plans/s), {result.feasible:,} fit in memory",
             "rejected: " + "; ".join(f"{r} {n:,}" for r, n in sorted(result.rejected.items(), key=lambda kv: -kv[1])),
             "", f"{'#':>3} {'tokens/s':>12} {'step':>9} {'MFU':>6} {'memory':>9}  plan"]
    for i, p in enumerate(result.plans, 1):
        lines.append(f"{i:>3} {p.tokens_per_s:>12,.0f} {p.step_time_s:>8.2f}s {p.mfu:>6.1%} "
                     f"{p.memory_bytes['total'] / 2**30:>6.1f} GiB  {plan_summary(p.plan, dtype=p.dtype)}")
    lines += ["", "Pareto front (no plan is both faster and smaller):"]
    for p in result.pareto:
        lines.append(f"    {p.tokens_per_s:>12,.0f} tokens/s at {p.memory_bytes['total'] / 2**30:6.1f} GiB  "
                     f"{plan_summary(p.plan, dtype=p.dtype)}")
    return "\n".join(lines)


def _csv(plans, tokens: float) -> str:
    import csv
    import io

    out = io.StringIO()
    fields = ["rank", "tokens_per_s", "step_time_s", "mfu", "memory_gib", "days_to_train", "device_hours"] + \
        list(plans[0].plan.as_dict()) if plans else []
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(fields)
    for i, p in enumerate(plans, 1):
        seconds = tokens / p.tokens_per_s
        writer.writerow([i, f"{p.tokens_per_s:.1f}", f"{p.step_time_s:.4f}", f"{p.mfu:.4f}",
                         f"{p.memory_bytes['total'] / 2**30:.2f}", f"{seconds / 86400:.2f}",
                         f"{seconds / 3600 * p.devices:.0f}"] + list(p.plan.as_dict().values()))
    return out.getvalue().rstrip("\n")
