"""Which calibration suite to run first (the order `perfsim calibrate --emit-slurm` writes): the
profile numbers each suite's measurements fit, and the suites ranked by how much of the doubt
those numbers leave about the choice of plan and the step time (perfsim/uncertainty/plan_choice.py,
docs/calibration.md).

A suite's "decides" is the largest plan-choice share among its numbers (the shares of several
numbers overlap, so they are not added: the largest is what measuring the suite settles at least);
its "moves" is the sum of its numbers' first-order shares of the chosen plan's step-time variance
(first-order shares of independent numbers add up, to at most 1). Both are taken over the prior
draws of the profile's ranges for the built-in case (gpt3-175b on 16 nodes, global batch 300:
the point search's best plans and the SMNG-P2 authors' plan).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# suite -> the profile numbers its fit sets, by key prefix (perfsim/calibrate/*); a named cause of a
# number ("<key>.causes.<name>") belongs to the number's suite. attention fits the fused (flash)
# kernel's efficiencies and tables, and checks the unfused core's formula.
SUITE_NUMBERS = {
    "collective": ("node.", "network.", "collectives."),
    "gemm": ("device.peak_flops_", "device.gemm_"),
    "memory": ("device.memory_bandwidth_Bps", "device.memory_efficiency", "device.kernel_overhead_s",
               "device.operation_memory_efficiency."),
    "attention": ("device.flash_forward_efficiency", "device.flash_backward_efficiency"),
    "tp_overhead": ("framework.tp_layer_overhead_s", "framework.sp_layer_overhead_s"),
    "overheads": ("framework.step_overhead_s", "framework.microbatch_overhead_s", "framework.layer_overhead_s",
                  "framework.rank_jitter"),
}
SHOWN_UNMEASURED = 0.05  # a number no suite measures is named in the script from this share up (below: noise)


def suite_of(key: str) -> str | None:
    """The suite whose measurements fit the profile number `key`; None if no suite does."""
    for suite, prefixes in SUITE_NUMBERS.items():
        if any(key.startswith(prefix) for prefix in prefixes):
            return suite
    return None


@dataclass(frozen=True)
class SuitePriority:
    suite: str
    decides: float  # the largest plan-choice share among its numbers
    moves: float  # the sum of its numbers' step-time variance shares, at most 1
    lead: str  # its number with the largest shares, or ""

    def comment(self) -> str:
        why = f" (most: {self.lead})" if self.lead else " (no number it fits moves this case)"
        return (f"{self.suite}: settles {self.decides:.0%} of the doubt about the plan, "
                f"{self.moves:.0%} of the step time's variance{why}")


def suite_priorities(numbers, suites) -> tuple:
    """(SuitePriority per suite of `suites`, most to settle first; [(key, decides, moves)] of the
    numbers no suite measures) from plan_choice's Numbers."""
    ranked = []
    for suite in suites:
        own = [n for n in numbers if suite_of(n.key) == suite]
        lead = max(own, key=lambda n: (n.choice_share, n.step_share), default=None)
        ranked.append(SuitePriority(suite, max((n.choice_share for n in own), default=0.0),
                                    min(1.0, sum(n.step_share for n in own)),
                                    lead.key if lead is not None and (lead.choice_share or lead.step_share) else ""))
    # by whole percents (a share below 0.5% is none), ties in the suites' own order
    ranked.sort(key=lambda s: (-round(s.decides, 2), -round(s.moves, 2)))
    unmeasured = [(n.key, n.choice_share, n.step_share) for n in numbers if suite_of(n.key) is None
                  and max(n.choice_share, n.step_share) >= SHOWN_UNMEASURED]
    return tuple(ranked), unmeasured


@functools.lru_cache(maxsize=8)
def builtin_case_priorities(system_name: str, suites: tuple, samples: int | None = None) -> tuple:
    """suite_priorities over the built-in case (module docstring) on the profile `system_name`
    (remembered: the draws and the search take seconds, and a process asks once per profile)."""
    from perfsim.spec.case import BUILTIN_CASE, stack_defaults
    from perfsim.predict import predict
    from perfsim.search import search
    from perfsim.spec.model import load_model
    from perfsim.spec.plan import Plan
    from perfsim.uncertainty.plan_choice import DEFAULT_CANDIDATES, DEFAULT_SAMPLES, plan_choice

    from perfsim.spec.system import load_system

    system, model = load_system(system_name), load_model(BUILTIN_CASE["model"])
    devices = BUILTIN_CASE["nodes"] * system.node.devices_per_node
    fields = dict(BUILTIN_CASE["plan"], dp=devices // (BUILTIN_CASE["plan"]["tp"] * BUILTIN_CASE["plan"]["pp"]))
    authors = Plan(**stack_defaults(system, fields))
    plans = [p.plan for p in search(model, system, devices, authors.gbs, top=DEFAULT_CANDIDATES).plans]
    if authors not in plans:
        predict(model, system, authors)  # a one-line error if the profile cannot run it
        plans.append(authors)
    choice = plan_choice(model, system, plans, samples or DEFAULT_SAMPLES)
    return suite_priorities(choice.numbers, suites)
