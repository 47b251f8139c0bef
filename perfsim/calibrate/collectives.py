"""Collectives: bus bandwidth and latency per link class, per-operation factors, step overheads."""

from __future__ import annotations

import math

import numpy as np

from perfsim.calibrate.common import (COLLECTIVE_OPS, COLLECTIVE_TIMINGS, Fitted, Quality, TARGETS,
                                      least_squares, mape, measured_times, split_held_out, with_fields,
                                      with_values)


def link_class(system, size: int, stride: int) -> str:
    """card, node or network: where a group of ranks r0, r0 + stride, ... lands (ranks fill cards
    then nodes in order)."""
    span = stride * (size - 1) + 1
    if span <= system.node.devices_per_card:
        return "card"
    if span <= system.node.devices_per_node:
        return "node"
    return "network"


_CLASS_KEYS = {  # link class -> (bandwidth key, latency key, efficiency key)
    "card": ("node.card_link_bandwidth_Bps", "node.card_link_latency_s", "collectives.card_efficiency"),
    "node": ("node.node_link_bandwidth_Bps", "node.node_link_latency_s", "collectives.node_efficiency"),
    "network": ("network.nic_bandwidth_Bps", "network.latency_s", "collectives.network_efficiency"),
}


def _with_links(system, links: dict, factors: dict | None = None):
    """System whose link classes have bus bandwidth (efficiency folded in) and latency `links`, and
    whose operations have the factors {op: (efficiency, latency factor)} (none: no operation factors)."""
    node, network = {}, {}
    for cls, (bw, lat) in links.items():
        (bw_key, lat_key, _) = _CLASS_KEYS[cls]
        target = network if bw_key.startswith("network") else node
        target[bw_key.split(".", 1)[1]] = bw
        target[lat_key.split(".", 1)[1]] = lat
    collectives = {_CLASS_KEYS[c][2].split(".", 1)[1]: 1.0 for c in links}
    factors = factors or {}
    collectives["operation_efficiency"] = tuple((op, factors[op][0]) for op in COLLECTIVE_OPS if op in factors)
    collectives["operation_latency_factor"] = tuple((op, factors[op][1]) for op in COLLECTIVE_OPS if op in factors)
    return with_fields(system, node=node, network=network, collectives=collectives)


def _bus(system, cls):
    """Bus bandwidth and latency of a link class in a profile (efficiency applied)."""
    bw_key, lat_key, eff_key = _CLASS_KEYS[cls]
    get = lambda key: getattr(getattr(system, key.split(".")[0]), key.split(".")[1])  # noqa: E731
    return get(bw_key) * get(eff_key), get(lat_key)


def collective_times(system, records):
    """perfsim's prediction for each collective record (TopologyCommModel, all groups busy)."""
    from perfsim.cost.topology import TopologyCommModel

    comm = TopologyCommModel(system)
    out = np.empty(len(records))
    by_op: dict = {}
    for i, r in enumerate(records):
        by_op.setdefault(r["op"], []).append(i)
    for op, idx in by_op.items():
        n = np.array([records[i]["nbytes"] for i in idx], float)
        size = np.array([records[i]["group"][0] for i in idx])
        stride = np.array([records[i]["group"][1] for i in idx])
        out[idx] = getattr(comm, op)(n, size, stride)
    return out


_LINK_BOUNDS = ([math.log(1e5), math.log(1e-9)], [math.log(1e14), math.log(1.0)])  # bus bandwidth, latency
_FACTOR_BOUNDS = ([math.log(1e-3)] * 2, [math.log(1e3)] * 2)  # an operation's efficiency, latency factor


