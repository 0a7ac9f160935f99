"""What a run writes and shows: one ``metrics.jsonl`` line per step, the end-of-run summary table
and the loss / throughput plot.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from treetrain.train.batches import StepBatch
from treetrain.train.config import TrainConfig
from treetrain.trees.tree import TrajectoryTree

METRIC_FIELDS = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "tree_tokens",
    "computed_tokens",
    "por",
    "err",
    "tokens_per_s",
    "peak_memory",
)


def peak_memory_mib(device: torch.device) -> float:
    """CUDA: peak allocated since the last reset; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def reward_metrics(trees: list[TrajectoryTree]) -> dict[str, float]:
    """The step's per-path ``rewards``: ``reward_mean``, ``reward_std`` (population std over every
    path of the step), ``reward_min``, ``reward_max``; with GRPO advantages computed from them
    (``--advantages``), ``zero_adv_groups``: the fraction of groups (trees) whose advantages are all
    zero, so that they teach nothing: every reward of the group equal (a group of one path keeps its
    raw reward as advantage, see ``group_advantages``: zero only for a zero reward).
    ``{}`` when no tree of the step has rewards.

    Example, rewards ``[1, 0]`` and ``[1, 1]``: mean 0.75, std 0.433, min 0, max 1, zero_adv_groups 0.5.
    """
    with_rewards = [t for t in trees if "rewards" in t.fields]
    if not with_rewards:
        return {}
    r = np.concatenate([np.asarray(t.fields["rewards"], dtype=np.float64) for t in with_rewards])
    out = {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()),
        "reward_min": float(r.min()),
        "reward_max": float(r.max()),
    }
    if all("advantages" in t.fields for t in with_rewards):
        rewards = [np.asarray(t.fields["rewards"]) for t in with_rewards]
        zero = [np.ptp(x) == 0 if x.size > 1 else x[0] == 0 for x in rewards]
        out["zero_adv_groups"] = float(np.mean(zero))
    return out


