"""Timing a slow per-path step against the tree's fast one on a machine whose speed drifts.

On a shared VM the rate drifts: the GUI-agent preset's tree step took 50 s and 97 s within one
hour. Timed whole, a 10-minute baseline step and a 1-minute tree step see different machines,
and their ratio is the drift's as much as the code's. Here the baseline's step is cut into
chunks of about one tree step's work (:func:`chunks`), and each chunk runs between two tree steps
(:func:`time_bracketed`)::

    tree, chunk 1 of every mode, tree, chunk 2 of every mode, tree, ..., tree

A chunk is measured in the tree steps around it, ``t_chunk / mean(t_tree before, t_tree after)``,
and a mode's speedup is the sum of its chunks' (:func:`bracketed_speedups`): a drift slower than a
bracket (a few minutes) cancels; the spread of that speedup over rounds says how much did not.
The raw step times (a mode's chunks summed, the tree's median) are kept beside it.

Example: tree steps of 10, 10 and 20 s (the machine slowed to half speed) around chunks of 30 and
60 s: the speedup is ``30 / 10 + 60 / 15 = 7.0``, the raw one ``90 / 13.3 = 6.75``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from treetrain.bench import noise

MIN_ROUNDS = 3  # a chunk's median over fewer rounds is a mean (2) or one value (1): a stall moves it

__all__ = [
    "MIN_ROUNDS",
    "Bracketed",
    "bracket_ratios",
    "bracketed_speedups",
    "chunks",
    "time_bracketed",
    "verdict",
]


def chunks(work: list[float], target: float) -> list[list[int]]:
    """Consecutive units cut into chunks of about ``target`` work each: a chunk is closed before the
    unit that would take it further past ``target`` than it stands short of it.

    Example: ``chunks([1, 1, 3, 2, 2], 3.0)`` is ``[[0, 1], [2], [3], [4]]`` (``[0, 1, 2]`` would be
    5, 2 past 3; ``[3, 4]`` would be 4, 1 past, while ``[3]`` is 1 short: a tie closes)."""
    if target <= 0:
        raise ValueError(f"chunks: target work {target} must be positive")
    out: list[list[int]] = []
    current, total = [], 0.0
    for i, w in enumerate(work):
        if current and total + w - target >= target - total:
            out.append(current)
            current, total = [], 0.0
        current.append(i)
        total += w
    if current:
        out.append(current)
    return out


@dataclass
class Bracketed:
    """What :func:`time_bracketed` measured. ``tree[r]``: round ``r``'s tree steps (s), one more than
    its most chunks; ``times[mode][r]``: its chunks' seconds in round ``r``; ``losses[mode]``: the
    loss of one whole step (its chunks' losses summed, first timed round; ``"tree"``: a tree step's);
    ``load``: the machine's load over the timed rounds."""

    tree: list[list[float]] = field(default_factory=list)
    times: dict[str, list[list[float]]] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)
    load: noise.Load | None = None

    def ratios(self, mode: str) -> list[list[float]]:
        """Per round, per chunk: ``mode``'s chunk in tree steps (:func:`bracket_ratios`)."""
        return [bracket_ratios(t, c) for t, c in zip(self.tree, self.times[mode])]

    def speedups(self, mode: str) -> list[float]:
        """Per round: ``mode``'s step in tree steps (:func:`bracketed_speedups`)."""
        return [sum(r) for r in self.ratios(mode)]

    def chunk_medians(self, mode: str) -> float:
        """``mode``'s step in tree steps, each chunk's bracketed ratio the median over rounds, summed:
        a stall that slows one chunk in one round (the VM's steps of equal work took 39 s and 83 s) moves
        it less than it moves that round's sum. Example: ratios ``[[1, 2], [1, 1], [3, 1]]`` (3 rounds,
        2 chunks) give ``1 + 1 = 2``; the rounds' sums are 3, 2 and 4."""
        return float(np.median(np.asarray(self.ratios(mode)), axis=0).sum())  # [rounds, chunks] -> sum

    def interval(
        self, mode: str, level: float = 0.9, draws: int = 4000, seed: int = 0
    ) -> tuple[float, float]:
        """A ``level`` bootstrap interval of :meth:`chunk_medians`: whole rounds drawn with replacement
        (a round's chunks stay together, so whatever a round shares stays in), the estimate recomputed
        per draw, the central ``level`` of the draws. It says how far the figure would move on another
        run of as many rounds; the rounds' own spread says how noisy one round is, which with stalls is
        more than the median of several rounds. ``seed``: the same record gives the same interval.

        Example: ratios ``[[1, 2], [1, 1], [3, 1]]`` (estimate 2) give ``(2.0, 4.0)``: a draw with the
        third round twice or more (chunk 1's median 3, chunk 2's 1) makes it 4, with the first twice
        or more 3 (chunk 2's median 2); 7 / 27 of the draws each."""
        ratios = np.asarray(self.ratios(mode))  # [rounds, chunks]
        n = len(ratios)
        picks = np.random.default_rng(seed).integers(0, n, size=(draws, n))  # [draws, rounds]
        est = np.sort(np.median(ratios[picks], axis=1).sum(axis=1))  # [draws]
        tail = (1 - level) / 2
        return float(est[int(tail * (draws - 1))]), float(est[int(round((1 - tail) * (draws - 1)))])

    def raw(self, mode: str) -> list[float]:
        """Per round: ``mode``'s whole step (its chunks summed), in seconds."""
        return [sum(c) for c in self.times[mode]]

    def tree_steps(self) -> list[float]:
        """Per round: the median tree step, in seconds."""
        return [statistics.median(t) for t in self.tree]

    def bracket_drift(self) -> tuple[float, float]:
        """``(median, worst)`` over brackets of ``|t_after / t_before - 1|``, the two tree steps around
        a chunk: how much the machine's speed changed within a bracket (and the tree step's own noise).
        Example: tree steps ``[[10, 10, 20]]`` give ``(0.5, 1.0)``."""
        jumps = [abs(t[i + 1] / t[i] - 1) for t in self.tree for i in range(len(t) - 1)]
        return statistics.median(jumps), max(jumps)