def _fit_links(system, fit, classes):
    """Fitted {class: (bus bandwidth, latency)} over the records `fit`, no operation factors."""
    t = measured_times(fit)
    x0 = []
    for cls in classes:
        bw, lat = _bus(system, cls)
        x0 += [math.log(bw), math.log(max(lat, 1e-7))]

    def links(x):
        return {cls: (math.exp(x[2 * i]), math.exp(x[2 * i + 1])) for i, cls in enumerate(classes)}

    lo, hi = _LINK_BOUNDS[0] * len(classes), _LINK_BOUNDS[1] * len(classes)
    x = least_squares(lambda x: np.log(collective_times(_with_links(system, links(x)), fit) / t), x0, (lo, hi))
    return links(x)


def _fit_operations(system, fit, classes, start: dict):
    """Per link class (bus bandwidth, latency) and per measured operation (efficiency, latency
    factor), fitted together over `fit` from the class fit `start`. Only products are identifiable,
    so the first operation is pinned to (1, 1) while fitting; afterwards the factors are rescaled
    (the class numbers inversely) so that the fastest operation has efficiency 1 (the class
    bandwidth is what the best operation reaches, and every efficiency is a fraction, as the
    profile requires) and send/recv, where measured, has latency factor 1 (the class latency is
    one point-to-point message; else the smallest factor is 1)."""
    t = measured_times(fit)
    ops = [op for op in COLLECTIVE_OPS if any(r["op"] == op for r in fit)]
    x0 = []
    for cls in classes:
        bw, lat = start[cls]
        x0 += [math.log(bw), math.log(max(lat, 1e-7))]
    x0 += [0.0, 0.0] * (len(ops) - 1)

    def unpack(x):
        links = {cls: (math.exp(x[2 * i]), math.exp(x[2 * i + 1])) for i, cls in enumerate(classes)}
        factors = {ops[0]: (1.0, 1.0)}
        for j, op in enumerate(ops[1:]):
            k = 2 * len(classes) + 2 * j
            factors[op] = (math.exp(x[k]), math.exp(x[k + 1]))
        return links, factors

    lo = _LINK_BOUNDS[0] * len(classes) + _FACTOR_BOUNDS[0] * (len(ops) - 1)
    hi = _LINK_BOUNDS[1] * len(classes) + _FACTOR_BOUNDS[1] * (len(ops) - 1)
    x = least_squares(lambda x: np.log(collective_times(_with_links(system, *unpack(x)), fit) / t), x0, (lo, hi))
    links, factors = unpack(x)
    best = max(e for e, _ in factors.values())
    quickest = factors["send"][1] if "send" in factors else min(f for _, f in factors.values())
    links = {cls: (bw * best, lat * quickest) for cls, (bw, lat) in links.items()}
    factors = {op: (min(1.0, e / best), f / quickest) for op, (e, f) in factors.items()}
    return links, factors


def neighbour_check(fit, held):
    """A model-free look at the measurements' own scatter: each point predicted from the fitted
    points of the same operation, dtype and group nearest in size below and above it (log-log
    interpolation; the one neighbour's time at the ends), leaving the point itself out. The
    MAPE this reaches is about the floor any smooth model of size can reach on these points."""
    series: dict = {}
    for r in fit:
        series.setdefault((r["op"], r["dtype"], tuple(r["group"])), []).append(r)
    for rows in series.values():
        rows.sort(key=lambda r: r["nbytes"])

    def guess(r):
        rows = [x for x in series.get((r["op"], r["dtype"], tuple(r["group"])), []) if x is not r]
        below = [x for x in rows if x["nbytes"] < r["nbytes"]]
        above = [x for x in rows if x["nbytes"] > r["nbytes"]]
        if not below and not above:
            return None
        if not below or not above:
            return (below or above)[-1 if below else 0]["_t"]
        a, b = below[-1], above[0]
        w = math.log(r["nbytes"] / a["nbytes"]) / math.log(b["nbytes"] / a["nbytes"])
        return math.exp((1 - w) * math.log(a["_t"]) + w * math.log(b["_t"]))

    def errors(rows):
        pairs = [(guess(r), r["_t"]) for r in rows]
        pairs = [(p, t) for p, t in pairs if p is not None]
        return mape([p for p, _ in pairs], [t for _, t in pairs]), len(pairs)

    return Quality("collectives, model-free (each point from its neighbour sizes)",
                   *errors(fit), *errors(held))


