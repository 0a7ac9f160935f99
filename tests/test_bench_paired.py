"""Bracketed timing (``treetrain.bench.paired``): chunks of about one tree step's work, each measured in
the tree steps around it, so a machine whose speed drifts during a long baseline step still gives the
speedup its work ratio says. The machine here is simulated: a clock that each step advances by its
work times the machine's slowness at that moment."""

from __future__ import annotations

import random

import pytest

from treetrain.bench import paired


def test_chunks_hand_written():
    assert paired.chunks([1, 1, 3, 2, 2], 3.0) == [[0, 1], [2], [3], [4]]
    assert paired.chunks([5], 1.0) == [[0]]  # a unit above the target is a chunk of its own
    assert paired.chunks([1, 1, 1, 1], 10.0) == [[0, 1, 2, 3]]
    assert paired.chunks([], 1.0) == []
    # every unit once, in order
    cut = paired.chunks([0.3, 2.0, 0.7, 0.7, 0.1, 1.5, 0.9], 1.0)
    assert [i for c in cut for i in c] == list(range(7))
    with pytest.raises(ValueError, match="target work 0"):
        paired.chunks([1.0], 0.0)


def test_bracketed_speedups_hand_written():
    assert paired.bracketed_speedups([10, 10, 20], [30, 60]) == pytest.approx(7.0)
    assert paired.bracketed_speedups([2, 2], [6]) == pytest.approx(3.0)


