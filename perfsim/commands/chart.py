"""`perfsim chart KIND ... --out FILE.html`: one interactive chart as a self-contained HTML page
(perfsim/charts/). The flags name the case as `perfsim predict` does; each kind uses those it needs."""

from __future__ import annotations

from perfsim.errors import PerfsimError

KINDS = ("whatif", "heatmap", "scaling", "memory", "breakdown", "timeline", "validation")
HEATMAP_KNOBS = ("tp", "pp", "dp", "mbs", "vpp", "zero", "recompute", "schedule", "tp_mode", "sp", "tp_depth", "order",
                 "cp")


def add_chart_flags(p) -> None:
    """The case (as predict takes it) and every chart's own options; shared with `perfsim report`."""
    import argparse

    from perfsim.commands.flags import add_case_flags, add_plan_flags, positive, whole_number

    add_case_flags(p)
    add_plan_flags(p, left_out="the built-in case's plan if no model, system or device count is given; else, "
                    "unless --tp and --pp are given, the best plan perfsim search finds, the plan flags given kept")
    p.add_argument("--out", required=True, metavar="FILE.html", help="the HTML page to write (self-contained)")
    g = p.add_argument_group("chart options")
    g.add_argument("--fix", action="append", default=[], metavar="KNOB=VALUE",
                   help="restrict the searched plans (whatif, heatmap, memory, breakdown), as `perfsim search --fix`")
    g.add_argument("--top", type=int, default=5,
                   help="memory, breakdown: also show the search's N best plans (default 5; 0: only your plan)")
    g.add_argument("--pareto", action="store_true",
                   help="memory, breakdown: show the search's throughput-memory Pareto front instead of the best")
    g.add_argument("--keep", type=positive, default=1000,
                   help="whatif: plans kept from the search and re-evaluated per setting (default 1000)")
    g.add_argument("--x", default="tp", choices=HEATMAP_KNOBS, help="heatmap: knob across (default tp)")
    g.add_argument("--y", default="pp", choices=HEATMAP_KNOBS, help="heatmap: knob up (default pp)")
    g.add_argument("--node-counts", dest="node_counts", metavar="N1,N2,...",
                   help="scaling: node counts, the first is the base (default: the case's nodes x 1, 2, 4, 8; "
                        "for the built-in case the SMNG-P2 protocol, 16,32,64,128)")
    g.add_argument("--mode", default="both", choices=("weak", "strong", "both"), help="scaling: which (default both)")
    g.add_argument("--strong-gbs", dest="strong_gbs", type=positive,
                   help="scaling: global batch of strong scaling (default: the plan's; built-in case: 2520)")
    g.add_argument("--sim-schedule", dest="sim_schedule", choices=("gpipe", "1f1b", "interleaved", "zb-h1"),
                   help="timeline: simulate this schedule instead of the plan's (zb-h1: zero-bubble H1)")
    g.add_argument("--uncertainty", action=argparse.BooleanOptionalAction, default=None,
                   help="scaling: P10-P90 bands; breakdown: P10-P90 error bars; whatif: the best plan's spread and "
                        "P(best); over draws of the profile's ranges conditioned on its observations. perfsim report "
                        "shows them, and a section on them, unless --no-uncertainty; perfsim chart only with "
                        "--uncertainty")
    g.add_argument("--samples", type=whole_number(16, 4096),
                   help="draws for the uncertainty (default: 512 for spreads, as perfsim predict --uncertainty; "
                        "256 for P(best), as perfsim search --robust)")
    g.add_argument("--ledger", metavar="FILE.jsonl",
                   help="validation: a measurement ledger written by perfsim calibrate / validate/")
    g.add_argument("--statistic", default="expected", choices=("expected", "min", "median", "p25", "mean"),
                   help="validation: the statistic of each point's repetitions (default expected, as calibrate "
                        "fits: the mean, which the profile prices every call at)")
    g.add_argument("--clock", default="auto", choices=("auto", "wall"),
                   help="validation: auto (a rank's CPU time where recorded, as calibrate fits) or wall")


def register(sub) -> None:
    p = sub.add_parser("chart", help="one interactive chart as a self-contained HTML page",
                       description="Write one chart as an HTML page with plotly.js embedded (opens offline). Kinds: "
                                   "whatif (hardware multipliers, sliders), heatmap (best throughput over two knobs), "
                                   "scaling (weak/strong efficiency), memory and breakdown (per plan), timeline "
                                   "(simulated step), validation (ledger: predicted against measured).")
    p.add_argument("kind", choices=KINDS, help="which chart")
    add_chart_flags(p)
    p.set_defaults(run=run)


