"""`perfsim predict`: one plan's step time, throughput and memory (perfsim/predict.py), by the
closed form or the event simulation, with P10/P50/P90 over the profile's ranges on request."""

from __future__ import annotations

import json

from perfsim.commands.flags import add_case_flags, add_plan_flags, build_case, whole_number
from perfsim.errors import PerfsimError


def register(sub) -> None:
    p = sub.add_parser("predict", help="predict one plan's step time, throughput and memory")
    add_case_flags(p)
    add_plan_flags(p)
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
    p.set_defaults(run=run)


def run(args) -> None:
    model, system, plan = build_case(args)
    if args.engine == "sim":
        from perfsim.schedule.simulator import predict_simulated

        result = predict_simulated(model, system, plan, dtype=args.dtype)
    else:
        from perfsim.predict import predict

        result = predict(model, system, plan, dtype=args.dtype)
    uncertainty = _uncertainty(args, model, system, plan)  # (JSON object, text) or None
    if args.json:
        extra = {"uncertainty": uncertainty[0]} if uncertainty else {}
        print(json.dumps(result.as_json() | {"engine": args.engine} | extra, indent=2))
    else:
        from perfsim.report import format_prediction

        print(format_prediction(result) + (f"\n\n{uncertainty[1]}" if uncertainty else ""))


def _uncertainty(args, model, system, plan):
    """(the JSON object, the text) when --uncertainty is given, else None; what the observations
    cannot explain goes to stderr as a note."""
    import sys

    if not args.uncertainty:
        if args.samples is not None or args.observe:
            raise PerfsimError("--samples and --observe shape the draws of --uncertainty; give --uncertainty too")
        return None
    if args.engine != "analytic":
        raise PerfsimError("--uncertainty prices its draws with the closed form; leave out --engine sim")
    from perfsim.uncertainty.predict import predict_uncertainty, uncertainty_lines
    from perfsim.uncertainty.sampling import DEFAULT_SAMPLES

    observe = tuple(args.observe or ())
    summary, note = predict_uncertainty(model, system, plan, args.samples or DEFAULT_SAMPLES, args.dtype,
                                        observe=observe)
    if note:
        print(f"perfsim: note: {note}", file=sys.stderr)
    return summary, uncertainty_lines(summary, bool(system.observations), observe)
