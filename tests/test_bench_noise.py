"""Benchmarks measure their own noise: load before and during, spread over interleaved repeats,
median beside the best, and a plain NOT TRUSTWORTHY (with reasons) when the machine is busy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from treetrain.bench import noise

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["bench", "--preset", "tiny", "--allocator", "system"]  # one group tree, 4 paths x 16 tokens


def test_summary_and_verdict_on_hand_written_numbers():
    s = noise.summary([1.0, 1.2, 1.1])
    assert s == {"best": 1.0, "median": 1.1, "spread": pytest.approx(0.2 / 1.1), "n": 3}
    quiet = noise.Load(cores=2, wall_s=3.0, loadavg=0.4, others_cores=0.05, steal=0.0)
    tight = {"tree": noise.summary([1.0, 1.02, 1.01]), "baseline": noise.summary([2.0, 2.05, 2.02])}
    assert noise.verdict(tight, quiet, bound=2.0) == []
    assert noise.busy(quiet) == []
    loaded = noise.Load(cores=2, wall_s=3.0, loadavg=7.9, others_cores=1.6, steal=0.08)
    assert noise.busy(loaded) == [
        "other processes used 1.6 of 2 cores before the run",
        "the hypervisor stole 8% of the CPU time before the run",
        "load average 7.9 > 2 cores before the run",
    ]
    # a run that keeps both cores busy itself is not load: only the load average beyond its own share
    own = noise.Load(cores=2, wall_s=3.0, loadavg=2.3, others_cores=0.05, steal=0.0, own_cores=1.9)
    assert noise.busy(own, "while it ran") == []
    own.loadavg = 4.2
    assert noise.busy(own, "while it ran") == [
        "load average 4.2 (1.9 of it this process) > 2 cores while it ran"
    ]
    wide = {"tree": noise.summary([1.0, 1.3, 1.1]), "baseline": noise.summary([1.0, 1.01, 1.02])}
    assert noise.verdict(wide, quiet) == ["tree times spread 27% over 3 repeats (> 10%)"]
    # a bound of 1: identical work, so medians 12% apart are a timing error of at least that much
    same = {"tree": noise.summary([1.0, 1.0]), "baseline": noise.summary([1.12, 1.12])}
    assert noise.verdict(same, quiet, bound=1.0) == [
        "both modes do identical work (bound 1.00) yet their medians differ 12%"
    ]
    assert "one timed repeat" in noise.verdict({"tree": noise.summary([1.0])})[0]


def _bench(tmp_path, name):
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": SRC}
    r = subprocess.run(
        [sys.executable, "-m", "treetrain", *TINY, "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout, json.loads(out.read_text())


def _check_fields(report):
    before = report["load_before"]
    assert before["cores"] == os.cpu_count() and before["wall_s"] > 0
    assert before["loadavg"] >= 0 and before["others_cores"] >= 0 and 0 <= before["steal"] <= 1
    assert isinstance(report["machine_busy"], list) and isinstance(report["trustworthy"], bool)
    (r,) = report["results"]
    assert (
        r["repeats"] == 3 and r["tree_median_s"] >= r["tree_s"] and r["baseline_median_s"] >= r["baseline_s"]
    )
    assert r["speedup_median"] == pytest.approx(r["baseline_median_s"] / r["tree_median_s"])
    assert r["tree_spread"] >= 0 and r["baseline_spread"] >= 0 and r["others_cores"] >= 0
    assert report["trustworthy"] == (not report["machine_busy"] and not r["untrusted"])
    return r


@pytest.mark.slow  # a bench subprocess (~10 s quiet, more on a loaded machine)
def test_bench_reports_its_noise(tmp_path):
    stdout, report = _bench(tmp_path, "plain")
    r = _check_fields(report)
    assert "machine before the run: load average" in stdout
    assert "median speedup" in stdout and "spread over 3 repeats" in stdout
    # the table says it either way: the reasons, or that no noise was found
    if report["trustworthy"]:
        assert "Timings: no sign of noise" in stdout
    else:
        assert "NOT TRUSTWORTHY" in stdout or "A busy machine before the run" in stdout
        for reason in r["untrusted"] + report["machine_busy"]:
            assert reason in stdout


@pytest.mark.slow  # a bench subprocess (~10 s quiet, more on a loaded machine)
def test_bench_warns_under_artificial_load(tmp_path):
    """Busy loops on every core: the run must be marked, with the reason. The loops run at the
    lowest priority, so the benchmark itself is barely slowed; the snapshot before the run (this
    process asleep) sees them take every core."""
    spin = "import os; os.nice(19)\nwhile True: pass"
    loops = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        stdout, report = _bench(tmp_path, "loaded")
    finally:
        for p in loops:
            p.kill()
            p.wait()
    r = _check_fields(report)
    assert report["trustworthy"] is False
    assert any(x.startswith("other processes used") for x in report["machine_busy"] + r["untrusted"])
    assert "WARNING, a busy machine" in stdout
    assert "NOT TRUSTWORTHY" in stdout or "suspect (busy machine)" in stdout


TRL_GRPO = Path(__file__).resolve().parents[1] / "benchmarks" / "trl_grpo.py"


def _script(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": SRC}
    r = subprocess.run(
        [sys.executable, str(TRL_GRPO), *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_trl_grpo_help_is_whole():
    out = _script("--help")
    # the whole description, not its first line cut mid-sentence
    assert "forward with gradients + backward, and\nthe no-grad scoring" in out
    assert "Four modes, the same batch" in out and "NOT TRUSTWORTHY" in out


@pytest.mark.slow  # TRL's trainer and one tiny case (~15 s quiet, more on a loaded machine)
def test_trl_grpo_prints_each_row_once_with_its_noise():
    pytest.importorskip("trl")
    out = _script(
        "--model", "tiny", "--prompt-lens", "16", "--groups", "2", "--completion-lens", "8", "--repeats", "2"
    )
    rows = [line for line in out.splitlines() if line.startswith("| 16 | 2 | 8 |")]
    assert len(rows) == 1, out  # printed as it is measured, not again in a closing table
    assert out.count("| P | G | C |") == 1
    assert "median speedup vs TRL (spread TRL/per-path/tree)" in out
    assert rows[0].endswith("| ok |") or "NOT TRUSTWORTHY" in rows[0]
    assert "Machine before the run: load average" in out
    if "NOT TRUSTWORTHY" in rows[0]:
        assert "- P=16 G=2 C=8 x1: " in out  # the reasons, spelled out


def test_above_the_bound_is_flagged_not_a_speedup():
    quiet = noise.Load(cores=2, wall_s=1.0, loadavg=0.1, others_cores=0.0, steal=0.0)
    ok = {"tree": noise.summary([1.0, 1.01]), "baseline": noise.summary([2.0, 2.01])}
    assert noise.verdict(ok, quiet, bound=2.0, efficiency=1.05) == []
    (reason,) = noise.verdict(ok, quiet, bound=2.0, efficiency=1.12)
    assert reason.startswith("ABOVE THE BOUND: efficiency 1.12 > 1.05") and "not a speedup" in reason
    assert noise.verdict({}, efficiency=0.93) == []