def step_record(
    step: int, metrics: dict[str, float], lr: float, batch: StepBatch, seconds: float, mem: float
) -> dict[str, Any]:
    """One ``metrics.jsonl`` line: the required fields first, then the objective's metrics.

    ``tokens`` counts baseline path tokens and ``tokens_per_s`` (= ``path_tokens_per_s``) is path
    tokens per second: the same useful work in both packing modes, so the ratio of two runs' values
    is the speedup. ``computed_tokens_per_s`` is what the step actually ran per second (distinct
    tree tokens, plus prefixes recomputed by partitioning; the path tokens with ``sequence``): a
    hardware throughput, not comparable across modes. ``peak_memory`` is in MiB.
    """
    rate = (lambda n: n / seconds) if seconds > 0 else (lambda n: float("inf"))
    record = {
        "step": step,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "lr": lr,
        "tokens": batch.path_tokens,
        "tree_tokens": batch.tree_tokens,
        "computed_tokens": batch.computed_tokens,
        "por": batch.por,
        "err": batch.err,
        "tokens_per_s": rate(batch.path_tokens),
        "path_tokens_per_s": rate(batch.path_tokens),
        "computed_tokens_per_s": rate(batch.computed_tokens),
        "peak_memory": mem,
        "step_time_s": seconds,
        "micro_batches": len(batch.micro),
        "trees": len(batch.trees),
        "imbalance": batch.imbalance,
    } | reward_metrics(batch.trees)
    return record | {k: v for k, v in metrics.items() if k not in record}


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the ``metrics.jsonl`` lines of steps up to ``last_step`` (a resumed run rewrites the
    steps after its checkpoint); replaced atomically."""
    if not path.is_file():
        return
    keep = [ln for ln in path.read_text().splitlines(keepends=True) if ln.strip()]
    keep = [ln for ln in keep if json.loads(ln).get("step", 0) <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)


def log_metrics(fh: TextIO, record: dict[str, Any]) -> None:
    fh.write(json.dumps(record) + "\n")
    fh.flush()


def summary_table(
    records: list[dict[str, Any]],
    cfg: TrainConfig,
    outputs: dict[str, Path],
    wall: float,
    whole_run: list[dict[str, Any]] | None = None,
) -> str:
    """The end-of-run table; every row says what it counts. ``records``: this run's steps (after
    ``--resume``, the steps after the checkpoint); ``whole_run``: after a resume, every step's record
    from step 1 (``metrics.jsonl``), for the loss over the whole run.

    Token rows (over this run's steps): path tokens (what the per-path baseline computes), tree
    tokens (each record's distinct tokens; POR = 1 - tree / path) and computed tokens (what the
    micro-batches ran; ERR = (path - computed) / (path - tree), the share of the POR saving that
    partitioning kept: at most 100% unless micro-batches merged records sharing a prefix, as DPO's
    do, which is said instead).
    """
    if not records:
        return "no optimizer steps were run"
    first, last = records[0], records[-1]
    span = f"step {last['step']}" if first is last else f"steps {first['step']}-{last['step']}"
    path_tok = sum(r["tokens"] for r in records)
    tree_tok = sum(r["tree_tokens"] for r in records)
    comp_tok = sum(r["computed_tokens"] for r in records)
    step_time = sum(r["step_time_s"] for r in records)
    resumed = whole_run is not None and whole_run and whole_run[0]["step"] < first["step"]
    steps = f"{last['step']}  (this run: {span}, {wall:.1f} s wall"
    steps += f"; resumed after step {first['step'] - 1})" if first["step"] > 1 else ")"
    rows = [
        ("steps", steps),
        ("packing / objective", f"{cfg.packing} / {cfg.objective}"),
        ("loss", _first_last(whole_run if resumed else records, "loss", "whole run" if resumed else "")),
    ]
    if resumed:
        rows.append(("", _first_last(records, "loss", "this run")))
    por, reuse = 1 - tree_tok / path_tok, _reuse(path_tok, tree_tok, comp_tok)
    rate = f"{path_tok / step_time:,.0f}  over the step time of {span}" if step_time > 0 else "-"
    rows += [
        ("path tokens", f"{path_tok:,}  what the per-path baseline computes ({span}: every path's length)"),
        ("tree tokens", f"{tree_tok:,}  distinct tokens of each record's tree (POR {por:.1%})"),
        ("computed tokens", f"{comp_tok:,}  what the micro-batches ran ({reuse})"),
        ("path tokens / s", rate),
        ("peak memory", f"{max(r['peak_memory'] for r in records):,.0f} MiB"),
    ]
    rows += _reward_rows(records)
    rows += _eval_rows(records)
    rows += [(f"{name} ->", str(path)) for name, path in outputs.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _first_last(records: list[dict[str, Any]], key: str, label: str = "", fmt: str = ".4f") -> str:
    """``11.9479 (step 1) -> 11.8441 (step 3)`` over the records that have ``key``."""
    have = [r for r in records if key in r]
    a, b = have[0], have[-1]
    text = f"{a[key]:{fmt}} (step {a['step']})"
    if b is not a:
        text += f" -> {b[key]:{fmt}} (step {b['step']})"
    return f"{text}, {label}" if label else text


def _reuse(path_tok: int, tree_tok: int, comp_tok: int) -> str:
    """ERR as a share of the possible saving; a saving beyond it (records merged) said as such."""
    saved = f"{1 - comp_tok / path_tok:.1%} of path tokens saved"
    if comp_tok < tree_tok:
        return f"{saved}: fewer than tree tokens, as records that share a prefix ran as one tree"
    possible = path_tok - tree_tok
    err = (path_tok - comp_tok) / possible if possible else 1.0
    return f"ERR {err:.1%}: the share of the POR saving realized; {saved}"


def _reward_rows(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Summary rows of the steps' rewards (:func:`reward_metrics`), if the data has rewards."""
    rewarded = [r for r in records if "reward_mean" in r]
    if not rewarded:
        return []
    rows = [
        ("reward mean", _first_last(rewarded, "reward_mean", fmt=".4g")),
        ("reward std", _first_last(rewarded, "reward_std", fmt=".4g")),
        (
            "reward min / max",
            f"{min(r['reward_min'] for r in rewarded):.4g} / {max(r['reward_max'] for r in rewarded):.4g}",
        ),
    ]
    zero = [r["zero_adv_groups"] for r in rewarded if "zero_adv_groups" in r]
    if zero:
        rows.append(("zero-advantage groups", f"{sum(zero) / len(zero):.1%} of groups (mean over steps)"))
    return rows


def _eval_rows(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``eval loss`` (and the eval reward mean) at the first and last evaluation of this run."""
    rows = []
    for key in ("eval/loss", "eval/reward_mean"):
        if any(key in r for r in records):
            rows.append((key.replace("/", " "), _first_last(records, key, "held-out --eval-data")))
    return rows


def plot_metrics(records: list[dict[str, Any]], path: Path) -> Path:
    """PNG of loss, path tokens/s and (with rewards) the reward mean, min and max per step
    (matplotlib, Agg backend)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'treetrain[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    rewarded = [r for r in records if "reward_mean" in r]
    fig, axes = plt.subplots(3 if rewarded else 2, 1, figsize=(7, 9 if rewarded else 6), sharex=True)
    ax1, ax2 = axes[0], axes[-1]
    ax1.plot(steps, [r["loss"] for r in records], marker="o")
    ax1.set_ylabel("loss")
    ax1.grid(alpha=0.3)
    ax2.plot(steps, [r["tokens_per_s"] for r in records], marker="o", color="tab:green")
    ax2.set_ylabel("path tokens / s")
    ax2.set_xlabel("optimizer step")
    ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax2.grid(alpha=0.3)
    if rewarded:
        ax3, at = axes[1], [r["step"] for r in rewarded]
        ax3.plot(at, [r["reward_mean"] for r in rewarded], marker="o", color="tab:orange", label="mean")
        lo, hi = [r["reward_min"] for r in rewarded], [r["reward_max"] for r in rewarded]
        ax3.fill_between(at, lo, hi, color="tab:orange", alpha=0.2, label="min .. max")
        ax3.set_ylabel("reward")
        ax3.legend(loc="best")
        ax3.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
