"""Where the event simulation and the closed form differ, and why: the tables of docs/simulator.md.

    python -m perfsim.schedule.examples

prints them as Markdown from the current profiles (numbers move when a profile is recalibrated).
"""

from __future__ import annotations

import dataclasses

from perfsim.cost.columns import columns_of
from perfsim.cost.stage import stage_costs, stage_phases
from perfsim.predict import predict
from perfsim.schedule.simulator import StepCosts, run_step, simulate, step_costs
from perfsim.spec.model import load_model
from perfsim.spec.plan import Plan
from perfsim.spec.system import load_system

BUILTIN = Plan(tp=8, pp=16, dp=1, zero=1, mbs=3, gbs=300, recompute="full")  # SMNG-P2 authors' 175B plan


def _pct(a: float, b: float) -> str:
    return f"{a / b - 1:+.1%}"


def _plan(plan: Plan, schedule: str | None = None) -> str:
    sched = schedule or plan.schedule + (f" v={plan.vpp}" if plan.vpp > 1 else "")
    dp = f" DP{plan.dp} ZeRO-{plan.zero}" if plan.dp > 1 else ""
    return f"TP{plan.tp} PP{plan.pp}{dp}, {sched}, m={plan.microbatches}"


def end_stages() -> str:
    """First and last stages that differ from the middle ones."""
    rows = ["| model, system | plan | T first / middle / last per micro-batch | one send | closed form | simulated | "
            "difference |", "|---|---|---|---|---|---|---|"]
    cases = [("gpt3-175b", "smng-p2", BUILTIN),
             ("gpt3-1.3b", "dgx-a100", Plan(tp=1, pp=8, mbs=1, gbs=32)),
             ("gpt3-1.3b", "dgx-a100", Plan(tp=1, pp=12, mbs=1, gbs=12)),
             ("gpt3-1.3b", "dgx-a100", Plan(tp=1, pp=12, vpp=2, schedule="interleaved", mbs=1, gbs=12))]
    for model, system, plan in cases:
        m, s = load_model(model), load_system(system)
        c = columns_of(plan)
        st = stage_costs(m, s, c, s.device.peak_flops_bf16)
        sim = simulate(m, s, plan)
        hop = float(st.middle.pp_comm) / (2 * plan.vpp)
        t = " / ".join(f"{float(x.total) * 1e3:.1f}" for x in (st.first, st.middle, st.last))
        rows.append(f"| {model}, {system} | {_plan(plan)} | {t} ms | {hop * 1e3:.2f} ms | "
                    f"{sim.analytic.step_time_s:.3f} s | {sim.result.step_time_s:.3f} s | "
                    f"{_pct(sim.result.step_time_s, sim.analytic.step_time_s)} |")
    return "\n".join(rows)


def synthetic_end_stages() -> str:
    """Stage times made up to show the extremes: F = 1 s and B = 2 s on every stage (no sends, no
    data parallelism), with `extra` seconds added to both passes of the first or the last stage."""
    rows = ["| schedule | p | m | v | extra on first / last (each pass) | closed form | simulated | difference |",
            "|---|---|---|---|---|---|---|---|"]
    for schedule, p, m, v, first, last in (("gpipe", 8, 6, 1, 1.0, 0.5), ("1f1b", 8, 6, 1, 1.0, 0.5),
                                           ("1f1b", 8, 32, 1, 1.0, 0.5), ("interleaved", 5, 5, 3, 1.0, 1.0),
                                           ("interleaved", 5, 20, 3, 1.0, 1.0)):
        costs = _uniform(p, m, v, schedule, 1.0, 2.0, first, last)
        simulated = run_step(costs).step_time_s
        t, t_first, t_last = 3.0, 3.0 + 2 * first, 3.0 + 2 * last
        total, slowest = t_first + t_last + (p - 2) * t, max(t_first, t_last)
        closed = m * slowest + (p - 1) / v * total / p if schedule == "interleaved" else (m - 1) * slowest + total
        rows.append(f"| {schedule} | {p} | {m} | {v} | {first:g} / {last:g} s | {closed:.2f} s | {simulated:.2f} s | "
                    f"{_pct(simulated, closed)} |")
    return "\n".join(rows)