class Case:
    """The parsed flags resolved once: model, system, devices, global batch, fixes and the plan.
    The plan is the plan flags' (as `perfsim predict` reads them) for the built-in case or when
    --tp and --pp are given; otherwise the best plan `perfsim search` finds, the plan flags given
    kept as fixes. It is searched when first asked for (whatif, heatmap, validation never ask),
    and `announce` hears which plan was chosen."""

    def __init__(self, args, announce=None, uncertainty_default: bool = False):
        from perfsim.commands.flags import build_case, device_count, is_builtin, load_case, plan_flags_given
        from perfsim.spec.case import derived_dp
        from perfsim.search import parse_fixes

        if args.top < 0:
            raise PerfsimError(f"--top must be 0 or more, got {args.top}")
        self.uncertainty = uncertainty_default if args.uncertainty is None else args.uncertainty
        if args.samples is not None and not self.uncertainty:
            raise PerfsimError("--samples counts the draws of the uncertainty; leave out --no-uncertainty"
                               if uncertainty_default else "--samples counts the draws of --uncertainty; give --uncertainty too")
        self.samples = args.samples  # None: each use's own default
        self.builtin = is_builtin(args)
        self.fixes = parse_fixes(args.fix)
        self.dtype = args.dtype
        self.given = plan_flags_given(args)
        self.searched = not self.builtin and not {"tp", "pp"} <= set(self.given)
        self.chosen = ""  # how the plan was chosen, when searched
        self.found = None  # that search's result, when its fixes are the page's (no plan flag given)
        # with the uncertainty, the search the plan comes from also gives the report's P(best) candidates
        from perfsim.uncertainty.robust import CANDIDATES

        self.candidates = max(args.top, CANDIDATES if self.uncertainty else 1)  # plans the search keeps
        self._announce, self._fix_items = announce, list(args.fix)
        if self.searched:
            self.model, self.system = load_case(args)
            self.devices = device_count(args, self.system, self.given)
            dp = self.given.get("dp") or derived_dp(self.devices, self.given.get("tp", 1), self.given.get("pp", 1),
                                                    self.given.get("cp", 1))
            self.gbs = self.given.get("gbs", self.given.get("mbs", 1) * dp)
            self._plan = None
        else:
            self.model, self.system, self._plan = build_case(args)
            self.devices, self.gbs = self._plan.devices, self._plan.gbs

    def spread_samples(self) -> int | None:
        """Draws for the spreads (bands, error bars), as perfsim predict --uncertainty takes them;
        None without the uncertainty."""
        from perfsim.uncertainty.sampling import DEFAULT_SAMPLES

        return (self.samples or DEFAULT_SAMPLES) if self.uncertainty else None

    def robust_samples(self) -> int | None:
        """Draws for P(best), as perfsim search --robust takes them; None without the uncertainty."""
        from perfsim.uncertainty.robust import ROBUST_SAMPLES

        return (self.samples or ROBUST_SAMPLES) if self.uncertainty else None

    @property
    def plan(self):
        if self._plan is None:
            self._plan = self._best_plan()
        return self._plan

    def _best_plan(self):
        """The search's best plan with the given plan flags as fixes (those that are no search
        knob, like --tp-axes, set on the plan found); `chosen` says so."""
        from perfsim.spec.plan import plan_summary
        from perfsim.search import BOOL_KNOBS, INT_KNOBS, TEXT_KNOBS, parse_fixes, search
        from perfsim.spec.plan import TP_AXES

        knobs = {k: v for k, v in self.given.items() if k in INT_KNOBS + BOOL_KNOBS + tuple(TEXT_KNOBS)}
        applied = {k: v for k, v in self.given.items() if k not in knobs and k != "gbs"}
        axes = sorted(applied.get("tp_axes", "").split("-"))
        fixes = [f"{k}={v}" for k, v in knobs.items()]
        fixes += [f"tp_mode={m}" for m, names in TP_AXES.items() if sorted(names) == axes and "tp_mode" not in knobs]
        result = search(self.model, self.system, self.devices, self.gbs, parse_fixes(self._fix_items + fixes),
                        top=self.candidates, dtype=self.dtype)
        plan = result.plans[0].plan.replace(**applied)
        if not knobs and not applied:
            self.found = result
        flags = ", ".join(_as_flag(k, v) for k, v in self.given.items() if k != "gbs")
        self.chosen = (f"{'no plan flags given' if not flags else 'plan flags left out'}: using the best plan "
                       f"perfsim search finds{f' with {flags}' if flags else ''}")
        if self._announce:
            self._announce(f"{self.chosen}: {plan_summary(plan)}")
        return plan

    def node_counts(self, args) -> list:
        if args.node_counts:
            from perfsim.commands.scale import node_list

            return node_list(args.node_counts, "--node-counts")
        if self.builtin:
            from perfsim.reproduce import SMNG_SCALING_NODES

            return list(SMNG_SCALING_NODES)
        per_node = self.system.node.devices_per_node
        if self.devices % per_node:
            raise PerfsimError(f"{self.devices} devices is not a whole number of {per_node}-device nodes; "
                               "give --node-counts for the scaling chart")
        first = self.devices // per_node
        return [first * k for k in (1, 2, 4, 8)]

    def strong_gbs(self, args) -> int:
        if args.strong_gbs:
            return args.strong_gbs
        if self.builtin:
            from perfsim.reproduce import SMNG_STRONG_GBS

            return SMNG_STRONG_GBS
        return self.gbs