def repetition_spread(records) -> str | None:
    """How far the repetitions of collective points spread (median / min per point, the median of
    that over points, by size band): 1 on a quiet machine."""
    bands = ((16 << 10, "up to 16 KiB"), (1 << 20, "to 1 MiB"), (16 << 20, "to 16 MiB"), (math.inf, "above"))
    ratios: dict = {}
    errors = []
    for r in records:
        stats = r.get("stats", {})
        low, mid = stats.get("min_s"), stats.get("median_s")
        if isinstance(low, (int, float)) and isinstance(mid, (int, float)) and low > 0:
            label = next(name for top, name in bands if r["nbytes"] <= top)
            ratios.setdefault(label, []).append(mid / low)
        mean, std, n = stats.get("mean_s"), stats.get("std_s"), stats.get("repeats")
        if all(isinstance(x, (int, float)) for x in (mean, std, n)) and mean > 0 and n > 1:
            errors.append(std * math.sqrt(n / (n - 1)) / math.sqrt(n) / mean)  # std_s is the population's
    if not ratios:
        return None
    parts = [f"{float(np.median(ratios[name])):.2f} {name}" for _, name in bands if name in ratios]
    floor = (f"; each point's mean is known to {100 * float(np.median(errors)):.1f}% at best (standard error over "
             f"single repetitions, median over points: repetitions that come in runs of one mode make it look "
             f"smaller than it is), a floor under any held-out error" if errors else "")
    return ("collective repetitions, median / min of each point (median over points): " + ", ".join(parts)
            + " (1 on a quiet machine)" + floor)


def _algorithm_rules():
    try:
        from perfsim.spec.system import ALGORITHMS
    except ImportError:  # a perfsim without collectives.algorithm
        return ()
    return ALGORITHMS


def _without_operation_factors(system):
    from perfsim.spec.system import OPERATION_TABLE_DEFAULTS

    return with_fields(system, collectives={table: () for table in OPERATION_TABLE_DEFAULTS})


STEP_TIMING = COLLECTIVE_TIMINGS[0]  # collectives timed as a step issues them: alone, right after compute
STEP_OVERHEAD_MAX_BYTES = 16 << 20  # above this, the repetitions' spread is bandwidth noise, not a wait


def _step_overheads(fit, ops=COLLECTIVE_OPS) -> dict:
    """{op: seconds} a call pays inside a step beyond the link model's time. The link model is fitted
    on the chosen statistic (the fastest repetition by default); a step's time is the sum of its
    calls, so what it pays on average per call is the mean. Measured where collectives were timed
    as a step issues them (right after compute), as the median over an operation's points up to
    STEP_OVERHEAD_MAX_BYTES of (mean - fitted statistic); nothing where the fit is the mean itself."""
    out = {}
    for op in ops:
        gaps = [r["stats"]["mean_s"] - r["_t"] for r in fit if r["op"] == op and r.get("timing") == STEP_TIMING
                and r["nbytes"] <= STEP_OVERHEAD_MAX_BYTES and isinstance(r["stats"].get("mean_s"), (int, float))]
        if len(gaps) >= 3:
            wait = max(0.0, float(np.median(gaps)))
            if wait > 0:
                out[op] = (wait, len(gaps))
    return out


ALL_TO_ALL = "all_to_all"


def _with_all_to_all(system, factors: tuple):
    """`system` with all_to_all's (efficiency, latency factor, step overhead) in its per-operation
    tables; the other operations' entries kept."""
    tables = {}
    for table, value in zip(("operation_efficiency", "operation_latency_factor", "operation_step_overhead_s"), factors):
        kept = tuple((op, v) for op, v in getattr(system.collectives, table) if op != ALL_TO_ALL)
        tables[table] = kept + ((ALL_TO_ALL, value),)
    return with_fields(system, collectives=tables)


