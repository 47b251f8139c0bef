"""The plans the memory and breakdown charts compare: the user's plan and the search's best."""

from __future__ import annotations

from perfsim.errors import PerfsimError
from perfsim.predict import predict
from perfsim.spec.plan import canonical, plan_summary


def plan_set(model, system, plan=None, devices: int | None = None, gbs: int | None = None, top: int = 5,
             fixes: dict | None = None, dtype: str = "bf16", pareto: bool = False, result=None) -> tuple:
    """([(label, Prediction)], note): `plan` first (labelled "your plan"), then the search's
    `top` best plans for the same devices and global batch (or its Pareto front), without repeats
    (plans equal up to choices that change nothing, spec.plan.canonical, are one). `result`: that
    search done already, with at least `top` plans. The note says what could not be added."""
    out, note = [], ""
    if plan is not None:
        out.append(("your plan", predict(model, system, plan, dtype)))
        devices = devices or plan.devices
        gbs = gbs or plan.gbs
    if top > 0 or pareto:
        from perfsim.search import search

        try:
            result = result or search(model, system, devices, gbs, fixes, top=max(top, 1), dtype=dtype)
            found = result.pareto if pareto else result.plans[:top]
            kind = "Pareto" if pareto else "search"
            shown = [canonical(p.plan) for _, p in out]
            for n, p in enumerate(found, 1):
                if canonical(p.plan) in shown:
                    where = shown.index(canonical(p.plan))
                    if out[where][0] == "your plan":
                        out[where] = (f"your plan = {kind} #{n}", out[where][1])
                    continue
                out.append((f"{kind} #{n}", p))
                shown.append(canonical(p.plan))
        except PerfsimError as exc:
            if not out:
                raise
            note = f"no search results: {exc}"
    if not out:
        raise PerfsimError("no plan to show: give plan flags or --top N")
    return out, note


def labels(plans: list) -> list:
    return [f"{name}: {plan_summary(p.plan)}" for name, p in plans]