class DriftingMachine:
    """A fake ``time.perf_counter`` on a machine that alternates between full speed and ``slow`` times
    slower every ``phase`` seconds (0: never slows): a step of work ``w`` takes ``w`` seconds of full
    speed, integrated across the phases it spans (the 2-core VM's tree step took 50 s and 97 s within
    one hour)."""

    def __init__(self, phase: float = 0.0, slow: float = 1.8):
        self.now, self.phase, self.slow = 0.0, phase, slow

    def perf_counter(self) -> float:
        return self.now

    def _slowness(self) -> float:
        return self.slow if self.phase and int(self.now // self.phase) % 2 else 1.0

    def step(self, work: float, loss: float = 0.0):
        def run() -> float:
            left = work
            while left > 1e-12:
                end = (int(self.now // self.phase) + 1) * self.phase if self.phase else float("inf")
                dt = min(left * self._slowness(), end - self.now)
                left -= dt / self._slowness()
                self.now += dt
            return loss

        return run


PATHS = [
    0.17,
    0.17,
    0.33,
    0.33,
    0.5,
    0.5,
    0.67,
    0.67,
    0.83,
    0.83,
    1.0,
    0.7,
]  # the GUI preset's, in tree steps


def bracketed_run(machine: DriftingMachine, rounds: int = 3, **kw) -> tuple[paired.Bracketed, list]:
    """The GUI preset's shape: a tree step of work 1; a baseline of 12 paths (6.7 tree steps in all)
    in 8 chunks; a second mode of 2 chunks, 1.5 tree steps each."""
    cut = paired.chunks(PATHS, 1.0)
    modes = {
        "baseline": [machine.step(sum(PATHS[i] for i in c), loss=0.5) for c in cut],
        "other": [machine.step(1.5, loss=1.0), machine.step(1.5, loss=1.0)],
    }
    return paired.time_bracketed(
        machine.step(1.0, loss=1.0), modes, rounds, clock=machine.perf_counter, monitor=None, **kw
    ), cut


def test_a_steady_machine_gives_the_work_ratio():
    machine = DriftingMachine()
    resets, lines = [], []
    b, cut = bracketed_run(machine, 2, reset=lambda: resets.append(1), progress=lines.append)
    assert cut == [[0, 1, 2, 3], [4, 5], [6], [7], [8], [9], [10], [11]]
    assert len(resets) == 3 and len(b.tree) == 2 and all(len(t) == 9 for t in b.tree)
    assert [len(t) for t in b.times["baseline"]] == [8, 8] and [len(t) for t in b.times["other"]] == [2, 2]
    assert b.losses == {"tree": 1.0, "baseline": pytest.approx(4.0), "other": 2.0}
    assert lines[0] == "warm-up: tree step 1.0 s" and "round 2 of 2: tree step 9 of 9" in lines[-1]
    assert b.speedups("baseline") == pytest.approx([6.7, 6.7]) and b.raw("baseline") == pytest.approx(
        [6.7] * 2
    )
    assert b.speedups("other") == pytest.approx([3.0, 3.0]) and b.tree_steps() == pytest.approx([1.0, 1.0])
    assert b.bracket_drift() == pytest.approx((0.0, 0.0))
    assert b.load is None  # monitor=None: a simulated clock's run has no real time to measure
    assert paired.verdict(b, "baseline", bound=6.7)[0].startswith("baseline: 2 timed round(s)")
    b, _ = bracketed_run(DriftingMachine(), 3)
    assert b.interval("baseline") == pytest.approx((6.7, 6.7))
    assert paired.verdict(b, "baseline", bound=6.7) == []


@pytest.mark.parametrize("phase", [13.0, 20.0, 31.0, 47.0])
def test_slow_phases_longer_than_a_bracket_cancel(phase):
    """The machine 1.8x slower every other ``phase`` tree steps' time (a bracket is about 3.5): the raw
    ratio (a whole step / the median tree step) is off by over 10% in some round (up to 32%), the
    bracketed one by under 5% in every round (at most 4.3%: a bracket that straddles a change of
    speed is measured in the mean of a fast and a slow tree step), and the verdict trusts it."""
    machine = DriftingMachine(phase=phase)
    b, _ = bracketed_run(machine)
    assert max(abs(s / 6.7 - 1) for s in b.speedups("baseline")) < 0.05
    raw = [s / t / 6.7 - 1 for s, t in zip(b.raw("baseline"), b.tree_steps())]
    assert max(abs(r) for r in raw) > 0.10
    typical, worst = b.bracket_drift()
    assert typical == pytest.approx(0.0) and worst > 0.5  # a few brackets straddle a change of speed
    assert paired.verdict(b, "baseline", bound=6.7) == []


@pytest.mark.parametrize("phase", [2.0, 5.0, 8.0])
def test_phases_as_short_as_a_bracket_are_distrusted(phase):
    """Speed changing every few tree steps' time: the brackets cannot cancel it (errors up to 19%),
    and the verdict says so."""
    machine = DriftingMachine(phase=phase)
    b, _ = bracketed_run(machine)
    assert b.bracket_drift()[0] > 0.10
    reasons = paired.verdict(b, "baseline", bound=6.7)
    assert any("the tree steps around a chunk differ by" in r for r in reasons), reasons


def test_rounds_are_checked_and_reported_as_they_finish():
    machine = DriftingMachine(0.0)
    with pytest.raises(ValueError, match="at least 1 timed round"):
        paired.time_bracketed(
            machine.step(1.0), {"baseline": [machine.step(1.0)]}, 0, clock=machine.perf_counter
        )
    seen = []
    record = lambda so_far: seen.append(len(so_far.tree))  # noqa: E731
    b = paired.time_bracketed(
        machine.step(1.0), {"baseline": [machine.step(2.0)]}, 3, on_round=record, clock=machine.perf_counter
    )
    assert seen == [1, 2, 3] and b.speedups("baseline") == pytest.approx([2.0] * 3)
    assert b.load is not None and b.load.wall_s >= 0


def test_chunk_medians_resist_a_stall():
    """A stall in one chunk of one round moves that round's sum, not the per-chunk medians."""
    b = paired.Bracketed(tree=[[1.0, 1.0, 1.0]] * 3, times={"m": [[1.0, 2.0], [1.0, 1.0], [3.0, 1.0]]})
    assert b.speedups("m") == [3.0, 2.0, 4.0] and b.chunk_medians("m") == 2.0
    b = paired.Bracketed(tree=[[10.0, 10.0, 20.0]], times={"m": [[30.0, 60.0]]})
    assert b.chunk_medians("m") == pytest.approx(7.0) == b.speedups("m")[0]  # one round: the sum


def test_interval_hand_written():
    """Three rounds of two chunks: the estimate is 2; 7 of 27 equally likely draws of the rounds make it 4
    (the third round twice or more), 7 make it 3 (the first twice or more), 13 leave it 2."""
    b = paired.Bracketed(tree=[[1.0, 1.0, 1.0]] * 3, times={"m": [[1.0, 2.0], [1.0, 1.0], [3.0, 1.0]]})
    assert b.interval("m") == (2.0, 4.0) and b.interval("m", level=0.4) == (2.0, 3.0)
    assert b.interval("m", seed=1) == b.interval("m", seed=1)
    lo, hi = b.interval("m", draws=101)  # fewer draws: still values the estimator takes
    assert {lo, hi} <= {2.0, 3.0, 4.0} and lo <= 2.0 <= hi
    steady = paired.Bracketed(tree=[[1.0, 1.0, 1.0]] * 3, times={"m": [[3.0, 4.0]] * 3})
    assert steady.interval("m") == (7.0, 7.0) and paired.verdict(steady, "m", bound=7.0) == []
    assert paired.verdict(steady, "m", bound=6.0)[0].startswith("ABOVE THE BOUND: efficiency 1.17")
    assert paired.verdict(steady, "m") == []  # no bound: no efficiency to judge


class StallingMachine(DriftingMachine):
    """A machine at steady speed whose steps each run ``jitter`` apart at random and, with probability
    ``p``, stall: ``stall`` times slower (drawn per step; the 2-core VM's equal chunks took 39, 50 and
    83 s in three rounds)."""

    def __init__(self, seed: int, p: float = 0.15, stall: tuple = (1.3, 2.0), jitter: float = 0.03):
        super().__init__()
        self.rng, self.p, self.stall, self.jitter = random.Random(seed), p, stall, jitter

    def step(self, work: float, loss: float = 0.0):
        def run() -> float:
            factor = 1 + self.rng.uniform(-self.jitter, self.jitter)
            if self.rng.random() < self.p:
                factor *= self.rng.uniform(*self.stall)
            self.now += work * factor
            return loss

        return run


def test_stalls_widen_the_rounds_not_the_chunk_medians():
    """Stalls of single steps (10% of the steps 1.2-1.7x slower, the others 5% apart), 7 rounds, 40
    machines: the rounds' sums spread over 10% on most (the range rule distrusted them), the chunk
    medians stay within 5% of the work ratio on every one, the 90% interval covers it on 35, and the
    verdict trusts 33 (a seeded simulation: these counts are exact)."""
    spread, errors, covered, trusted = 0, [], 0, []
    for seed in range(40):
        b, _ = bracketed_run(StallingMachine(seed, p=0.1, stall=(1.2, 1.7), jitter=0.05), rounds=7)
        rounds = sorted(b.speedups("baseline"))
        spread += (rounds[-1] - rounds[0]) / rounds[3] > 0.10
        errors.append(abs(b.chunk_medians("baseline") / 6.7 - 1))
        lo, hi = b.interval("baseline")
        covered += lo <= 6.7 <= hi
        if paired.verdict(b, "baseline", bound=6.7) == []:
            trusted.append(errors[-1])
    assert spread == 36 and max(errors) < 0.05
    assert covered == 35 and len(trusted) == 33


def test_too_few_rounds_are_not_judged():
    b, _ = bracketed_run(DriftingMachine(), rounds=2)
    assert paired.verdict(b, "baseline", bound=6.7) == [
        "baseline: 2 timed round(s), a chunk's median needs 3 (use --repeats 3 or more)"
    ]


def test_wide_interval_and_above_the_bound_are_named():
    b = paired.Bracketed(tree=[[1.0, 1.0, 1.0]] * 3, times={"m": [[1.0, 2.0], [1.0, 1.0], [3.0, 1.0]]})
    reasons = paired.verdict(b, "m", bound=1.8)
    assert reasons[0].startswith("m: the speedup's 90% interval 2.00x-4.00x is 100% of it (> 10%)")
    assert "ABOVE THE BOUND: efficiency 1.11 > 1.05" in reasons[1] and len(reasons) == 2
