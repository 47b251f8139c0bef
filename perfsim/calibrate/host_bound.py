"""Device time out of microbenchmarks on a device that runs kernels asynchronously (GPUs).

A GPU runs the kernels the host queues while the host goes on: back-to-back calls of one op
(validate.microbench.repetitions, `number` calls between two device events) take the longer of
the host's time per call (Python, torch's dispatch, the launch) and the device's time per kernel.
The host's share is no property of the kernel: a training step issues the same kernel from other
Python, and its own host time is measured on real steps (perfsim.calibrate.overheads). So on such
a device a small kernel's points sit on a floor, the host's time per call of that op (on the H200
of the shared ledger 7 us for a copy, 11 us for a matmul from a lambda, 19 us for
scaled_dot_product_attention, about 95 us for an autograd.grad call), and only points clearly
above their op's floor say how long the kernel runs:

- an op's floor is found where it is flat: the points within FLAT of the op's fastest, if their
  sizes (FLOPs or bytes) span at least FLAT_SPAN; an op with no flat region has no floor;
- points timed back to back below HOST_BOUND x the floor are the host's, left out of every fit
  and table (they bound the kernel's time from above, no more);
- a point timed one call per repetition (a first call past validate.microbench.LONG_CALL_S, often
  one-off setup, not a long kernel) spans the host's dispatch of the call as well as the kernel,
  since the start event was recorded before the host began it: its median (not its mean: the
  repetitions after a one-off first call still carry warm-up) less the floor is the kernel's. Where
  even its fastest repetition took under SINGLE_CALL x the floor, the host's share (which for a
  call right after recording an event is larger and more erratic than back to back: the shared
  H200 ledger's 8 x 512 flash backward took 133-484 us) leaves nothing to read: it is left out;
- the host's time per call is no one number: on the shared H200 ledger a matmul's ran 10.5-50 us
  (the same sweep's 128 x 128 x 4096 at 15 us, 2048 x 128 x 512 at 46 us, 2048 x 512 x 512 at
  11 us), so points at 1.5-4 x the fastest floor can still be the host's. A GEMM's problem holds
  every smaller one it contains (each of count, m, n and k at least as large): its kernel cannot
  finish that work in less time than the smaller kernel takes. So a GEMM point timed back to back
  is the host's where a GEMM containing it, with CONTAINED_WORK x its FLOPs or more, took no more
  than FLAT x its time (left out too: on the shared ledger 34 of the 149 above the floor, at
  17-50 us, which had held the curve fit at 23%).

A CPU rank runs its kernels itself: nothing is changed there (the fitted kernel overhead is then
the host's and the device's at once, which is what a CPU step pays per kernel).
"""

from __future__ import annotations

import numpy as np

ASYNCHRONOUS_KINDS = ("cuda", "xpu")
COMPUTE_SUITES = ("gemm", "memory", "attention")
FLAT = 1.15  # points this close to an op's fastest time sit on the same floor
FLAT_SPAN = 4.0  # ... when their sizes differ this much: their time does not follow their size
HOST_BOUND = 1.5  # below this multiple of the floor the host's time still shapes a point
SINGLE_CALL = 3.0  # ... and a single call's, whose host share is larger and erratic
CONTAINED_WORK = 2.0  # a GEMM containing another with this many times its FLOPs ...


def _size(record: dict) -> float:
    """What an op's time grows with: its FLOPs (GEMMs, attention) or bytes (element-wise)."""
    return float(record.get("flops") or record.get("nbytes") or 0.0)


def _single_call(record: dict) -> bool:
    return record["stats"].get("number", 2) == 1


def host_floor(records: list) -> float | None:
    """The host's seconds per call of one op (the records of one suite, op and dtype, each with
    its fitted time under "_t"), from its points timed back to back; None where it has no flat
    region."""
    timed = [(r["_t"], _size(r)) for r in records if not _single_call(r) and _size(r) > 0]
    if len(timed) < 2:
        return None
    fastest = min(t for t, _ in timed)
    flat = [(t, size) for t, size in timed if t <= FLAT * fastest]
    sizes = [size for _, size in flat]
    if len(flat) < 2 or max(sizes) < FLAT_SPAN * min(sizes):
        return None
    return float(np.median([t for t, _ in flat]))