def fit_all_to_all(records, system, ledger) -> tuple:
    """(values, quality rows, notes) of the all-to-all points (expert parallelism's dispatch,
    validate.microbench.EXPERT_COLLECTIVES) on the link classes `system` holds, fitted from the
    other collectives and kept as they are: the operation's efficiency and latency factor, fitted
    to the points as the other operations' are (log residuals, topology.all_to_all_line as the
    link model), the efficiency at most 1 (the link class's bandwidth is what the fastest operation
    reaches), and its step overhead as theirs (_step_overheads). The other collectives' numbers do
    not move (docs/equations.md 12.3)."""
    from perfsim.cost.topology import clear_caches

    rows = [r for r in records if r["op"] == ALL_TO_ALL and r.get("group") and r["group"][0] > 1]
    if not rows:
        return {}, [], []
    fit, held = split_held_out(rows, "collective", (ALL_TO_ALL,))
    links_alone = _with_all_to_all(system, (1.0, 1.0, 0.0))

    def row(name, model):
        clear_caches()
        return Quality(name, mape(collective_times(model, fit), measured_times(fit)) if fit else float("nan"), len(fit),
                       mape(collective_times(model, held), measured_times(held)) if held else float("nan"), len(held))

    quality = [row("all-to-all (the link classes alone, no operation factors)", links_alone)]
    if len(fit) < 2:
        return {}, quality, ["all-to-all: fewer than 2 fitted points, nothing fitted"]
    t = measured_times(fit)
    x = least_squares(lambda x: np.log(collective_times(_with_all_to_all(system, (math.exp(x[0]), math.exp(x[1]), 0.0)),
                                                        fit) / t),
                      [math.log(0.5), 0.0], ([_FACTOR_BOUNDS[0][0]] * 2, [0.0, _FACTOR_BOUNDS[1][1]]))  # x0 inside
    e, f = math.exp(x[0]), math.exp(x[1])
    wait = _step_overheads(fit, (ALL_TO_ALL,)).get(ALL_TO_ALL)
    model = _with_all_to_all(system, (e, f, 0.0))
    quality.insert(0, row("all-to-all (profile: the link classes x fitted all_to_all factors)", model))
    where = (f"fitted to {len(fit)} all-to-all points of ledger {ledger} on the link classes fitted from the other "
             f"collectives, through perfsim.cost.topology.all_to_all_line")
    values = {f"collectives.operation_efficiency.{ALL_TO_ALL}": Fitted(
                  e, f"all_to_all's bandwidth over the link model's (topology.all_to_all_line); {where}"),
              f"collectives.operation_latency_factor.{ALL_TO_ALL}": Fitted(
                  f, f"all_to_all's latency over the link model's one link latency; {where}")}
    notes = [f"all_to_all: efficiency {e:.3g}, latency factor {f:.3g}"]
    if wait:
        values[f"collectives.operation_step_overhead_s.{ALL_TO_ALL}"] = Fitted(
            wait[0], f"all_to_all: median over {wait[1]} points up to {STEP_OVERHEAD_MAX_BYTES >> 20} MiB, timed right "
                     f"after compute as a step issues them, of each point's mean repetition less the link model's "
                     f"(fitted) repetition; ledger {ledger}")
        notes.append(f"all_to_all step overhead per call (mean less fitted repetition): {1e3 * wait[0]:.2f} ms")
        stepped = _with_all_to_all(system, (e, f, wait[0]))
        means = lambda rs: np.array([r["stats"].get("mean_s", r["_t"]) for r in rs], float)  # noqa: E731
        clear_caches()
        quality.append(Quality("all-to-all in a step (profile with its step overhead) vs each point's mean",
                               mape(collective_times(stepped, fit), means(fit)), len(fit),
                               mape(collective_times(stepped, held), means(held)) if held else float("nan"), len(held)))
    clear_caches()
    return values, quality, notes