def bracket_ratios(tree: list[float], chunk_s: list[float]) -> list[float]:
    """Chunk ``i`` in units of the mean of tree steps ``i`` and ``i + 1`` around it.

    Example: ``bracket_ratios([10, 10, 20], [30, 60])`` is ``[30 / 10, 60 / 15] = [3.0, 4.0]``."""
    assert len(tree) > len(chunk_s), (len(tree), len(chunk_s))
    return [t / ((tree[i] + tree[i + 1]) / 2) for i, t in enumerate(chunk_s)]


def bracketed_speedups(tree: list[float], chunk_s: list[float]) -> float:
    """:func:`bracket_ratios` summed over chunks: a step in tree steps.

    Example: ``bracketed_speedups([10, 10, 20], [30, 60])`` is ``30 / 10 + 60 / 15 = 7.0``."""
    return sum(bracket_ratios(tree, chunk_s))


def verdict(b: Bracketed, mode: str, bound: float | None = None) -> list[str]:
    """Why ``mode``'s speedup (:meth:`Bracketed.chunk_medians`) is not to be trusted (empty: no reason
    found): fewer than :data:`MIN_ROUNDS` rounds; its :meth:`Bracketed.interval` wider than
    :data:`treetrain.bench.noise.MAX_SPREAD` of it; the machine busy (:func:`treetrain.bench.noise.busy`);
    above :data:`treetrain.bench.noise.MAX_EFFICIENCY` of ``bound``; or a typical bracket whose tree
    steps differ by more than ``MAX_SPREAD`` (a drift as fast as a bracket, which none cancels).

    The rounds' own spread is not a reason: a stall that slows one chunk of one round (the 2-core VM's
    equal chunks took 39, 50 and 83 s) widens it without moving the chunks' medians, and the interval
    is what says how far the figure itself is from another run's."""
    rounds = len(b.tree)
    if rounds < MIN_ROUNDS:
        return [
            f"{mode}: {rounds} timed round(s), a chunk's median needs {MIN_ROUNDS} "
            f"(use --repeats {MIN_ROUNDS} or more)"
        ]
    speed = b.chunk_medians(mode)
    lo, hi = b.interval(mode)
    reasons = []
    if (hi - lo) / speed > noise.MAX_SPREAD:
        reasons.append(
            f"{mode}: the speedup's 90% interval {lo:.2f}x-{hi:.2f}x is {(hi - lo) / speed:.0%} of it "
            f"(> {noise.MAX_SPREAD:.0%}) over {rounds} rounds: more rounds, or a quieter machine"
        )
    reasons += noise.verdict({}, b.load, bound, None if bound is None else speed / bound)
    typical, _ = b.bracket_drift()
    if typical > noise.MAX_SPREAD:
        reasons.append(
            f"the tree steps around a chunk differ by {typical:.0%} in the median bracket "
            f"(> {noise.MAX_SPREAD:.0%}): the machine's speed changed as fast as a bracket, which the "
            "brackets do not cancel"
        )
    return reasons