def _gemm_dims(record: dict) -> tuple:
    shape = record["shape"]
    return shape.get("count", 1), shape["m"], shape["n"], shape["k"]


def contained_host_bound(records: list) -> set:
    """Indices of the GEMM `records` (one op and dtype, each with "_t") timed back to back whose
    time is the host's: a GEMM containing theirs (every dimension at least as large) with
    CONTAINED_WORK x their FLOPs or more took no more than FLAT x their time (module docstring)."""
    timed = [(i, _gemm_dims(r), _size(r), r["_t"]) for i, r in enumerate(records) if not _single_call(r)]
    out = set()
    for i, dims, size, t in timed:
        for j, other, other_size, other_t in timed:
            if (j != i and other_size >= CONTAINED_WORK * size and other_t <= FLAT * t
                    and all(a >= b for a, b in zip(other, dims))):
                out.add(i)
                break
    return out


def device_times(records: list, kind: str) -> tuple:
    """(records with the device's times, notes): on an asynchronous device kind, each compute op's
    host-bound points left out and its single-call points less the host's floor (module
    docstring); elsewhere the records unchanged."""
    if kind not in ASYNCHRONOUS_KINDS:
        return records, []
    groups: dict = {}
    for r in records:
        if r["suite"] in COMPUTE_SUITES:
            groups.setdefault((r["suite"], r["op"], r["dtype"]), []).append(r)
    dropped, floors, out = {}, {}, []
    for r in records:
        key = (r["suite"], r["op"], r["dtype"])
        if key not in groups:
            out.append(r)
            continue
        if key not in floors:
            floors[key] = host_floor(groups[key])
        floor = floors[key]
        if floor is None:
            out.append(r)
        elif _single_call(r):
            if r["stats"]["min_s"] >= SINGLE_CALL * floor:
                out.append({**r, "_t": r["stats"]["median_s"] - floor})
            else:
                dropped[key] = dropped.get(key, 0) + 1
        elif r["_t"] < HOST_BOUND * floor:
            dropped[key] = dropped.get(key, 0) + 1
        else:
            out.append(r)
    contained = {}  # GEMMs above the floor whose time is still the host's: a containing GEMM ran as fast
    for key in sorted({(r["suite"], r["op"], r["dtype"]) for r in out if r["suite"] == "gemm"}):
        group = [r for r in out if (r["suite"], r["op"], r["dtype"]) == key]
        left_out = contained_host_bound(group)
        if left_out:
            contained[key] = len(left_out)
            drop = {id(group[i]) for i in left_out}
            out = [r for r in out if id(r) not in drop]
    found = {key: floor for key, floor in floors.items() if floor is not None}
    if not found and not contained:
        return out, []
    listed = ", ".join(f"{op} {floor * 1e6:.3g} us ({dropped.get((suite, op, dtype), 0)} of "
                       f"{len(groups[(suite, op, dtype)])} left out)" for (suite, op, dtype), floor in found.items())
    notes = [f"{kind} runs kernels asynchronously: each op's points below {HOST_BOUND:g} x its host floor (the "
             f"host's time per call, where the op's time does not follow its size) are the host's, not the "
             f"kernel's, and are left out of the fits and tables; points timed one call at a time are taken "
             f"less the floor (perfsim.calibrate.host_bound): {listed}"] if found else []
    notes += [f"{op} {dtype}: {count} more points above the floor left out as the host's, a GEMM containing "
              f"each (every dimension at least as large, {CONTAINED_WORK:g} x its FLOPs or more) having run in "
              f"no more than {FLAT:g} x its time (perfsim.calibrate.host_bound)"
              for (suite, op, dtype), count in contained.items()]
    return out, notes