def _uniform(p, m, v, schedule, f, b, first, last) -> StepCosts:
    per = lambda x: {"first": x + first, "middle": x, "last": x + last}  # noqa: E731
    none = {"first": 0.0, "middle": 0.0, "last": 0.0}
    return StepCosts(schedule=schedule, p=p, m=m, v=v, layers=p * v, forward_compute=per(f), forward_tp=none,
                     recompute=none, backward_compute=per(b), backward_tp=none, weight_grad=none, hop_s=0.0,
                     nic=list(range(p)), pp_cross=[True] * p, dp_cross=[False] * p, tp_cross=[False] * p)


def shared_nics() -> str:
    """Pipeline and data-parallel traffic on the NICs of SMNG-P2 nodes."""
    smng = load_system("smng-p2")
    rows = ["| model | plan | closed form | simulated, NICs shared | simulated, every transfer alone | "
            "pipeline sends on the busiest stage, shared / alone | exposed DP, shared / alone |",
            "|---|---|---|---|---|---|---|"]
    cases = [("smng-p2-20b", smng, Plan(tp=4, pp=4, dp=4, zero=2, mbs=1, gbs=64, recompute="full")),
             ("smng-p2-20b", smng, Plan(tp=4, pp=4, dp=4, zero=3, mbs=1, gbs=64, recompute="full")),
             ("gpt3-175b", smng, Plan(tp=8, pp=16, dp=2, zero=1, mbs=3, gbs=600, recompute="full", dp_overlap=True))]
    for model, system, plan in cases:
        m, c = load_model(model), columns_of(plan)
        peak = system.device.peak_flops_bf16
        costs = step_costs(m, system, c, stage_costs(m, system, c, peak), stage_phases(m, system, c, peak))
        shared, alone = run_step(costs), run_step(dataclasses.replace(costs, share_links=False))
        ref = shared.breakdown_stage
        pp = [r.stages[ref]["busy_by_kind_s"].get("pp_comm", 0.0) for r in (shared, alone)]
        dp = [r.time_breakdown_s["dp_comm"] for r in (shared, alone)]
        closed = predict(m, system, plan).step_time_s
        name = " (dp_overlap)" if plan.dp_overlap else ""
        rows.append(f"| {model}{name} | {_plan(plan)} | {closed:.2f} s | {shared.step_time_s:.2f} s | "
                    f"{alone.step_time_s:.2f} s | {pp[0]:.3f} / {pp[1]:.3f} s | {dp[0]:.2f} / {dp[1]:.2f} s |")
    return "\n".join(rows)


def schedules() -> str:
    """The same 175B plan (96 micro-batches, a multiple of 16 for interleaving) under each schedule."""
    rows = ["| schedule | closed form | simulated | difference | simulated, every transfer alone | "
            "bubble (simulated) | pipeline sends (simulated) |", "|---|---|---|---|---|---|---|"]
    base = BUILTIN.replace(gbs=288)
    m, s = load_model("gpt3-175b"), load_system("smng-p2")
    peak = s.device.peak_flops_bf16
    for label, plan, schedule in (("gpipe", base.replace(schedule="gpipe"), None),
                                  ("1f1b", base, None),
                                  ("zb-h1", base, "zb-h1"),
                                  ("interleaved v=2", base.replace(vpp=2, schedule="interleaved"), None),
                                  ("interleaved v=3", base.replace(vpp=3, schedule="interleaved"), None),
                                  ("interleaved v=6", base.replace(vpp=6, schedule="interleaved"), None)):
        c = columns_of(plan)
        costs = step_costs(m, s, c, stage_costs(m, s, c, peak), stage_phases(m, s, c, peak), schedule=schedule)
        r, alone = run_step(costs), run_step(dataclasses.replace(costs, share_links=False))
        closed = predict(m, s, plan).step_time_s
        closed_text = f"{closed:.2f} s" + (" (1f1b's)" if schedule == "zb-h1" else "")
        rows.append(f"| {label} | {closed_text} | {r.step_time_s:.2f} s | {_pct(r.step_time_s, closed)} | "
                    f"{alone.step_time_s:.2f} s | {r.time_breakdown_s['pp_bubble']:.2f} s | "
                    f"{r.time_breakdown_s['pp_comm']:.2f} s |")
    return "\n".join(rows)


def main() -> None:
    for title, fn in (("End stages", end_stages), ("End stages, made-up times", synthetic_end_stages),
                      ("Shared NICs", shared_nics), ("Schedules", schedules)):
        print(f"### {title}\n\n{fn()}\n")


if __name__ == "__main__":
    main()
