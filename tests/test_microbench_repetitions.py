"""validate.microbench.repetitions: how many calls a point costs. A call slower than LONG_CALL_S
is its own warm-up and is repeated only while the point stays within LONG_POINT_S (at least
LONG_REPEATS times): a machine far slower than the sweep was sized for (bf16 GEMMs on an AVX2 CPU:
1 GFLOP/s) must not turn a calibration into hours. Faster calls are timed as before."""

from __future__ import annotations

import statistics

import pytest

from validate import microbench as mb


class Clock:
    def __init__(self):
        self.now = 0.0


class FakeTimer:
    def __init__(self, clock):
        self.clock = clock

    def start(self):
        self.t0 = self.clock.now

    def stop(self):
        return self.clock.now - self.t0


class FakeDevice:
    def __init__(self, clock):
        self.clock = clock

    def sync(self):
        pass

    def timer(self):
        return FakeTimer(self.clock)


def run(call_s: float, warmup: int = 2, repeats: int = 5, agree=None):
    clock, calls = Clock(), []

    def fn():
        calls.append(clock.now)
        clock.now += call_s
    times, number, _ = mb.repetitions(FakeDevice(clock), fn, warmup, repeats, 2e-3, agree=agree)
    return times, number, len(calls), clock.now


@pytest.mark.parametrize("call_s", [0.6, 1.5, 17.0])
def test_a_long_call_is_its_own_warm_up_and_the_point_stays_short(call_s):
    times, number, calls, spent = run(call_s)
    assert number == 1
    assert len(times) == max(mb.LONG_REPEATS, min(5, int(mb.LONG_POINT_S / call_s)))
    assert calls == 1 + len(times)  # no warm-up beyond the first, timed call
    assert times == pytest.approx([call_s] * len(times))
    assert spent <= max(mb.LONG_POINT_S + call_s, (1 + mb.LONG_REPEATS) * call_s) + 1e-9


def test_a_short_call_is_warmed_up_and_batched_as_before():
    times, number, calls, _ = run(1e-4, warmup=2, repeats=5)
    assert number == 20  # 2 ms per repetition at 0.1 ms a call
    assert calls == 1 + 1 + 1 + number * len(times)  # first call, one more warm-up, the estimate, the repetitions
    assert len(times) >= 5


def test_a_gpu_call_whose_first_run_was_setup_is_timed_as_the_short_call_it_is():
    """On a GPU a first call of seconds is mostly one-off setup (lazy module loading, a kernel
    plan): a second call decides, and a 70 us kernel is batched like any short call instead of
    being timed one call at a time with its warm-up (perfsim.calibrate.host_bound)."""
    clock, calls = Clock(), []

    def fn():
        clock.now += 1.2 if not calls else 7e-5
        calls.append(clock.now)
    device = FakeDevice(clock)
    device.kind = "cuda"
    times, number, _ = mb.repetitions(device, fn, 2, 5, 2e-3)
    assert number > 1 and times == pytest.approx([7e-5] * len(times))


def test_ranks_agree_on_the_slowest_first_call():
    """Collectives must make the same calls on every rank: the decision uses the agreed time."""
    _, number, _, _ = run(0.1, agree=lambda seconds: 0.9)
    assert number == 1


def test_the_collective_burst_is_sized_in_seconds_not_in_a_shape():
    """The compute before an interleaved collective lasts BURST_SECONDS on any machine: a 512-row
    GEMM that took 0.4 s (bf16 on an AVX2-only CPU) shrinks to the 16-row floor, one that took
    0.3 ms grows 10x, and a zero timer reading keeps the shape."""
    from validate.microbench import burst_rows

    assert burst_rows(512, 0.4, 3e-3) == 16
    assert burst_rows(512, 3e-4, 3e-3) == 5120
    assert burst_rows(512, 1e-9, 3e-3) == 64 * 512
    assert burst_rows(512, 0.0, 3e-3) == 512
    assert burst_rows(512, 6e-3, 3e-3) == 256


def bimodal_run(more, seed: int = 0, repeats: int = 5):
    """A collective like gloo's on a shared CPU: 0.3 ms, or 4 ms when a scheduler tick intervenes
    (40% of calls); one call per repetition, as interleaved collectives are timed."""
    import random

    clock, rng = Clock(), random.Random(seed)

    def fn():
        clock.now += 4e-3 if rng.random() < 0.4 else 3e-4
    times, _, _ = mb.repetitions(FakeDevice(clock), fn, 2, repeats, 2e-3, max_number=1, max_repeats_factor=1,
                                 more=more)
    return times


