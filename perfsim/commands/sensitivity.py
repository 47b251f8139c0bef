"""`perfsim sensitivity`: which profile numbers move one plan's step time most
(perfsim/uncertainty/sensitivity.py)."""

from __future__ import annotations

import json


def register(sub) -> None:
    from perfsim.commands.flags import add_case_flags, add_plan_flags, whole_number

    p = sub.add_parser("sensitivity", help="which profile numbers move a plan's step time most (variance shares)")
    add_case_flags(p)
    add_plan_flags(p)
    p.add_argument("--samples", type=whole_number(64, 65536), help="prior draws (default 256)")
    p.add_argument("--top", type=whole_number(1, 1000), default=10, help="how many numbers to show (default 10)")
    p.add_argument("--json", action="store_true", help='one JSON object {"samples", "numbers": [...]}')
    c = p.add_argument_group("plan choice (docs/validation.md, \"What decides the plan\")")
    c.add_argument("--plan-choice", dest="plan_choice", action="store_true",
                   help="which numbers decide which plan is fastest: the point search's best plans for the case's "
                        "device count and global batch, and the case's plan, compared over the draws")
    c.add_argument("--candidates", type=whole_number(2, 100),
                   help="the point search's best plans to compare, 2 to 100 (default 10)")
    c.add_argument("--fix", action="append", default=[], metavar="KNOB=VALUE",
                   help="restrict the plans searched, as `perfsim search --fix` does; repeatable")
    p.set_defaults(run=run)


def run(args) -> None:
    from perfsim.commands.flags import build_case
    from perfsim.errors import PerfsimError
    from perfsim.uncertainty.sensitivity import DEFAULT_SAMPLES, sensitivity

    if not args.plan_choice and (args.candidates is not None or args.fix):
        raise PerfsimError("--candidates and --fix choose the plans --plan-choice compares; give --plan-choice too")
    model, system, plan = build_case(args)
    if args.plan_choice:
        return _run_plan_choice(args, model, system, plan)
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


def _candidates(args, model, system, plan) -> tuple:
    """(Predictions, how many the search found): the point search's best plans for the case's
    devices and global batch, then the case's own plan where the search did not find it."""
    from perfsim.predict import predict
    from perfsim.search import parse_fixes, search
    from perfsim.uncertainty.plan_choice import DEFAULT_CANDIDATES

    found = search(model, system, plan.devices, plan.gbs, parse_fixes(args.fix), top=args.candidates or DEFAULT_CANDIDATES,
                   dtype=args.dtype).plans
    if all(p.plan != plan for p in found):
        return found + [predict(model, system, plan, args.dtype)], len(found)
    return found, len(found)


MAX_PLAN_CHOICE_SAMPLES = 4096


def _run_plan_choice(args, model, system, plan) -> None:
    from perfsim.spec.plan import plan_summary
    from perfsim.errors import PerfsimError
    from perfsim.uncertainty.plan_choice import DEFAULT_SAMPLES, plan_choice

    if (args.samples or 0) > MAX_PLAN_CHOICE_SAMPLES:  # each draw prices every candidate with its own links
        raise PerfsimError(f"--plan-choice prices every candidate under every draw: --samples up to "
                           f"{MAX_PLAN_CHOICE_SAMPLES} (about a minute per 1,000 draws of ten plans)")
    candidates, searched = _candidates(args, model, system, plan)
    choice = plan_choice(model, system, [p.plan for p in candidates], args.samples or DEFAULT_SAMPLES, args.dtype)
    given = next(i for i, p in enumerate(candidates) if p.plan == plan) if any(p.plan == plan for p in candidates) else None
    numbers = choice.numbers[:args.top]
    if args.json:
        print(json.dumps({
            "samples": choice.samples, "chosen": choice.chosen, "expected_regret": choice.loss,
            "candidates": [p.as_json() | {"p_best": float(choice.p_best[i]), "mean_regret": float(choice.mean_regret[i]),
                                          "given": i == given} for i, p in enumerate(candidates)],
            "numbers": [{"number": n.key, "plan_choice_share": n.choice_share, "variance_share": n.step_share,
                         "p10": n.p10, "p90": n.p90, "best_plan_low": n.best_low, "best_plan_high": n.best_high}
                        for n in numbers]}, indent=2))
        return
    lines = [f"{model.name} on {plan.devices} devices ({system.name}), global batch {plan.gbs}: which numbers decide "
             f"between the point search's best {searched} plans"
             + (" and the given plan" if searched < len(candidates) else "") + f", over {choice.samples} prior draws",
             "", f"{'#':>3} {'P(best)':>8} {'regret':>7}  plan (regret: mean step time over each draw's best, less 1)"]
    for i, p in enumerate(candidates):
        lines.append(f"{i + 1:>3} {choice.p_best[i]:>8.0%} {choice.mean_regret[i]:>7.1%}  {plan_summary(p.plan, dtype=p.dtype)}"
                     + ("  <- the given plan" if i == given else ""))
    best = choice.chosen + 1
    lines += ["", f"Choosing now, plan {best} (smallest mean regret) runs {choice.loss:.1%} slower on average than each "
                  "draw's best plan."]
    if choice.loss <= 0:
        lines.append(f"Plan {best} is the fastest in every draw: no measurement of these numbers changes the choice.")
        print("\n".join(lines))
        return
    lines += ["'decides': the share of that loss that knowing the number exactly would remove; 'moves': its share of "
              f"plan {best}'s step-time variance; 'best low/high': the plan to run where the number is low / high.", "",
              f"{'decides':>7} {'moves':>6}  {'P10 .. P90 of the number':>26}  {'best low/high':>13}  number"]
    for n in numbers:
        lines.append(f"{n.choice_share:>7.0%} {n.step_share:>6.0%}  {n.p10:>11.4g} .. {n.p90:<11.4g}  "
                     f"{f'{n.best_low + 1} / {n.best_high + 1}':>13}  {n.key}")
    top = choice.numbers[0]
    lines += ["", f"Measuring {top.key} would settle {top.choice_share:.0%} of the doubt about which plan to run."]
    print("\n".join(lines))