def _as_flag(field: str, value) -> str:
    """A plan flag as it is typed: --tp 8, --sp, --no-dp-overlap."""
    name = field.replace("_", "-")
    return f"--{name}" if value is True else f"--no-{name}" if value is False else f"--{name} {value}"


def figure_for(kind: str, case: Case, args):
    """The plotly Figure of one chart kind for the case."""
    if kind == "whatif":
        from perfsim.charts import whatif

        return whatif.figure(case.model, case.system, case.devices, case.gbs, case.fixes, case.dtype, keep=args.keep,
                             samples=case.spread_samples(), robust_samples=case.robust_samples())
    if kind == "heatmap":
        from perfsim.charts import heatmap

        return heatmap.figure(case.model, case.system, case.devices, case.gbs, args.x, args.y, case.fixes, case.dtype)
    if kind == "scaling":
        from perfsim.charts import scaling

        modes = ("weak", "strong") if args.mode == "both" else (args.mode,)
        nodes, strong_gbs = case.node_counts(args), case.strong_gbs(args)  # bad flags fail before the search
        return scaling.figure(case.model, case.system, case.plan, nodes, modes, strong_gbs, case.dtype,
                              case.spread_samples())
    if kind in ("memory", "breakdown"):
        from perfsim.charts import breakdown, memory
        from perfsim.charts.plans import plan_set

        plans, note = plan_set(case.model, case.system, case.plan, case.devices, case.gbs, args.top, case.fixes,
                               case.dtype, args.pareto, result=case.found)
        if kind == "breakdown":
            return breakdown.figure(case.model, case.system, plans, note, case.spread_samples())
        return memory.figure(case.model, case.system, plans, note)
    if kind == "timeline":
        from perfsim.charts import timeline

        return timeline.figure(case.model, case.system, case.plan, case.dtype, args.sim_schedule)
    if kind == "validation":
        from perfsim.charts import validation

        if not args.ledger:
            raise PerfsimError("the validation chart needs --ledger FILE.jsonl (a ledger written by perfsim calibrate)")
        system = case.system if args.system is not None else None
        return validation.figure(args.ledger, system, args.statistic, args.clock)
    raise PerfsimError(f"unknown chart kind {kind!r}; kinds: {', '.join(KINDS)}")


def check_out(path: str) -> None:
    """Fail before the work when --out cannot be written (perfsim.files: a regular file only)."""
    from perfsim.files import check_output

    if not path.lower().endswith((".html", ".htm")):
        raise PerfsimError(f"--out {path}: give an .html file name")
    check_output(path, "--out", "chart.html")


def run(args) -> None:
    from perfsim.charts.page import write_figure
    from perfsim.search import stderr_progress

    check_out(args.out)
    if args.kind == "validation" and not args.ledger:
        raise PerfsimError("the validation chart needs --ledger FILE.jsonl (a ledger written by perfsim calibrate)")
    case = Case(args, announce=stderr_progress)
    fig = figure_for(args.kind, case, args)
    size = write_figure(args.out, fig)
    print(f"wrote the {args.kind} chart to {args.out} ({size / 1e6:.1f} MB, opens offline in a browser)")
