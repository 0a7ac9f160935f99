"""How much a benchmark can trust its own timings: the machine's load and the spread over repeats.

A time measured on a busy machine is the machine's, not the code's. Every benchmark here
measures its own noise and says so beside the figure:

- the load before the run (:func:`snapshot`: 1-minute load average, the busiest other processes)
  and during each case (:class:`Monitor`, from ``/proc/stat``: CPU time the other processes used,
  in cores, and the hypervisor's steal);
- the spread of each mode's repeats (:func:`summary`: best, median, ``(max - min) / median``),
  the modes interleaved (tree, baseline, baseline, tree, ...) so slow phases hit both alike;
- :func:`verdict` (one case) and :func:`busy` (the machine): the reasons a figure is not
  trustworthy, e.g. ``tree times spread 23% over 4 repeats (> 10%)``, ``other processes used 1.6
  of 2 cores while it ran`` or ``load average 7.9 > 2 cores before the run``. An empty list means
  none was found (a quiet machine, repeats that agree).

Example::

    >>> mon = Monitor()
    >>> with mon:
    ...     times = {"tree": [...], "baseline": [...]}  # timed steps
    >>> verdict({m: summary(t) for m, t in times.items()}, mon.load)
    ['baseline times spread 31% over 4 repeats (> 10%)', 'other processes used 1.2 of 2 cores while it ran']
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass

__all__ = [
    "MAX_EFFICIENCY",
    "MAX_OTHERS",
    "MAX_SPREAD",
    "MAX_STEAL",
    "Load",
    "Monitor",
    "busy",
    "describe",
    "snapshot",
    "summary",
    "verdict",
]

MAX_SPREAD = 0.10  # (max - min) / median of one mode's repeats above this: not trustworthy
MAX_EFFICIENCY = 1.05  # speedup / FLOP bound above this: work the bound does not price, not a speedup
MAX_OTHERS = 0.10  # other processes' CPU, as a fraction of the machine's cores
MAX_STEAL = 0.05  # hypervisor steal, as a fraction of the machine's CPU time
_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class Load:
    """The machine's load over an interval: ``others_cores`` (CPU time other processes used / wall
    time, in cores), ``steal`` (fraction of CPU time the hypervisor took), ``loadavg`` (1-minute
    load average at the end), ``cores``, ``wall_s``, ``own_cores`` (this process's CPU time / wall
    time: its own share of the load average; None before a run). ``None`` where ``/proc`` is not
    readable."""

    cores: int
    wall_s: float
    loadavg: float | None
    others_cores: float | None
    steal: float | None
    own_cores: float | None = None


def _proc_stat() -> tuple[int, int, int] | None:
    """``(busy, steal, total)`` jiffies of all CPUs, from ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal guest guest_nice (guest is inside user)
    fields += [0] * (8 - len(fields))
    idle = fields[3] + fields[4]
    steal = fields[7]
    total = sum(fields[:8])
    return total - idle - steal, steal, total


def _own_cpu_s() -> float:
    """CPU seconds of this process and its waited-for children (``--memory``'s spawned steps)."""
    try:
        import resource
    except ImportError:  # not Unix: this process only
        return time.process_time()
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # not available (Windows)
        return None


class Monitor:
    """Measures :class:`Load` over a ``with`` block (or ``start()`` .. ``stop()``): the other
    processes' CPU is the machine's busy time minus this process's own."""

    def __init__(self) -> None:
        self.load: Load | None = None
        self._t0 = 0.0

    def start(self) -> Monitor:
        self._stat, self._own, self._t0 = _proc_stat(), _own_cpu_s(), time.perf_counter()
        return self

    def stop(self) -> Load:
        wall = time.perf_counter() - self._t0
        stat, own = _proc_stat(), _own_cpu_s() - self._own
        cores = os.cpu_count() or 1
        others = steal = None
        if stat is not None and self._stat is not None and stat[2] > self._stat[2]:
            busy, stl, total = (a - b for a, b in zip(stat, self._stat))
            others = max(0.0, busy / _HZ - own) / max(wall, 1e-9)
            steal = stl / total
        self.load = Load(
            cores=cores,
            wall_s=wall,
            loadavg=_loadavg(),
            others_cores=others,
            steal=steal,
            own_cores=own / max(wall, 1e-9),
        )
        return self.load

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def snapshot(seconds: float = 0.5, top: int = 3) -> dict:
    """The load before a run: :class:`Load` over ``seconds`` of this process sleeping, plus the
    ``top`` other processes by CPU in that window (``[(command, cores), ...]``)."""
    before = _process_cpu()
    with Monitor() as mon:
        time.sleep(seconds)
    after = _process_cpu()
    me = os.getpid()
    used = [
        (pid, (after[pid][1] - before[pid][1]) / _HZ / mon.load.wall_s)
        for pid in after.keys() & before.keys()
        if pid != me and after[pid][1] > before[pid][1]
    ]
    used = [(pid, c) for pid, c in used if c >= 0.05]  # a process that barely ran is no news
    used.sort(key=lambda x: -x[1])
    return {
        "load": mon.load,
        "top": [(_command(pid, after[pid][0]), round(c, 2)) for pid, c in used[:top]],
    }


