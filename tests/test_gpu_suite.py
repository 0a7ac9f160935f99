"""The GPU suite's CPU dry run through its real command line, and its resume and budget rules.

The dry run executes the suite's code at tiny sizes on the CPU (dense backend in bf16, the Triton
kernel in float32 under the interpreter); its numbers are not measurements, the point is that the
command, its result files and its resume logic work before a GPU lease is spent on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "benchmarks" / "gpu_suite.py"
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.runner import Case, Part, PartState, run_part  # noqa: E402


def _suite(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, str(SUITE), "--dry-run", *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )  # fmt: skip


def _records(out: Path, part: str) -> list[dict]:
    return [json.loads(line) for line in (out / part / "results.jsonl").read_text().splitlines()]


def _state(out: Path, part: str) -> dict:
    return json.loads((out / part / "state.json").read_text())


@pytest.mark.slow  # four runs of the command: ~20 s of CPU
def test_dry_run_correctness_then_resume_skips_done_parts(tmp_path, capsys):
    out = tmp_path / "gpu"
    # a lease that ends before the first case: nothing recorded, the part left partial, exit 3
    cut = _suite("--out", str(out), "--parts", "correctness", "report", "--max-seconds", "0.001")
    assert cut.returncode == 3, cut.stdout[-3000:] + cut.stderr[-3000:]
    assert _state(out, "correctness")["status"] == "partial" and "--resume" in cut.stdout
    assert "incomplete" in (out / "summary.md").read_text()  # the report still ran

    first = _suite("--out", str(out), "--parts", "correctness", "report", "--resume")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "GPU plan (what a device run does):" in first.stdout
    assert "attention T=65536 Hq=16 Hkv=8 D=128 bfloat16" in first.stdout  # the GPU plan, printed
    state = _state(out, "correctness")
    recs = _records(out, "correctness")
    assert state["status"] == "done" and state["used_s"] > 0
    assert [r["id"] for r in recs] == state["planned"]  # every planned case, once, in order
    assert all(r["status"] == "ok" for r in recs), [(r["id"], r.get("error")) for r in recs]
    attention = [r for r in recs if r["id"].startswith("attention")]
    assert {b for r in attention for b in r["backends"]} >= {"dense"}
    for r in attention:
        for check in r["backends"].values():  # every error within its bound, errors not all zero
            assert check["ok"] and set(check["err"]) == {"o", "dq", "dk", "dv"}
            assert all(0 < check["err"][n] <= check["bound"][n] for n in check["err"])
    gdn = next(r for r in recs if r["id"].startswith("gdn"))
    assert gdn["backends"]["torch"]["ok"] and "CUDA" in gdn["backends"]["fla"]["unavailable"]
    models = [r for r in recs if r["id"].startswith("model")]
    assert len(models) == 3 and all(r["backends"]["dense"]["ok"] for r in models)
    summary = (out / "summary.md").read_text()
    assert "every correctness check passes: yes" in summary and "kernels: not run" not in summary
    assert (out / "log.txt").exists()

    before = (out / "correctness" / "results.jsonl").read_bytes()
    again = _suite("--out", str(out), "--resume", "--parts", "correctness", "report")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "== correctness: done in an earlier run" in again.stdout and "skipped" in again.stdout
    assert "[correctness 1/" not in again.stdout  # no case ran again
    assert (out / "correctness" / "results.jsonl").read_bytes() == before

    # results there, no --resume: refused before any work (in-process: no second torch import for it)
    from benchmarks import gpu_suite

    assert gpu_suite.main(["--dry-run", "--out", str(out), "--parts", "report"]) == 2
    assert "--resume" in capsys.readouterr().err


@pytest.mark.slow
def test_dry_run_kernels_and_end_to_end(tmp_path):
    out = tmp_path / "gpu"
    archive = tmp_path / "a.tgz"
    run = _suite(
        "--out", str(out), "--parts", "kernels", "e2e", "verl", "report", "--archive", str(archive),
        "--profile-below", "1e9",  # profile every end-to-end case
    )  # fmt: skip
    assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]  # 1: CPU timings miss a goal
    for part in ("kernels", "e2e"):
        assert _state(out, part)["status"] == "done"
        assert all(r["status"] == "ok" for r in _records(out, part)), _records(out, part)
    kern = _records(out, "kernels")
    assert {r["tree"] for r in kern} == {"per-turn", "group"}
    for r in kern:
        names = {row["name"] for row in r["rows"]}
        assert names == {"sdpa causal", "dense", "sdpa per path"}
        assert all(row["ms"] > 0 and row["tflops"] > 0 for row in r["rows"])
    (e2e,) = _records(out, "e2e")
    assert e2e["flop_bound"] > 1 and e2e["speedup"] > 0 and e2e["max_logprob_diff"] < 1e-4
    profile = (out / "e2e" / e2e["profile"]).read_text()
    assert "# tree step" in profile and "# sequence step" in profile
    assert (out / "kernel_time_vs_T.png").stat().st_size > 0
    with tarfile.open(archive) as tar:  # the folder as one file, to bring back from a device call
        assert f"{out.name}/e2e/results.jsonl" in tar.getnames()
    # verl's trainer: its inputs written and its command recorded; the launch needs a GPU and verl
    verl = {r["id"]: r for r in _records(out, "verl")}
    for strategy in ("fsdp2", "treetrain"):
        rec = verl[f"main_ppo strategy={strategy}"]
        assert "CPU dry run" in rec["unavailable"] and f"critic.strategy={strategy}" in rec["command"]
    run_dir = out / "verl" / "run"
    assert {"train.parquet", "val.parquet", "reward.py"} <= {p.name for p in run_dir.iterdir()}
    assert (run_dir / "model" / "tokenizer.json").exists() and (run_dir / "model" / "config.json").exists()
    summary = (out / "summary.md").read_text()
    assert "## 1. Correctness\n\nnot run" in summary and "kernel_time_vs_T.png" in summary
    assert "## 4. verl's trainer" in summary and "verl main_ppo: step 1" in summary


# ---- the runner, in process ------------------------------------------------------------------------


def _sleepy_part(calls: list[str], budget: float, sleep: dict[str, float], fail: str = "") -> Part:
    def case(cid):
        def run():
            calls.append(cid)
            time.sleep(sleep.get(cid, 0.0))
            if cid == fail:
                raise ValueError("broken on purpose")
            return {"value": cid}

        return Case(cid, run)

    return Part("p", budget, lambda: [case(c) for c in ("a", "b", "c")])


def test_runner_deadline_drops_case_in_flight_and_resume_runs_the_rest(tmp_path):
    calls: list[str] = []
    part = _sleepy_part(calls, budget=60, sleep={"b": 5.0})
    status = run_part(part, tmp_path, deadline=time.monotonic() + 0.3, log=lambda m: None)
    assert status == "partial" and calls == ["a", "b"]
    st = PartState.load(tmp_path, "p")
    assert st.status == "partial" and list(st.records) == ["a"]  # b was dropped, not recorded
    with open(tmp_path / "p" / "results.jsonl", "a") as f:
        f.write('{"id": "b", "stat')  # a line torn by a kill mid-write: b runs again
    part = _sleepy_part(calls, budget=60, sleep={})
    assert run_part(part, tmp_path, deadline=None, log=lambda m: None) == "done"
    assert calls == ["a", "b", "b", "c"]  # a not run again
    assert [r["id"] for r in _records(tmp_path, "p")] == ["a", "b", "c"]
    assert run_part(part, tmp_path, deadline=None, log=lambda m: None) == "done"  # finished: skipped
    assert calls == ["a", "b", "b", "c"]


def test_runner_budget_stops_the_part_and_records_it(tmp_path):
    calls: list[str] = []
    part = _sleepy_part(calls, budget=0.3, sleep={"b": 5.0}, fail="a")
    assert run_part(part, tmp_path, deadline=None, log=lambda m: None) == "over_budget"
    recs = {r["id"]: r for r in _records(tmp_path, "p")}
    assert recs["a"]["status"] == "error" and "broken on purpose" in recs["a"]["error"]  # the next case ran
    assert recs["b"]["status"] == "over_budget" and "c" not in recs
    state = _state(tmp_path, "p")
    assert state["status"] == "over_budget" and state["not_run"] == ["c"] and 0.3 <= state["used_s"] < 5
    assert run_part(part, tmp_path, deadline=None, log=lambda m: None) == "over_budget"  # not retried
    assert calls == ["a", "b"]


def test_verl_step_one_comparison():
    """The verl part's verdict: the rollouts must be the same, then each engine metric within its
    bf16 tolerance (relative, or absolute near zero)."""
    from benchmarks.gpu.verl_trainer import ENGINE_TOL, compare

    a = {"response_length/mean": 40.0, "critic/score/mean": 0.25} | {k: 1.0 for k in ENGINE_TOL}
    close = dict(a, **{"actor/entropy": 1.04, "actor/kl_loss": 0.0005 + 1.0})
    assert "error" not in compare(a, close) and compare(a, close)["same_rollout"]
    assert "rollouts differ" in compare(a, dict(close, **{"response_length/mean": 41.0}))["error"]
    far = compare(a, dict(close, **{"actor/entropy": 1.2}))
    assert far["status"] == "error" and far["mismatches"] == ["actor/entropy: 1 vs 1.2"]
    missing = {k: v for k, v in a.items() if k != "actor/grad_norm"}
    assert "actor/grad_norm missing" in compare(a, missing)["error"]
