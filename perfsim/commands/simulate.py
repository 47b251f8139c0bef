"""`perfsim simulate`: one training step as an event simulation, with its timeline
(perfsim/schedule/simulator.py, docs/simulator.md)."""

from __future__ import annotations

import json

from perfsim.errors import PerfsimError

ZERO_BUBBLE = "zb-h1"


def register(sub) -> None:
    from perfsim.commands.flags import add_case_flags, add_plan_flags

    p = sub.add_parser("simulate", help="simulate one step event by event: timeline, critical path, idle time")
    add_case_flags(p)
    add_plan_flags(p)
    for action in p._actions:  # the simulator also runs the zero-bubble schedule ZB-H1
        if action.dest == "schedule":
            action.choices = (*action.choices, ZERO_BUBBLE)
            action.help = f"pipeline schedule; {ZERO_BUBBLE} (zero bubble, Qi et al. 2024) only in perfsim simulate"
    p.add_argument("--html", metavar="FILE", help="write the timeline as a self-contained Plotly HTML file")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace JSON (open it in ui.perfetto.dev)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: predict --json's keys with the simulated step, and `simulation`")
    p.set_defaults(run=run)


def run(args) -> None:
    from perfsim.commands.flags import build_case
    from perfsim.schedule.simulator import ZERO_BUBBLE_ONE_CHUNK, simulate

    from perfsim.files import check_output

    for flag, path, example in (("--trace", args.trace, "step.json"), ("--html", args.html, "step.html")):
        if path is not None:  # before the work: a regular file in an existing folder
            check_output(path, flag, example)
    schedule = None
    if args.schedule == ZERO_BUBBLE:
        if args.vpp is not None and args.vpp > 1:  # before the plan is built: the flags contradict each other
            raise PerfsimError(ZERO_BUBBLE_ONE_CHUNK)
        schedule, args.schedule = ZERO_BUBBLE, None
    model, system, plan = build_case(args)
    sim = simulate(model, system, plan, dtype=args.dtype, schedule=schedule)
    notes = {}
    for path, write in ((args.trace, _write_trace), (args.html, _write_html)):
        if path:
            notes[path] = write(sim, path)
    if args.json:
        print(json.dumps(sim.as_json(), indent=2))
    else:
        print(format_simulation(sim, notes))


def _write_trace(sim, path: str) -> str:
    from perfsim.schedule.timeline import write_trace

    return write_trace(sim.result, path)


def _write_html(sim, path: str) -> str:
    from perfsim.schedule.timeline import write_html

    p = sim.prediction
    title = (f"{p.model.name} on {p.devices} x {p.system.name}: TP {p.plan.tp} PP {p.plan.pp} DP {p.plan.dp}, "
             f"{sim.result.schedule}, {sim.result.m} micro-batches - simulated step {sim.result.step_time_s:.3f} s")
    return write_html(sim.result, path, title=title)


def _t(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f} ms" if abs(seconds) < 1 else f"{seconds:9.3f} s "


def format_simulation(sim, notes: dict | None = None) -> str:
    from perfsim.spec.plan import plan_summary

    r, p, a = sim.result, sim.prediction, sim.analytic
    diff = r.step_time_s / a.step_time_s - 1 if a.step_time_s else 0.0
    lines = [
        f"{p.model.name} on {p.devices} x {p.system.device.name} ({p.system.name}), {p.dtype}",
        f"plan: {plan_summary(p.plan.replace(schedule=r.schedule), long=True)}",  # zb-h1 runs a 1f1b plan
        "",
        f"step time       {_t(r.step_time_s)}  (closed form {_t(a.step_time_s).strip()}, {diff:+.1%})",
        f"throughput      {p.tokens_per_s:12,.0f} tokens/s   {p.model_tflops_per_device:.1f} TFLOP/s model per device "
        f"(MFU {p.mfu:.1%})",
        "",
        f"exposed time on stage {r.breakdown_stage} (the busiest)   simulated     closed form",
    ]
    for key, seconds in r.time_breakdown_s.items():
        lines.append(f"  {key:<12} {_t(seconds)} {seconds / r.step_time_s:6.1%}   {_t(a.time_breakdown_s[key])}")
    lines += ["", "stages          busy        idle      busy share"]
    shown = range(r.p) if r.p <= 16 else sorted({0, 1, r.p // 2, r.breakdown_stage, r.p - 2, r.p - 1})
    for i in shown:
        s = r.stages[i]
        lines.append(f"  stage {i:<4} {_t(s['busy_s'])} {_t(s['idle_s'])}  {s['busy_s'] / r.step_time_s:6.1%}")
    if r.p > 16:
        lines.append(f"  ({len(shown)} of {r.p} stages shown; --json lists all)")
    path = r.critical_path
    stages_on_path = len({run["stage"] for run in path["runs"]})
    kinds = ", ".join(f"{k} {v:.3g} s" for k, v in sorted(path["by_kind_s"].items(), key=lambda kv: -kv[1]))
    lines += ["", f"critical path: {len(path['runs'])} runs over {stages_on_path} stages; {kinds}"]
    runs = path["runs"]
    for run in runs[:3] + (["..."] if len(runs) > 6 else []) + runs[max(3, len(runs) - 3):]:
        if run == "...":
            lines.append("  ...")
            continue
        lines.append(f"  stage {run['stage']:<4} {run['start_s']:10.4f} s -> {run['end_s']:10.4f} s  "
                     f"({run['tasks']} tasks)")
    for path_, note in (notes or {}).items():
        lines.append(f"wrote {path_}" + (f" ({note})" if note else ""))
    lines.append(f"simulated {r.tasks:,} tasks in {r.wall_s:.2f} s")
    return "\n".join(lines)
