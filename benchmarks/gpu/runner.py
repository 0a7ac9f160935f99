"""Parts, cases, time budgets and resumable state for the GPU suite.

A part (correctness, kernels, end to end, report) is a list of cases. Every finished case is one
JSON line in ``<out>/<part>/results.jsonl``; ``<out>/<part>/state.json`` holds the part's status and
the seconds it has used over every run so far. A later run with ``--resume`` skips finished parts
and, inside an unfinished one, the cases already recorded, so a device lease that ends mid-suite
loses at most the case in flight.

Two clocks stop work cleanly, both by ``SIGALRM`` between Python statements (a CUDA kernel in
flight finishes first):

- a part's **budget**, counted over all runs: when it runs out the case in flight is recorded as
  ``over_budget``, the cases not reached are listed, and the part is finished (``status:
  over_budget``, not retried on resume);
- the run's ``--max-seconds`` (one device call): the case in flight is dropped, the part stays
  ``partial``, and the run exits 3, asking for ``--resume``.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

FINISHED = ("done", "over_budget")  # part states a resumed run skips
EXIT_INCOMPLETE = 3  # the run stopped at --max-seconds: run again with --resume


@dataclass
class Case:
    """One unit of work: ``run()`` returns a JSON-able record (``status`` defaults to ``ok``)."""

    id: str
    run: Callable[[], dict]


@dataclass
class Part:
    """``plan()`` builds the part's cases (cheap: no GPU work) when the part starts."""

    name: str
    budget_s: float
    plan: Callable[[], list[Case]]
    always: bool = False  # re-run on resume too (the report: it reads the other parts' results)
    about: str = ""


