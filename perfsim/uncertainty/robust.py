"""Plans ranked over the draws of the profile's ranges (its posterior where it names observations).

Per plan: P(best), the share of draws in which it is the fastest plan compared, and P(within 5%),
the share in which its step time is within 5% of that draw's fastest; a plan that does not fit in
a draw's memory takes no part in that draw. Plans rank by P(within 5%), then P(best), then median
step time (rank_key). The top choice is called robust when it is within 5% of the best in at least
ROBUST_SHARE of the draws.

robust_ranking compares plans it is given (the charts give the point search's best CANDIDATES),
each priced under every draw. `perfsim search --robust` (robust_search, rank_space) compares every
valid plan of the space: a bound (perfsim/uncertainty/bounds.py) shows most are never within 5%
of the best in any draw, and only the rest are priced draw by draw, with the same P(best) and
P(within 5%) for every plan as pricing them all (docs/validation.md, "Pruning the robust search").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from perfsim.cost.columns import rows_of, stacked
from perfsim.errors import PerfsimError
from perfsim.predict import evaluate, predict
from perfsim.uncertainty.posterior import profile_draws
from perfsim.uncertainty.sampling import LINK_SECTIONS, evaluate_plans, group_systems, with_numbers

CANDIDATES = 30
WITHIN = 0.05
ROBUST_SHARE = 0.9
ROBUST_SAMPLES = 256


@dataclass(frozen=True)
class RobustPlan:
    prediction: object  # the point Prediction
    step_time_s: dict  # p10, p50, p90 over the draws where it fits
    p_best: float
    p_within_5pct: float
    p_fits: float

    def as_json(self) -> dict:
        return self.prediction.as_json() | {"p_best": self.p_best, "p_within_5pct": self.p_within_5pct,
                                            "p_fits": self.p_fits, "step_time_s_percentiles": self.step_time_s}


def robust_ranking(model, system, predictions, samples: int = ROBUST_SAMPLES, dtype: str = "bf16", seed: int = 0):
    """(RobustPlans ranked by median step time, the note on unexplained observations or '')."""
    draws, posterior = profile_draws(system, samples, seed)
    r = evaluate_plans(model, draws, [p.plan for p in predictions], dtype)
    steps = np.where(r["memory_total_bytes"] <= system.device.memory_bytes, r["step_time_s"], np.inf)  # plans x draws
    best = steps.min(axis=0)
    winner = np.argmin(steps, axis=0)
    ranked = []
    for i, p in enumerate(predictions):
        fits = np.isfinite(steps[i])
        spread = np.percentile(steps[i][fits], (10, 50, 90)) if fits.any() else (np.inf,) * 3
        ranked.append(RobustPlan(p, dict(zip(("p10", "p50", "p90"), map(float, spread))),
                                 float(np.mean(winner == i)), float(np.mean(steps[i] <= (1 + WITHIN) * best)),
                                 float(np.mean(fits))))
    ranked.sort(key=rank_key)
    return ranked, posterior.unexplained_text() if posterior is not None else ""


def rank_key(rp: RobustPlan):
    """The most often within 5% of the best first, then the most often best, the fastest median."""
    return -rp.p_within_5pct, -rp.p_best, rp.step_time_s["p50"]


def verdict(ranked) -> str:
    """One sentence: is the top choice robust?"""
    top = ranked[0]
    if top.p_within_5pct >= ROBUST_SHARE:
        return (f"The top plan is robust: within 5% of the best in {top.p_within_5pct:.0%} of the draws "
                f"(best in {top.p_best:.0%}).")
    rivals = [rp for rp in ranked[1:] if rp.p_best > 0.05]
    return (f"The top plan is not robust: within 5% of the best in only {top.p_within_5pct:.0%} of the draws "
            f"(best in {top.p_best:.0%}); {len(rivals)} other plan(s) are best in more than 5% of them. "
            "Measure the numbers that separate them first (docs/validation.md).")


def print_robust(found, model, system, devices: int, args) -> None:
    """`perfsim search --robust`: the RobustSearch as text or JSON (plan objects with p_best and
    p_within_5pct; "robust" says what was compared and what the bound excluded); what the
    observations cannot explain goes to stderr as a note."""
    import json
    import sys

    from perfsim.spec.plan import plan_summary

    if found.note:
        print(f"perfsim: note: {found.note}", file=sys.stderr)
    ranked = found.ranked
    what = "posterior conditioned on the profile's observations" if system.observations else "the profile's ranges"
    if args.json:
        print(json.dumps({"evaluated": found.valid, "feasible": found.valid - found.never_fit,
                          "candidates": found.candidates, "seconds": found.seconds, "rejected": found.rejected,
                          "robust": found.as_json() | {"draws": what, "top_is_robust": ranked[0].p_within_5pct >= ROBUST_SHARE,
                                                      "verdict": verdict(ranked)},
                          "plans": [rp.as_json() for rp in ranked[:args.top]]}, indent=2))
        return
    lines = [f"{model.name} on {devices} x {system.device.name} ({system.name}), global batch {args.gbs}",
             f"every one of the {found.valid:,} valid plans ({found.candidates:,} candidates) compared over "
             f"{found.samples} draws of {what}, in {found.seconds:.1f} s:",
             f"  {found.never_fit:,} fit in no draw; the bound excluded {found.excluded:,} that are never within 5% "
             f"of the best; {found.priced:,} priced draw by draw ({found.plan_draws:,} plan-draws)",
             f"  {len(found.shares):,} plan(s) within 5% of the best in some draw; the first {min(args.top, len(ranked))} "
             "by P(within 5%), P(best), median step", "",
             f"{'#':>3} {'step P10 .. P50 .. P90':>26} {'point':>8} {'P(best)':>8} {'P(<=5%)':>8}  plan"]
    for i, rp in enumerate(ranked[:args.top], 1):
        q = rp.step_time_s
        lines.append(f"{i:>3} {q['p10']:>8.2f} .. {q['p50']:>6.2f} .. {q['p90']:>6.2f}s {rp.prediction.step_time_s:>7.2f}s "
                     f"{rp.p_best:>8.0%} {rp.p_within_5pct:>8.0%}  {plan_summary(rp.prediction.plan, dtype=rp.prediction.dtype)}"
                     + (f" (fits in {rp.p_fits:.0%} of the draws)" if rp.p_fits < 1 else ""))
    lines += ["", verdict(ranked)]
    print("\n".join(lines))


# --- the whole space (perfsim search --robust) ---

# Plans whose step time at the slow corner of the draws is worked out to bound every draw's best
# from above: the fastest this many by the lower bound (any plan's slow-corner time bounds every
# draw's best; these are the likeliest to give a low one).
UPPER_BOUND_PLANS = 20_000
# Plans priced at each link configuration's slow corner beside the lower bounds: the fastest this
# many by the lower bound at the previous configuration and over all draws.
REFERENCE_PLANS = 16


@dataclass
class Family:
    """The plans of one tensor-parallel mode still in the running, every rank order in one batch."""
    mode: str
    columns: object  # Columns, rows_of-able
    orders: np.ndarray  # each row's rank order
    lower: np.ndarray  # step time at the optimistic corner of all the draws

    def take(self, index) -> "Family":
        return Family(self.mode, rows_of(self.columns, index), self.orders[index], self.lower[index])

    def plan(self, i: int):
        from perfsim.search import plan_at

        c = self.columns
        cols = {f: getattr(c, f) for f in ("tp", "tp_depth", "sp", "regather", "pp", "dp", "schedule", "vpp", "mbs",
                                           "cp", "first_layers", "last_layers", "zero", "recompute", "flash", "gbs",
                                           "dp_overlap", "tp_overlap", "ep", "etp", "allgather", "flex", "ep_overlap")}
        return plan_at(self.mode, str(self.orders[i]), cols, i)


@dataclass
class RobustSearch:
    """The whole space ranked over the draws: `ranked` the first `top` plans within 5% of the best in
    at least one draw (RobustPlans, rank_key order); the counts say what the bound spared."""
    ranked: list
    shares: dict  # Plan -> (P(best), P(within 5%)) of every plan within 5% of the best in at least one draw
    note: str
    samples: int
    candidates: int  # the space, each rank order counted
    rejected: dict
    valid: int  # valid plans (each priced at the optimistic corner)
    never_fit: int  # too big for the device even at the smallest memory any draw gives
    excluded: int  # fit in some draw, but the bound shows they are never within 5% of the best
    priced: int  # priced exactly in at least one link configuration's draws
    plan_draws: int  # plan x draw prices worked out exactly
    seconds: float = 0.0

    def as_json(self) -> dict:
        return {"samples": self.samples, "compared": self.valid, "never_fit": self.never_fit,
                "excluded_by_bound": self.excluded, "priced_exactly": self.priced,
                "plan_draws_priced": self.plan_draws, "plausible": len(self.shares)}


def _corner_system(system, fast: dict, slow: dict, counts: tuple):
    """`system` whose numbers are `fast` for the first counts[0] rows and `slow` for the next
    counts[1]: one call prices lower bounds and upper bounds side by side. Link numbers are one
    per call (a link configuration's): they must agree."""
    numbers = {}
    for key in fast:
        if key.split(".")[0] in LINK_SECTIONS or fast[key] == slow[key]:
            if fast[key] != slow[key]:
                raise ValueError(f"{key}: link numbers must be one per link configuration")
            numbers[key] = fast[key]
        else:
            numbers[key] = np.concatenate([np.full(counts[0], fast[key]), np.full(counts[1], slow[key])])
    return with_numbers(system, numbers)


def _steps(result, capacity) -> np.ndarray:
    """Step times, infinite where the plan does not fit."""
    step = np.asarray(result["step_time_s"], float)
    return np.where(np.asarray(result["memory_bytes"]["total"]) <= capacity, step, np.inf)


def _price(model, draws, family: Family, index, dtype) -> np.ndarray:
    """(plans x draws) step times of `index` of a family under every draw (one link
    configuration's), infinite where a plan does not fit."""
    rows_all, system = next(group_systems(draws, repeat=len(index)))
    assert rows_all.size == draws.n, "draws of one link configuration"
    columns = rows_of(family.columns, np.repeat(np.asarray(index), draws.n))
    r = evaluate(model, system, columns, dtype)
    return np.broadcast_to(_steps(r, system.device.memory_bytes), (len(index) * draws.n,)).reshape(len(index), draws.n)


def _survivors(model, system, draws, families, candidates, references, capacity, dtype):
    """(per family, the `candidates` whose step time at the optimistic corner of `draws` is at most
    (1 + 5%) x U, where U, the smallest step time of the `references` at the draws' pessimistic
    corner, bounds every draw's best from above; per family, its REFERENCE_PLANS lowest by that
    bound, to bound a smaller set of draws next). Draws sharing one link configuration take one
    call per family: the two corners differ only in device and framework numbers, arrays."""
    from perfsim.uncertainty.bounds import optimistic_numbers, pessimistic_numbers

    fast, slow = optimistic_numbers(draws), pessimistic_numbers(draws)
    one_link = all(fast[k] == slow[k] for k in fast if k.split(".")[0] in LINK_SECTIONS)
    if not one_link and not _same_routes(draws, fast, slow):
        return candidates, references  # the corners bound nothing here: every candidate goes on
    lower, upper = [], np.inf
    for f, chosen, ref in zip(families, candidates, references):
        if not len(chosen):
            lower.append(np.empty(0))
            continue
        if one_link:
            both = np.concatenate([chosen, ref])
            r = evaluate(model, _corner_system(system, fast, slow, (len(chosen), len(ref))), rows_of(f.columns, both), dtype)
            steps = np.broadcast_to(_steps(r, capacity), both.shape)
            lower.append(steps[:len(chosen)])
            upper = min(upper, float(steps[len(chosen):].min(initial=np.inf)))
        else:
            lower.append(np.broadcast_to(_steps(evaluate(model, with_numbers(system, fast), rows_of(f.columns, chosen),
                                                         dtype), capacity), chosen.shape))
            if len(ref):
                upper = min(upper, float(_steps(evaluate(model, with_numbers(system, slow), rows_of(f.columns, ref),
                                                         dtype), capacity).min(initial=np.inf)))
    kept = [chosen[low <= (1 + WITHIN) * upper] for chosen, low in zip(candidates, lower)]
    lowest = [chosen[np.argsort(low)[:REFERENCE_PLANS]] for chosen, low in zip(candidates, lower)]
    return kept, [np.union1d(a, b) for a, b in zip(lowest, references)]


def _same_routes(draws, *corners) -> bool:
    """Do the corners (number dicts) route traffic as every link configuration of `draws` does?
    Only then do they bound those draws (bounds.routes)."""
    from perfsim.uncertainty.bounds import routes

    first = routes(with_numbers(draws.system, corners[0]))
    configurations = [with_numbers(draws.system, dict(zip(draws.keys, map(float, draws.values[np.flatnonzero(draws.groups == g)[0]]))))
                      for g in np.unique(draws.groups)]
    return all(routes(s) == first for s in [with_numbers(draws.system, c) for c in corners[1:]] + configurations)


def _clusters(model, system, draws, rows_of_group, families, capacity, dtype) -> list:
    """The link configurations in about sqrt(count) clusters of similar speed: ordered by the step
    time of the plan with the lowest bound at each one's optimistic corner (one call each, whose
    collective lines the configuration needs later anyway)."""
    from perfsim.uncertainty.bounds import optimistic_numbers

    k = min(range(len(families)), key=lambda k: families[k].lower.min())
    plan = rows_of(families[k].columns, [int(np.argmin(families[k].lower))])
    speed = {g: float(_steps(evaluate(model, with_numbers(system, optimistic_numbers(draws, rows)), plan, dtype),
                             capacity)[0]) for g, rows in rows_of_group.items()}
    ordered = sorted(speed, key=speed.get)
    size = max(1, int(np.ceil(np.sqrt(len(ordered)))))
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def robust_search(model, system, devices: int, gbs: int, fixes: dict | None = None, samples: int = ROBUST_SAMPLES,
                  dtype: str = "bf16", seed: int = 0, top: int = 10, progress=None) -> RobustSearch:
    """`perfsim search --robust`: rank_space over the draws a prediction uses (profile_draws)."""
    draws, posterior = profile_draws(system, samples, seed)
    result = rank_space(model, draws, devices, gbs, fixes, dtype, top, progress)
    result.note = posterior.unexplained_text() if posterior is not None else ""
    return result


def rank_space(model, draws, devices: int, gbs: int, fixes: dict | None = None, dtype: str = "bf16", top: int = 10,
               progress=None) -> RobustSearch:
    """Every valid plan of the space ranked over the draws, exactly as if each were priced under
    every draw, by pricing only those a bound cannot rule out (docs/validation.md, "Pruning the
    robust search"):

    1. every valid plan at the optimistic corner of the draws (bounds.optimistic_system): a lower
       bound L(p) on its step time in every draw; a plan too big there fits in no draw;
    2. the UPPER_BOUND_PLANS lowest by L at the pessimistic corner: the smallest, U, bounds every
       draw's best from above, so a plan with L(p) > (1 + 5%) U is never within 5% of the best;
    3. per link configuration g (the draws sharing its link numbers): the survivors at g's
       optimistic corner, L_g(p), beside a few good plans at g's pessimistic corner, whose
       smallest, U_g, bounds the best of g's draws; the plans with L_g(p) <= (1 + 5%) U_g are
       priced under each of g's draws, which gives each draw's best exactly (the best plan of a
       draw always passes) and which plans are within 5% of it;
    4. the plans within 5% of the best in some draw, priced under every draw for their spread.
    """
    import time

    from perfsim.search import PlanSpace
    from perfsim.uncertainty.bounds import optimistic_numbers, pessimistic_numbers

    start = time.perf_counter()
    fixes = fixes or {}
    system = draws.system
    capacity = system.device.memory_bytes
    fast_numbers, slow_numbers = optimistic_numbers(draws), pessimistic_numbers(draws)
    fast = with_numbers(system, fast_numbers)
    space = PlanSpace(model, devices, gbs, fixes)
    rejected = space.rejected
    parts: dict = {}
    valid = 0
    for batch in space.batches(fast, dtype):
        lower = _steps(batch.result, capacity)
        valid += len(lower)
        keep = np.flatnonzero(np.isfinite(lower))
        parts.setdefault(batch.mode, []).append(Family(batch.mode, rows_of(batch.columns, keep),
                                                       np.full(len(keep), batch.order, dtype=object), lower[keep]))
    if progress:
        progress(f"robust search: {valid:,} valid plans bounded at the optimistic corner")
    families = [Family(mode, stacked([f.columns for f in fs]), np.concatenate([f.orders for f in fs]),
                       np.concatenate([f.lower for f in fs])) for mode, fs in parts.items()]
    families = [f for f in families if len(f.lower)]
    fitting = sum(len(f.lower) for f in families)
    if not fitting:
        from perfsim.search import nothing_fits

        too_big = {"does not fit in device memory in any draw": valid} if valid else {}
        raise PerfsimError(nothing_fits(valid, rejected | too_big, devices, gbs))
    # 2. an upper bound on every draw's best
    if not _same_routes(draws, fast_numbers, slow_numbers):
        families = [dataclasses.replace(f, lower=np.zeros_like(f.lower)) for f in families]  # no lower bound
    everything = np.concatenate([f.lower for f in families])
    cut = np.partition(everything, min(UPPER_BOUND_PLANS, len(everything)) - 1)[min(UPPER_BOUND_PLANS, len(everything)) - 1]
    slow = with_numbers(system, slow_numbers)
    upper = min(float(_steps(evaluate(model, slow, rows_of(f.columns, np.flatnonzero(f.lower <= cut)), dtype),
                             capacity).min(initial=np.inf)) for f in families)
    families = [f.take(np.flatnonzero(f.lower <= (1 + WITHIN) * upper)) for f in families]
    families = [f for f in families if len(f.lower)]
    # 3. clusters of link configurations, then each configuration's draws
    best_count = [np.zeros(len(f.lower)) for f in families]
    within_count = [np.zeros(len(f.lower)) for f in families]
    ever_priced = [np.zeros(len(f.lower), bool) for f in families]
    plan_draws = 0
    everyone = [np.arange(len(f.lower)) for f in families]
    references = [np.argsort(f.lower)[:REFERENCE_PLANS] for f in families]
    link_groups = np.unique(draws.groups)
    rows_of_group = {g: np.flatnonzero(draws.groups == g) for g in link_groups}
    clusters = _clusters(model, system, draws, rows_of_group, families, capacity, dtype)
    for cluster in clusters:
        rows = np.concatenate([rows_of_group[g] for g in cluster])
        in_cluster, cluster_references = _survivors(model, system, draws.subset(rows), families, everyone,
                                                    references, capacity, dtype)
        for g in cluster:
            rows = rows_of_group[g]
            mine = draws.subset(rows)
            candidates, _ = _survivors(model, system, mine, families, in_cluster, cluster_references, capacity, dtype)
            times = [(k, chosen, _price(model, mine, f, chosen, dtype))  # (family, plans, plans x draws)
                     for k, (f, chosen) in enumerate(zip(families, candidates)) if len(chosen)]
            for k, chosen, _ in times:
                ever_priced[k][chosen] = True
                plan_draws += len(chosen) * len(rows)
            best = np.min([t.min(axis=0) for _, _, t in times], axis=0) if times else np.full(len(rows), np.inf)
            counted = ~np.isfinite(best)  # a draw in which nothing fits has no best
            for k, chosen, t in times:
                at_best = t == best
                first = at_best.argmax(axis=0)  # ties: the first plan priced
                new = at_best.any(axis=0) & ~counted
                np.add.at(best_count[k], chosen[first[new]], 1)
                counted |= new
                within_count[k][chosen] += (t <= (1 + WITHIN) * best).sum(axis=1)
    # 4. the plausible-best set: the first `top` by P(within 5%), P(best) (ties: the lower bound), priced
    # under every draw for their spread and memory
    plausible = [(-within_count[k][i], -best_count[k][i], f.lower[i], k, i) for k, f in enumerate(families)
                 for i in np.flatnonzero(within_count[k] > 0)]
    shown = sorted(plausible)[:top]
    steps = {}
    for k in {k for *_, k, _ in shown}:
        index = [i for *_, kk, i in shown if kk == k]
        spread = np.empty((len(index), draws.n))
        for g in np.unique(draws.groups):
            rows = np.flatnonzero(draws.groups == g)
            spread[:, rows] = _price(model, draws.subset(rows), families[k], index, dtype)
        steps.update({(k, i): spread[j] for j, i in enumerate(index)})
    ranked = []
    for *_, k, i in shown:
        fits = np.isfinite(steps[k, i])
        spread = np.percentile(steps[k, i][fits], (10, 50, 90))
        ranked.append(RobustPlan(predict(model, system, families[k].plan(int(i)), dtype),
                                 dict(zip(("p10", "p50", "p90"), map(float, spread))),
                                 float(best_count[k][i] / draws.n), float(within_count[k][i] / draws.n),
                                 float(np.mean(fits))))
    ranked.sort(key=rank_key)
    priced = int(sum(p.sum() for p in ever_priced))
    shares = {families[k].plan(int(i)): (float(-best / draws.n), float(-within / draws.n))
              for within, best, _, k, i in plausible}
    return RobustSearch(ranked, shares, "", draws.n, space.candidates, rejected, valid, valid - fitting, fitting - priced, priced,
                        plan_draws, time.perf_counter() - start)
