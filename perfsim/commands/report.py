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
        """`build` returns a figure, or (figure, note)."""
        if progress:
            progress(f"report: {heading}")
        try:
            built = build()
            out.append((heading, *(built if isinstance(built, tuple) else (built, ""))))
        except PerfsimError as exc:
            out.append((heading, None, f"Not drawn for this case: {exc}"))

    m, s, plan = case.model, case.system, case.plan
    plans, found = [], []

    def searched():
        """The search the comparisons and P(best) share: at least robust.CANDIDATES plans with the uncertainty."""
        if not found:
            from perfsim.search import search

            found.append(case.found or search(m, s, case.devices, case.gbs, case.fixes, top=case.candidates,
                                              dtype=case.dtype))
        return found[0]

    def compared():
        if not plans:
            try:
                result = searched() if case.uncertainty else case.found
            except PerfsimError:
                result = None  # plan_set says why beside your plan
            plans.append(plan_set(m, s, plan, case.devices, case.gbs, args.top, case.fixes, case.dtype, args.pareto,
                                  result=result))
        return plans[0]

    def how_sure():
        from perfsim.charts import robustness
        from perfsim.predict import predict
        from perfsim.uncertainty.robust import verdict

        spreads, posterior, note = robustness.plan_spreads(m, s, [plan], case.spread_samples(), case.dtype)
        samples = case.robust_samples()
        best = searched().plans
        ranked, _ = robustness.ranked_plans(m, s, best + [predict(m, s, plan, case.dtype)], samples, case.dtype)
        among = f"the search's best {len(best)} plans" + (" and yours" if len(ranked) > len(best) else "")
        fig = robustness.figure(m, s, ranked, samples, show=max(args.top, 5), yours=robustness.find(ranked, plan))
        return fig, robustness.section_notes(s, plan, spreads[0], posterior, ranked, among, verdict(ranked), note, samples)

    section("Where the step time goes",
            lambda: breakdown.figure(m, s, *compared(), samples=case.spread_samples()))
    section("Memory per device", lambda: memory.figure(m, s, *compared()))
    if case.uncertainty:
        section("How sure is this prediction", how_sure)
    else:
        out.append(("How sure is this prediction", None,
                    "Left out (--no-uncertainty): without it the report shows your plan's spread over the profile's "
                    "ranges, the observations they are conditioned on, and P(best) of the best plans."))

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
        return whatif.figure(m, s, case.devices, case.gbs, dtype=case.dtype, data=data, samples=case.spread_samples(),
                             robust_samples=case.robust_samples())

    section(f"Best throughput by {args.x} and {args.y}", heat)
    section("What if the hardware were different", what_if)
    modes = ("weak", "strong") if args.mode == "both" else (args.mode,)
    section("Scaling with more nodes", lambda: scaling.figure(m, s, plan, case.node_counts(args), modes,
                                                               case.strong_gbs(args), case.dtype, case.spread_samples()))
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
    case = Case(args, announce=stderr_progress, uncertainty_default=True)
    p = predict(case.model, case.system, case.plan, case.dtype)  # an invalid plan stops here, with its reasons
    from perfsim.charts._common import GIB, case_line
    from perfsim.spec.plan import plan_summary

    lead = (f"{case_line(case.model, case.system, case.devices, case.gbs)}; plan"
            + (f" ({case.chosen})" if case.chosen else "") + f": {plan_summary(case.plan, long=True)}. "
            f"Predicted: {p.step_time_s:.2f} s per step, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}, peak memory "
            f"{p.memory_bytes['total'] / GIB:.1f} of {p.device_memory_bytes / GIB:.1f} GiB per device"
            + ("" if p.fits else " (does not fit)") + ". Every chart is interactive: hover for details, drag to zoom, "
            "double-click to reset.")
    parts = sections(case, args, progress=stderr_progress)
    size = write_page(args.out, parts, f"perfsim report: {case.model.name} on {case.system.name}", lead)
    drawn = sum(1 for _, fig, _ in parts if fig is not None)
    print(f"wrote the report ({drawn} of {len(parts)} charts drawn) to {args.out} ({size / 1e6:.1f} MB, opens offline)")