def test_scattered_calls_are_repeated_until_their_mean_is_precise():
    """The mean is what a step pays per call; at the planned repetitions a bimodal call's mean is
    off by tens of percent, repeated until its standard error is COLLECTIVE_PRECISION it is close."""
    true_mean = 0.4 * 4e-3 + 0.6 * 3e-4
    planned = [bimodal_run(None, seed) for seed in range(20)]
    precise = [bimodal_run(lambda t: mb.relative_standard_error(t) > mb.COLLECTIVE_PRECISION, seed) for seed in range(20)]
    assert all(len(t) == 5 for t in planned)
    assert all(len(t) > 5 and len(t) % 5 == 0 and mb.relative_standard_error(t) <= mb.COLLECTIVE_PRECISION
               for t in precise)
    err = lambda runs: max(abs(sum(t) / len(t) / true_mean - 1) for t in runs)  # noqa: E731
    assert err(planned) > 0.3
    assert err(precise) < 0.15


def test_steady_calls_stop_at_the_planned_repetitions():
    asked = []
    times, number, _ = mb.repetitions(FakeDevice(Clock()), lambda: None, 2, 5, 2e-3, max_number=1,
                                      more=lambda t: asked.append(len(t)) or False)
    assert asked == [len(times)] and len(times) >= 5


def test_relative_standard_error():
    assert mb.relative_standard_error([1.0]) == float("inf")
    assert mb.relative_standard_error([1.0, 1.0, 1.0]) == 0.0
    assert mb.relative_standard_error([1.0, 3.0]) == pytest.approx(2 ** 0.5 / 2 ** 0.5 / 2)


class EchoComm:
    """One rank's view of a world whose ranks all timed the same values."""

    def __init__(self):
        self.agreed = []

    def max_each(self, values):
        return list(values)

    def agree_max(self, value):
        self.agreed.append(value)
        return value


def test_the_campaign_asks_for_more_only_while_loose_and_within_budget():
    import time

    from validate.campaign import precise_mean

    comm = EchoComm()
    loose, tight = [1e-3, 4e-3] * 3, [1e-3] * 6
    assert precise_mean(comm, time.monotonic())(loose) is True
    more = precise_mean(comm, time.monotonic())
    assert more(tight) is True  # one batch is never enough (COLLECTIVE_MIN_BATCHES)
    assert more(tight * mb.COLLECTIVE_MIN_BATCHES) is False
    assert precise_mean(comm, time.monotonic() - 2 * mb.COLLECTIVE_POINT_BUDGET_S)(loose) is False
    assert comm.agreed == [1.0, 1.0, 0.0, 0.0]  # every rank's wish is agreed: one asking is enough


def test_a_batch_inside_one_run_of_calls_is_not_taken_as_precise():
    """gloo's two modes come in runs of tens of calls: a batch all in the fast mode has no scatter
    over its single calls, yet says nothing of the slow runs. The error is taken over the batches'
    means."""
    import time

    from validate.campaign import precise_mean

    fast, slow = [3e-4] * 20, [4e-3] * 20
    assert mb.relative_standard_error(fast) == 0.0  # what single calls would claim
    more = precise_mean(EchoComm(), time.monotonic())
    assert more(fast) is True
    assert more(fast + slow) is True
    assert more(fast + slow + fast) is True  # batch means 0.3, 4 and 0.3 ms: far from precise
    assert mb.relative_standard_error(fast + slow + fast, 20) == pytest.approx(
        statistics.stdev([3e-4, 4e-3, 3e-4]) / 3 ** 0.5 / statistics.fmean([3e-4, 4e-3, 3e-4]))
    assert mb.relative_standard_error(fast + slow + [1.0], 20) == mb.relative_standard_error(fast + slow, 20)


def runs_run(more, seed: int, repeats: int = 20, stay: float = 0.95, cap: int = 300):
    """A collective whose fast (0.3 ms) and slow (4 ms) modes come in runs (each call keeps the
    previous call's mode with probability `stay`: runs of 20 calls on average), timed until `more`
    is satisfied or `cap` repetitions; the repetitions' times."""
    import random

    clock, rng = Clock(), random.Random(seed)
    slow = [rng.random() < 0.5]

    def fn():
        if rng.random() > stay:
            slow[0] = not slow[0]
        clock.now += 4e-3 if slow[0] else 3e-4
    times, _, _ = mb.repetitions(FakeDevice(clock), fn, 2, repeats, 2e-3, max_number=1, max_repeats_factor=1,
                                 more=lambda t: len(t) < cap and more(t))
    return times