def _process_cpu() -> dict[int, tuple[str, int]]:
    """``{pid: (command, utime + stime jiffies)}`` of every readable process."""
    out = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open(f"/proc/{entry.name}/stat") as f:
                    text = f.read()
                name = text[text.index("(") + 1 : text.rindex(")")]
                rest = text[text.rindex(")") + 2 :].split()
                out[int(entry.name)] = (name, int(rest[11]) + int(rest[12]))
    return out


def _command(pid: int, name: str) -> str:
    """A process's program and what it runs (``python pytest``, ``python train.py``), or its name;
    never its arguments (they may hold anything)."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        if args:
            what = next((a for a in args[1:] if not a.startswith("-")), "")
            if "-m" in args[1:-1]:
                what = args[args.index("-m", 1) + 1]
            elif "-c" in args[1:]:
                what = "-c"
            return " ".join(filter(None, [os.path.basename(args[0]), os.path.basename(what)]))[:40]
    return name


def summary(times: list[float]) -> dict:
    """``{"best", "median", "spread", "n"}`` of one mode's timed repeats; ``spread`` is
    ``(max - min) / median`` (0 with one repeat: nothing to compare, see :func:`verdict`)."""
    if not times:
        raise ValueError("summary: no timed repeats")
    med = statistics.median(times)
    return {
        "best": min(times),
        "median": med,
        "spread": (max(times) - min(times)) / med if med > 0 else 0.0,
        "n": len(times),
    }


def verdict(
    modes: dict[str, dict],
    load: Load | None = None,
    bound: float | None = None,
    efficiency: float | None = None,
) -> list[str]:
    """Why the timings of one case are not trustworthy (empty: no reason found).

    ``modes``: :func:`summary` per mode; ``load``: the machine's load while they ran; ``bound``: the
    FLOP bound, when 1.0 both modes do identical work, so medians that differ are a timing error;
    ``efficiency``: speedup / bound, above :data:`MAX_EFFICIENCY` the baseline runs work the bound
    does not price (or the bound is wrong): a bug to explain, never a speedup to quote.
    """
    reasons = []
    for mode, s in modes.items():
        if s["n"] < 2:
            reasons.append(f"{mode}: one timed repeat, so no spread to judge it by (use --repeats 3 or more)")
        elif s["spread"] > MAX_SPREAD:
            reasons.append(
                f"{mode} times spread {s['spread']:.0%} over {s['n']} repeats (> {MAX_SPREAD:.0%})"
            )
    reasons += busy(load, "while it ran")
    if bound is not None and abs(bound - 1.0) < 1e-6 and {"tree", "baseline"} <= modes.keys():
        ratio = modes["baseline"]["median"] / modes["tree"]["median"]
        if abs(ratio - 1.0) > MAX_SPREAD:
            reasons.append(
                f"both modes do identical work (bound 1.00) yet their medians differ {abs(ratio - 1):.0%}"
            )
    if efficiency is not None and efficiency > MAX_EFFICIENCY:
        reasons.append(
            f"ABOVE THE BOUND: efficiency {efficiency:.2f} > {MAX_EFFICIENCY:.2f}: the baseline runs work "
            "the FLOP bound does not price, or the bound is wrong; a bug to explain, not a speedup"
        )
    return reasons


def busy(load: Load | None, when: str = "before the run") -> list[str]:
    """Why the machine was too busy to time on (empty: it was not, as far as ``/proc`` tells):
    other processes used more than 10% of the cores, the hypervisor stole more than 5% of the CPU
    time, or the 1-minute load average, less this process's own share, exceeded the core count."""
    if load is None:
        return []
    reasons = []
    if load.others_cores is not None and load.others_cores > MAX_OTHERS * load.cores:
        reasons.append(f"other processes used {load.others_cores:.1f} of {load.cores} cores {when}")
    if load.steal is not None and load.steal > MAX_STEAL:
        reasons.append(f"the hypervisor stole {load.steal:.0%} of the CPU time {when}")
    # the load average counts the benchmark's own running threads: only the rest is other load
    own = load.own_cores or 0.0
    if load.loadavg is not None and load.loadavg - own > load.cores:
        mine = f" ({own:.1f} of it this process)" if own else ""
        reasons.append(f"load average {load.loadavg:.1f}{mine} > {load.cores} cores {when}")
    return reasons


def describe(load: Load | None, top: list | None = None) -> str:
    """One line: ``load average 3.1, other processes 1.4 of 2 cores, steal 0%`` (+ the busiest)."""
    if load is None:
        return "load unknown"
    parts = [f"load average {load.loadavg:.1f}" if load.loadavg is not None else "load average unknown"]
    if load.others_cores is not None:
        parts.append(f"other processes {load.others_cores:.1f} of {load.cores} cores")
    if load.steal is not None:
        parts.append(f"steal {load.steal:.0%}")
    if top:
        parts.append("busiest: " + ", ".join(f"{name} {c:.1f}" for name, c in top))
    return ", ".join(parts)