class _Stop(BaseException):
    """Raised by the alarm; a BaseException so that a case's ``except Exception`` cannot eat it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _alarm(reason: str, seconds: float) -> None:
    def handler(signum, frame):
        raise _Stop(reason)

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))


def _disarm() -> None:
    signal.setitimer(signal.ITIMER_REAL, 0)


@dataclass
class PartState:
    """A part's ``state.json`` (status, seconds used, ``info``: planned / not-run case ids) and its
    ``results.jsonl`` records by case id."""

    dir: Path
    status: str = "new"  # new | partial | done | over_budget
    used_s: float = 0.0
    records: dict[str, dict] = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    @classmethod
    def load(cls, out: Path, name: str) -> PartState:
        d = out / name
        st = cls(d)
        if (d / "state.json").exists():
            saved = json.loads((d / "state.json").read_text())
            st.status, st.used_s = saved.pop("status"), saved.pop("used_s")
            saved.pop("cases", None)
            st.info = saved
        path = d / "results.jsonl"
        if path.exists():
            lines = path.read_text().splitlines()
            for line in lines:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line torn by a kill mid-write: that case runs again
                    continue
                st.records[rec["id"]] = rec
            if len(st.records) < len(lines):  # drop the torn line, so appends start on a fresh line
                path.write_text("".join(json.dumps(r) + "\n" for r in st.records.values()))
        return st

    def save(self, **info) -> None:
        """Write ``state.json`` atomically (a kill mid-write leaves the previous one)."""
        self.info |= info
        self.dir.mkdir(parents=True, exist_ok=True)
        state = {"status": self.status, "used_s": round(self.used_s, 3), "cases": len(self.records)}
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps(state | self.info, indent=1) + "\n")
        os.replace(tmp, self.dir / "state.json")

    def add(self, rec: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "results.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.records[rec["id"]] = rec

    def reset(self) -> None:
        """Forget earlier results (a part that is always re-run)."""
        for name in ("results.jsonl", "state.json"):
            (self.dir / name).unlink(missing_ok=True)
        self.status, self.used_s, self.records, self.info = "new", 0.0, {}, {}


def _run_case(case: Case, log: Callable[[str], None]) -> dict:
    """The case's record; an exception is a record too (``status: error``), so one broken backend
    does not stop the others. CUDA out-of-memory frees the cache before the next case."""
    t0 = time.perf_counter()
    try:
        rec = {"status": "ok"} | case.run()
    except _Stop:
        raise
    except Exception as e:  # recorded, not hidden: the summary lists every error
        rec = {
            "status": "error",
            "error": f"{type(e).__name__}: {e}",
            "trace": traceback.format_exc()[-2000:],
        }
        log(f"    ERROR {rec['error']}")
        _free_cuda()
    rec["id"], rec["seconds"] = case.id, round(time.perf_counter() - t0, 3)
    return rec


def _free_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_part(
    part: Part,
    out: Path,
    deadline: float | None,
    log: Callable[[str], None],
    after_case: Callable[[], None] = lambda: None,
) -> str:
    """Run what is left of ``part``; returns its status afterwards (``done``, ``over_budget`` or
    ``partial`` when ``deadline`` (a ``time.monotonic()`` value) came first). ``after_case`` runs
    after every recorded case (e.g. to archive the folder, in case the process is killed)."""
    st = PartState.load(out, part.name)
    if part.always:
        st.reset()
    if st.status in FINISHED:
        n = len(st.records)
        log(f"== {part.name}: {st.status} in an earlier run ({n} cases, {st.used_s:.0f} s), skipped")
        return st.status
    cases = part.plan()
    todo = [c for c in cases if c.id not in st.records]
    left = part.budget_s - st.used_s
    log(
        f"== {part.name}: {len(todo)} of {len(cases)} cases to run, budget {part.budget_s:.0f} s "
        f"({max(left, 0):.0f} s left)"
    )
    st.status = "partial"
    st.save(planned=[c.id for c in cases])
    for i, case in enumerate(todo):
        left = part.budget_s - st.used_s
        until_deadline = None if deadline is None else deadline - time.monotonic()
        if left <= 0:
            return _over_budget(st, todo[i:], None, log)
        if until_deadline is not None and until_deadline <= 0:
            log(f"   run time limit reached before {case.id}: stopping, resume with --resume")
            st.save()
            return "partial"
        by_deadline = until_deadline is not None and until_deadline < left
        log(f"-- [{part.name} {i + 1}/{len(todo)}] {case.id}")
        t0 = time.perf_counter()
        _alarm("deadline" if by_deadline else "budget", until_deadline if by_deadline else left)
        try:
            rec = _run_case(case, log)
        except _Stop as stop:
            _free_cuda()
            st.used_s += time.perf_counter() - t0
            if stop.reason == "budget":
                return _over_budget(st, todo[i + 1 :], case, log)
            log(f"   run time limit reached during {case.id}: dropped, resume with --resume")
            st.save()
            return "partial"
        finally:
            _disarm()
        st.used_s += time.perf_counter() - t0
        st.add(rec)
        st.save()
        log(f"   {rec['status']} in {rec['seconds']:.1f} s" + _headline(rec))
        after_case()
    st.status = "done"
    st.save()
    log(f"== {part.name}: done, {st.used_s:.0f} s of {part.budget_s:.0f} s")
    return "done"


def _over_budget(st: PartState, not_run: list[Case], in_flight: Case | None, log) -> str:
    if in_flight is not None:
        st.add(
            {"id": in_flight.id, "status": "over_budget", "error": "stopped: the part's time budget ran out"}
        )
    st.status = "over_budget"
    st.save(not_run=[c.id for c in not_run])
    log(f"== {st.dir.name}: OVER BUDGET after {st.used_s:.0f} s; not run: {[c.id for c in not_run]}")
    return "over_budget"


def _headline(rec: dict) -> str:
    return f": {rec['headline']}" if rec.get("headline") else ""


def print_plan(parts: list[Part], out: Path, log: Callable[[str], None]) -> None:
    """The per-part time budgets and what earlier runs left in ``out``."""
    total = sum(p.budget_s for p in parts)
    log(f"plan: {len(parts)} parts, {total / 60:.1f} min of budget, results under {out}")
    for p in parts:
        st = PartState.load(out, p.name)
        was = (
            "" if st.status == "new" else f"  [{st.status}: {len(st.records)} cases, {st.used_s:.0f} s used]"
        )
        log(f"  {p.name:<12} budget {p.budget_s:5.0f} s  {p.about}{was}")


def load_records(out: Path, name: str) -> list[dict]:
    return list(PartState.load(out, name).records.values())


def part_status(out: Path, name: str) -> dict:
    path = out / name / "state.json"
    return json.loads(path.read_text()) if path.exists() else {"status": "not run", "used_s": 0.0}
