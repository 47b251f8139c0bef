"""A small discrete-event engine: tasks with dependencies, and transfers that share links.

A task starts as soon as every task it depends on has finished (or, for a timer dependency, a
given time after a task has started): streams are expressed as dependencies on the previous task of
the stream, so the engine itself knows nothing about stages or streams. A task runs `work` seconds
of its own, then, if it has links, a transfer of `tail` seconds (its time alone on those links):
a pass followed by its blocking pipeline send is one task.

While a transfer overlaps transfers of other classes on one of its links, it progresses at 1/k of
its own rate, k the largest number of classes active on any of its links (equal shares of a link
between, say, pipeline and data-parallel traffic; transfers of one class already share the link
inside their own time, which the cost layer computes with every group of that dimension
communicating at once). This is max-min fairness when the overlapping transfers use the same
links, and a little pessimistic otherwise.

`run(graph)` returns start and end times, and for every task the task whose finish (or start, for
timers) let it start last: following that link backwards from the last task gives the critical path.
"""

from __future__ import annotations

import heapq
import math

FINISH, TRANSFER, RELEASE = 0, 1, 2


class Graph:
    """Tasks as parallel lists (one entry per task id), cheap to build by the hundred thousand."""

    def __init__(self):
        self.work: list = []      # seconds of the task's own (compute, or a transfer on no shared link)
        self.tail: list = []      # seconds of a transfer on `links` after that (alone on them)
        self.succ: list = []      # tasks waiting for this one to finish (None: none)
        self.npred: list = []     # dependencies each task waits for
        self.links: list = []     # None, or the link ids of the tail transfer
        self.cls: list = []       # traffic class of the tail transfer
        self.timers: dict = {}    # task -> [(task released `offset` s after it starts, offset)]

    def __len__(self):
        return len(self.work)

    def add(self, work: float, deps=(), links=None, cls: int = 0, tail: float = 0.0) -> int:
        """A task that starts when every task in `deps` (ids; negative ones are ignored) has
        finished; without links a tail is just more work."""
        t = len(self.work)
        if links is None:
            self.work.append(work + tail)
            self.tail.append(0.0)
        else:
            self.work.append(work)
            self.tail.append(tail)
        self.succ.append(None)
        self.links.append(links)
        self.cls.append(cls)
        succ = self.succ
        n = 0
        for d in deps:
            if d >= 0:
                s = succ[d]
                if s is None:
                    succ[d] = [t]
                else:
                    s.append(t)
                n += 1
        self.npred.append(n)
        return t

    def after(self, prev: int, work: float, links=None, cls: int = 0, tail: float = 0.0) -> int:
        """`add` for the common case of one dependency (`prev`, ignored when negative)."""
        return self.add(work, (prev,), links, cls, tail)

    def depend(self, task: int, on: int) -> None:
        """`task` also waits for `on` to finish."""
        s = self.succ[on]
        if s is None:
            self.succ[on] = [task]
        else:
            s.append(task)
        self.npred[task] += 1

    def after_start(self, task: int, on: int, offset: float) -> None:
        """`task` also waits until `offset` s after `on` starts."""
        self.timers.setdefault(on, []).append((task, offset))
        self.npred[task] += 1


def run(graph: Graph):
    """(start, end, cause) per task. Raises RuntimeError if some task can never start."""
    work, tail, succ, links, cls, timers = graph.work, graph.tail, graph.succ, graph.links, graph.cls, graph.timers
    n = len(work)
    npred = list(graph.npred)
    start = [math.nan] * n
    end = [math.nan] * n
    cause = [-1] * n
    heap: list = []
    push, pop = heapq.heappush, heapq.heappop
    seq = 0
    # transfers in flight: per link, the active transfers and how many of each class
    on_link: dict = {}
    classes: dict = {}
    rate = [1.0] * n
    left = [0.0] * n
    stamp = [0.0] * n
    version = [0] * n

    def reschedule(x, now):
        nonlocal seq
        k = 1
        for r in links[x]:
            if len(classes[r]) > k:
                k = len(classes[r])
        rate[x] = 1.0 / k
        version[x] += 1
        seq += 1
        push(heap, (now + left[x] * k, seq, FINISH, x, version[x]))

    def slow_down(others, now):
        """Transfers whose links gained or lost a class: account their progress, then re-time them."""
        for x in others:
            left[x] = max(left[x] - rate[x] * (now - stamp[x]), 0.0)
            stamp[x] = now
        for x in others:
            reschedule(x, now)

    def transfer(t, now):
        changed = None
        c = cls[t]
        for r in links[t]:
            counts = classes.get(r)
            if counts is None:
                counts = classes[r] = {}
                on_link[r] = set()
            n_c = counts.get(c)
            if n_c is None:
                if counts:  # other classes on this link: they now share it with one more
                    if changed is None:
                        changed = set()
                    changed.update(on_link[r])
                counts[c] = 1
            else:
                counts[c] = n_c + 1
            on_link[r].add(t)
        if changed:
            slow_down(changed, now)
        left[t], stamp[t] = tail[t], now
        reschedule(t, now)

    def begin(t, now, via):
        nonlocal seq
        start[t] = now
        cause[t] = via
        released = timers.get(t)
        if released:
            for u, offset in released:
                if offset <= 0.0:
                    npred[u] -= 1
                    if npred[u] == 0:
                        begin(u, now, t)
                else:
                    seq += 1
                    push(heap, (now + offset, seq, RELEASE, u, t))
        seq += 1
        if links[t] is None:
            push(heap, (now + work[t], seq, FINISH, t, 0))
        elif work[t] > 0.0:
            push(heap, (now + work[t], seq, TRANSFER, t, 0))
        else:
            transfer(t, now)

    for t in range(n):
        if npred[t] == 0:
            begin(t, 0.0, -1)

    while heap:
        now, _, kind, t, extra = pop(heap)
        if kind == RELEASE:
            npred[t] -= 1
            if npred[t] == 0:
                begin(t, now, extra)
            continue
        if kind == TRANSFER:
            transfer(t, now)
            continue
        ls = links[t]
        if ls is not None:
            if extra != version[t]:
                continue  # re-timed since
            changed = None
            c = cls[t]
            for r in ls:
                on_link[r].discard(t)
                counts = classes[r]
                n_c = counts[c] - 1
                if n_c:
                    counts[c] = n_c
                else:
                    del counts[c]
                    if counts:  # the other classes on this link get a larger share
                        if changed is None:
                            changed = set()
                        changed.update(on_link[r])
            if changed:
                slow_down(changed, now)
        end[t] = now
        waiting = succ[t]
        if waiting is not None:
            for u in waiting:
                npred[u] -= 1
                if npred[u] == 0:
                    begin(u, now, t)

    stuck = sum(1 for k in npred if k > 0)
    if stuck:
        raise RuntimeError(f"{stuck} tasks never became ready: the schedule's dependencies form a cycle")
    return start, end, cause