def fit_collectives(records, system, ledger):
    from perfsim.cost.topology import clear_caches

    a2a = [r for r in records if r["op"] == ALL_TO_ALL]
    records = [r for r in records if r["op"] != ALL_TO_ALL]  # fitted after, on the links the others give
    values, quality, notes = {}, [], []
    fit, held = split_held_out(records, "collective")
    if len(fit) < 2:  # the all-to-all points alone: fitted on the base profile's link classes
        values, quality, notes = fit_all_to_all(a2a, system, ledger)
        return values, quality, notes, with_values(system, values) if values else system
    classes = sorted({link_class(system, *r["group"]) for r in fit + held}, key=list(_CLASS_KEYS).index)
    plain = _without_operation_factors(system)
    # The profile's algorithm rule (collectives.algorithm) is fitted too: each rule the model knows,
    # the base profile's first, is fitted in turn; the one that fits the fitted points best wins.
    base_rule = getattr(system.collectives, "algorithm", None)
    rules = [base_rule] + [a for a in _algorithm_rules() if a != base_rule] if base_rule else [None]
    best, tried = None, []
    for rule in rules:
        candidate = with_fields(plain, collectives={"algorithm": rule}) if rule else plain
        links = _fit_links(candidate, fit, classes)
        error = mape(collective_times(_with_links(candidate, links), fit), measured_times(fit))
        tried.append(f"{rule} {100 * error:.1f}%")
        if best is None or error < best[0] - 0.005:  # a clear improvement over the base rule
            best = (error, rule, candidate, links)
    _, rule, plain, class_links = best
    if len(tried) > 1:
        notes.append(f"collective algorithm rules, fit MAPE: {', '.join(tried)}; kept {rule}")
    if rule != base_rule:
        values["collectives.algorithm"] = Fitted(rule, f"the algorithm rule whose fit matches the {len(fit)} fitted "
                                                       f"collective points of ledger {ledger} best")

    def row(name, model, f, h, target=None, note=""):
        return Quality(name, mape(collective_times(model, f), measured_times(f)), len(f),
                       mape(collective_times(model, h), measured_times(h)) if h else float("nan"), len(h), target, note)

    ops = [op for op in COLLECTIVE_OPS if any(r["op"] == op for r in fit)]
    classes_only = _with_links(plain, class_links)
    if len(ops) > 1:
        # What the profile holds: the link classes and one (efficiency, latency factor) per operation.
        fitted, factors = _fit_operations(plain, fit, classes, class_links)
        model = _with_links(plain, fitted, factors)
        quality.append(row("collectives (profile: per link class x per-operation factors)", model, fit, held,
                           TARGETS["collective"]))
        for op in ops:
            quality.append(row(f"  {op}", model, [r for r in fit if r["op"] == op], [r for r in held if r["op"] == op]))
        quality.append(row("collectives (link classes alone, no operation factors)", classes_only, fit, held))
        where = (f"fitted with the link classes' bandwidth and latency over {len(fit)} collective points of "
                 f"ledger {ledger} through perfsim.cost.topology")
        fastest = max(ops, key=lambda op: factors[op][0])
        reference = "send/recv" if "send" in factors else min(ops, key=lambda op: factors[op][1])
        for op in ops:
            e, f = factors[op]
            bandwidths = ", ".join(f"{bw * e / 1e9:.3g} GB/s on {cls} links" for cls, (bw, _) in fitted.items())
            latencies = ", ".join(f"{lat * f * 1e6:.3g} us per step on {cls} links" for cls, (_, lat) in fitted.items())
            values[f"collectives.operation_efficiency.{op}"] = Fitted(
                e, f"{op}'s bus bandwidth ({bandwidths}) over the link class's, which is the fastest measured "
                   f"operation's ({fastest}: 1); {where}")
            values[f"collectives.operation_latency_factor.{op}"] = Fitted(
                f, f"{op}'s latency ({latencies}) over the link class's, which is one {reference} message's "
                   f"(factor 1); {where}")
            notes.append(f"{op}: efficiency {e:.3g}, latency factor {f:.3g} ({bandwidths}; {latencies})")
    else:
        fitted, factors, model = class_links, {}, classes_only
        quality.append(row("collectives (profile: one bandwidth and latency per link class)", model, fit, held,
                           TARGETS["collective"]))
    waits = _step_overheads(fit)
    if waits:
        for op, (wait, n) in waits.items():
            values[f"collectives.operation_step_overhead_s.{op}"] = Fitted(
                wait, f"{op}: median over {n} points up to {STEP_OVERHEAD_MAX_BYTES >> 20} MiB, timed right after "
                      f"compute as a step issues them, of each point's mean repetition less the link model's "
                      f"(fitted) repetition; ledger {ledger}")
        notes.append("step overhead per call (mean less fitted repetition): "
                     + ", ".join(f"{op} {1e3 * w:.2f} ms" for op, (w, _) in waits.items()))
        stepped = with_fields(model, collectives={"operation_step_overhead_s": tuple(
            (op, waits[op][0]) for op in COLLECTIVE_OPS if op in waits)})
        means = lambda rows: np.array([r["stats"].get("mean_s", r["_t"]) for r in rows], float)  # noqa: E731
        quality.append(Quality("collectives in a step (profile with step overheads) vs each point's mean",
                               mape(collective_times(stepped, fit), means(fit)), len(fit),
                               mape(collective_times(stepped, held), means(held)) if held else float("nan"), len(held)))
    quality.append(neighbour_check(fit, held))
    spread = repetition_spread(fit + held)
    if spread:
        notes.append(spread)
    # Split each class's bus bandwidth into link bandwidth and efficiency.
    p2p = {}
    for cls in classes:
        rows = [r for r in fit if r["op"] == "send" and link_class(system, *r["group"]) == cls]
        if len(rows) >= 2:
            p2p[cls] = (fitted[cls][0] * factors["send"][0] if "send" in factors
                        else _fit_links(classes_only, rows, [cls])[cls][0])
    for cls in classes:
        bw_key, lat_key, eff_key = _CLASS_KEYS[cls]
        bus, lat = fitted[cls]
        base_bw = getattr(getattr(system, bw_key.split(".")[0]), bw_key.split(".")[1])
        base_kind = system.provenance.get(bw_key, ("assumed", ""))[0]
        n = sum(1 for r in fit if link_class(system, *r["group"]) == cls)
        where = f"{n} collective measurements on {cls} links in ledger {ledger}, fitted through perfsim.cost.topology"
        if factors:
            where += " with per-operation factors"
        if base_kind != "assumed" and bus <= base_bw:
            link_bw, how = base_bw, f"base profile's {bw_key} ({base_kind}) kept"
        elif cls in p2p:
            link_bw = max(p2p[cls], bus)
            how = "point-to-point (send/recv chain) bandwidth"
            values[bw_key] = Fitted(link_bw, f"send/recv between neighbours, {where}")
        else:
            link_bw, how = bus, "no independent link figure: efficiency folded into the bandwidth"
            values[bw_key] = Fitted(link_bw, f"bus bandwidth of {where}")
        values[eff_key] = Fitted(min(1.0, bus / link_bw),
                                 f"bus bandwidth {bus / 1e9:.4g} GB/s / link {link_bw / 1e9:.4g} GB/s ({how}); {where}")
        values[lat_key] = Fitted(lat, "per ring step" + (" (one send/recv message)" if "send" in factors else "")
                                      + f", {where}")
    system = with_values(system, values)
    clear_caches()
    a2a_values, a2a_quality, a2a_notes = fit_all_to_all(a2a, system, ledger)
    if a2a_values:
        values.update(a2a_values)
        system = with_values(system, a2a_values)
        clear_caches()
    return values, quality + a2a_quality, notes + a2a_notes, system
