"""`perfsim sensitivity`: which profile numbers move one plan's step time most
(perfsim/uncertainty/sensitivity.py)."""

from __future__ import annotations

import json


def register(sub) -> None:
    from perfsim.cli import _add_case_flags, _add_plan_flags, whole_number

    p = sub.add_parser("sensitivity", help="which profile numbers move a plan's step time most (variance shares)")
    _add_case_flags(p)
    _add_plan_flags(p)
    p.add_argument("--samples", type=whole_number(64, 65536), help="prior draws (default 256)")
    p.add_argument("--top", type=whole_number(1, 1000), default=10, help="how many numbers to show (default 10)")
    p.add_argument("--json", action="store_true", help='one JSON object {"samples", "numbers": [...]}')
    p.set_defaults(run=run)


def run(args) -> None:
    from perfsim.cli import build_case
    from perfsim.uncertainty.sensitivity import DEFAULT_SAMPLES, sensitivity

    model, system, plan = build_case(args)
    samples = args.samples or DEFAULT_SAMPLES
    rows = sensitivity(model, system, plan, samples, args.dtype)[:args.top]
    if args.json:
        print(json.dumps({"samples": samples, "numbers": [
            {"number": key, "variance_share": share, "p10": lo, "p90": hi} for key, share, lo, hi in rows]}, indent=2))
        return
    lines = [f"{model.name} on {plan.devices} devices ({system.name}): share of the step time's variance each "
             f"number explains alone, over {samples} prior draws", "",
             f"{'share':>6}  {'P10 .. P90 of the number':>26}  number"]
    for key, share, lo, hi in rows:
        lines.append(f"{share:>6.0%}  {lo:>11.4g} .. {hi:<11.4g}  {key}")
    print("\n".join(lines))
