"""`perfsim report ... --out FILE.html`: one self-contained page with every chart for one case:
the plan's breakdown and memory beside the search's best, throughput over tp x pp, what-if
sliders, scaling, the simulated timeline and, given a ledger, predictions against measurements."""

from __future__ import annotations

from perfsim.errors import PerfsimError


def register(sub) -> None:
    from perfsim.commands.chart import add_chart_flags

    p = sub.add_parser("report", help="one HTML page with every chart for a model, system and plan",
                       description="Write one self-contained HTML page (plotly.js embedded, opens offline) with the "
                                   "charts for a case: time breakdown and memory, throughput heatmap, what-if "
                                   "sliders, scaling, simulated timeline, and predicted against measured with --ledger.")
    add_chart_flags(p)
    p.set_defaults(run=run)


def sections(case, args, progress=None) -> list:
    """[(heading, figure or None, note)] for the page; a chart that cannot be drawn for this case
    keeps its heading and says why."""
    from perfsim.charts import breakdown, heatmap, memory, scaling, timeline, validation, whatif
    from perfsim.charts.plans import plan_set
    from perfsim.charts.space import PlanPool, sweep

    out = []

    def section(heading, build):
        if progress:
            progress(f"report: {heading}")
        try:
            out.append((heading, build(), ""))
        except PerfsimError as exc:
            out.append((heading, None, f"Not drawn for this case: {exc}"))

    m, s, plan = case.model, case.system, case.plan
    plans = []

    def compared():
        if not plans:
            plans.append(plan_set(m, s, plan, case.devices, case.gbs, args.top, case.fixes, case.dtype, args.pareto,
                                  result=case.found))
        return plans[0]

    section("Where the step time goes", lambda: breakdown.figure(m, s, *compared()))
    section("Memory per device", lambda: memory.figure(m, s, *compared()))

    pool, grid, swept = PlanPool(args.keep), heatmap.Grid(args.x, args.y), {}

    def shared_sweep():
        if not swept:
            swept["counts"] = sweep(m, s, case.devices, case.gbs, case.fixes, case.dtype, [pool, grid])
        if swept["counts"]["evaluated"] == 0:
            raise PerfsimError(f"no valid plan for {case.devices} devices and global batch {case.gbs}")
        return swept["counts"]

    def heat():
        shared_sweep()
        return heatmap.figure(m, s, case.devices, case.gbs, grid=grid)

    def what_if():
        counts = shared_sweep()
        data = whatif.precompute(m, s, case.devices, case.gbs, case.fixes, case.dtype, args.keep,
                                 pooled=(pool.groups(), counts))
        return whatif.figure(m, s, case.devices, case.gbs, data=data)

    section(f"Best throughput by {args.x} and {args.y}", heat)
    section("What if the hardware were different", what_if)
    modes = ("weak", "strong") if args.mode == "both" else (args.mode,)
    section("Scaling with more nodes", lambda: scaling.figure(m, s, plan, case.node_counts(args), modes,
                                                               case.strong_gbs(args), case.dtype))
    section("One simulated training step", lambda: timeline.figure(m, s, plan, case.dtype, args.sim_schedule))
    if args.ledger:
        section("Predictions against measurements",
                lambda: validation.figure(args.ledger, s if args.system is not None else None, args.statistic,
                                          args.clock))
    else:
        out.append(("Predictions against measurements", None,
                    "No ledger given: pass --ledger FILE.jsonl (written by perfsim calibrate) to compare perfsim's "
                    "predictions with measured times."))
    return out


def run(args) -> None:
    from perfsim.charts.page import write_page
    from perfsim.commands.chart import Case, check_out
    from perfsim.predict import predict
    from perfsim.search import stderr_progress

    check_out(args.out)
    case = Case(args, announce=stderr_progress)
    p = predict(case.model, case.system, case.plan, case.dtype)  # an invalid plan stops here, with its reasons
    from perfsim.charts._common import GIB, case_line, plan_label

    lead = (f"{case_line(case.model, case.system, case.devices, case.gbs)}; plan"
            + (f" ({case.chosen})" if case.chosen else "") + f": {plan_label(case.plan, short=False)}. "
            f"Predicted: {p.step_time_s:.2f} s per step, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}, peak memory "
            f"{p.memory_bytes['total'] / GIB:.1f} of {p.device_memory_bytes / GIB:.1f} GiB per device"
            + ("" if p.fits else " (does not fit)") + ". Every chart is interactive: hover for details, drag to zoom, "
            "double-click to reset.")
    parts = sections(case, args, progress=stderr_progress)
    size = write_page(args.out, parts, f"perfsim report: {case.model.name} on {case.system.name}", lead)
    drawn = sum(1 for _, fig, _ in parts if fig is not None)
    print(f"wrote the report ({drawn} of {len(parts)} charts drawn) to {args.out} ({size / 1e6:.1f} MB, opens offline)")