def time_bracketed(
    tree_step: Callable[[], float],
    modes: dict[str, list[Callable[[], float]]],
    rounds: int,
    reset: Callable[[], None] = lambda: None,
    progress: Callable[[str], None] | None = None,
    on_round: Callable[[Bracketed], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    monitor: Callable[[], noise.Monitor] | None = noise.Monitor,
) -> Bracketed:
    """``rounds`` timed rounds of ``tree, chunk 1 of each mode, tree, chunk 2 ..., tree`` after an
    untimed warm-up (a tree step and each mode's first chunk). ``modes``: each mode's step as chunks
    (callables returning their part of the step's loss); the modes' order alternates between rounds.
    ``reset()`` runs before each round (e.g. ``model.zero_grad``: within a round gradients
    accumulate, as over a step's micro-batches); ``on_round(result so far)`` after each timed round
    (a long run records as it goes); ``progress(line)`` after each step; ``clock``: the timer;
    ``monitor``: measures the machine's load over the timed rounds (None: not measured, e.g. for a
    simulated ``clock``, whose rounds take no real time to measure a load over)."""
    if rounds < 1:
        raise ValueError(f"time_bracketed: rounds={rounds}, needs at least 1 timed round")
    out = Bracketed(times={m: [] for m in modes})
    say = progress or (lambda line: None)

    def timed(fn: Callable[[], float]) -> tuple[float, float]:
        t0 = clock()
        loss = fn()
        return clock() - t0, loss

    reset()
    dt, _ = timed(tree_step)
    say(f"warm-up: tree step {dt:.1f} s")
    for m, parts in modes.items():
        dt, _ = timed(parts[0])
        say(f"warm-up: {m} chunk 1 of {len(parts)}: {dt:.1f} s")
    watch = monitor().start() if monitor is not None else None
    n = max(len(parts) for parts in modes.values())
    for r in range(1, rounds + 1):
        reset()
        order = list(modes) if r % 2 else list(modes)[::-1]
        tree: list[float] = []
        times: dict[str, list[float]] = {m: [] for m in modes}
        losses = dict.fromkeys(modes, 0.0)
        for i in range(n + 1):
            dt, loss = timed(tree_step)
            tree.append(dt)
            out.losses.setdefault("tree", loss)
            say(f"round {r} of {rounds}: tree step {i + 1} of {n + 1}: {dt:.1f} s")
            for m in order if i < n else ():
                if i < len(modes[m]):
                    dt, loss = timed(modes[m][i])
                    times[m].append(dt)
                    losses[m] += loss
                    say(f"round {r} of {rounds}: {m} chunk {i + 1} of {len(modes[m])}: {dt:.1f} s")
        out.tree.append(tree)
        for m in modes:
            out.times[m].append(times[m])
            out.losses.setdefault(m, losses[m])
        out.load = watch.stop() if watch is not None else None
        if on_round is not None:
            on_round(out)
    return out