def test_means_of_calls_in_runs_come_closer_with_the_batch_rule():
    """Over 40 seeded series of calls in runs, single-call standard errors stop many points after
    one batch inside one run (errors of 50% and more); the batch rule keeps timing them."""
    import time

    from validate.campaign import precise_mean

    true_mean = (4e-3 + 3e-4) / 2
    single = [runs_run(lambda t: mb.relative_standard_error(t) > mb.COLLECTIVE_PRECISION, seed) for seed in range(40)]
    batched = [runs_run(precise_mean(EchoComm(), time.monotonic()), seed) for seed in range(40)]
    errors = lambda runs: [abs(statistics.fmean(t) / true_mean - 1) for t in runs]  # noqa: E731
    assert min(len(t) for t in single) == 20 and min(len(t) for t in batched) >= 60
    assert sum(e > 0.5 for e in errors(batched)) < sum(e > 0.5 for e in errors(single)) / 2
    assert statistics.median(errors(batched)) < 0.6 * statistics.median(errors(single))


def test_concurrent_rounds_go_on_until_their_mean_is_precise():
    """A concurrent point's rounds (burst, alone, both) come in batches while `more` asks."""
    import random

    clock, rng = Clock(), random.Random(1)
    comm = mb.Communicator.__new__(mb.Communicator)  # no process group: its timing logic alone
    comm.device = FakeDevice(clock)
    comm.agree_max = lambda seconds: seconds
    comm.compute_burst = lambda: None
    comm.burst_of = lambda seconds: (lambda: None)

    class Work:
        def wait(self):
            clock.now += 4e-3 if rng.random() < 0.4 else 3e-4
    comm.make = lambda point, async_op=False: (lambda: [Work()])
    point = mb.Point("collective", "all_reduce", "fp32", mb.point_shape(nbytes=1 << 16), group=(2, 1), timing="concurrent")
    once = comm.time_concurrent(point, 5, 1)
    assert {k: len(v) for k, v in once.items()} == {"burst": 5, "alone": 5, "both": 5}
    precise = comm.time_concurrent(point, 5, 1, more=lambda both: mb.relative_standard_error(both) > 0.05)
    n = len(precise["both"])
    assert n > 5 and n % 5 == 0 and len(precise["alone"]) == len(precise["burst"]) == n
    assert mb.relative_standard_error(precise["both"]) <= 0.05


def test_sizes_timed_in_turn_share_the_machine_s_modes():
    """A machine whose fast (0.3 ms) and slow (4 ms) modes last a quarter of a second, longer than
    a point's batches: timed one after the other, each size of a latency-bound collective (the
    same true time at every size) catches a mode of its own and the curve over sizes comes out
    jagged; timed in turn, one call per point per visit, every size samples the same stretch of
    time and their means agree."""
    import time

    from validate.campaign import precise_in_turn, precise_mean

    clock = Clock()

    def call():
        clock.now += 4e-3 if int(clock.now / 0.25) % 2 else 3e-4

    def burst():
        clock.now += 3e-3

    points = [mb.Point("collective", "all_gather", "fp32", mb.point_shape(nbytes=1 << k), group=(2, 1),
                       timing="interleaved") for k in range(10, 20)]
    one_by_one = [statistics.fmean(mb.repetitions(FakeDevice(clock), call, 2, 5, 2e-3, before=burst, max_number=1,
                                                  max_repeats_factor=1,
                                                  more=precise_mean(EchoComm(), time.monotonic()))[0])
                  for _ in points]
    comm = mb.Communicator.__new__(mb.Communicator)  # no process group: its timing logic alone
    comm.device, comm.compute_burst, comm.make = FakeDevice(clock), burst, lambda point: call
    comm.agree_max, comm.max_each = (lambda x: x), (lambda xs: list(xs))
    more = precise_in_turn(comm, time.monotonic(), 60.0, 5)
    in_turn = [statistics.fmean(t) for t in comm.time_in_turn(points, 5, 2, more)]
    assert max(one_by_one) / min(one_by_one) > 3  # whole points inside one mode
    assert max(in_turn) / min(in_turn) < 1.15
    assert more([[3e-4] * 15, [3e-4] * 5]) == [1]  # too few calls yet
    assert precise_in_turn(comm, time.monotonic() - 2, 1.0, 5)([[3e-4] * 5]) == []  # out of time
