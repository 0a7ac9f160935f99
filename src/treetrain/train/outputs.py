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
    zero, so that they teach nothing (every reward of the group equal, or a one-path group's reward
    0: see ``group_advantages``).
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
        zero = [not any(np.any(a) for a in t.fields["advantages"]) for t in with_rewards]  # per path or token
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
    records: list[dict[str, Any]], cfg: TrainConfig, outputs: dict[str, Path], wall: float
) -> str:
    """The end-of-run table."""
    if not records:
        return "no optimizer steps were run"
    path_tok = sum(r["tokens"] for r in records)
    tree_tok = sum(r["tree_tokens"] for r in records)
    comp_tok = sum(r["computed_tokens"] for r in records)
    step_time = sum(r["step_time_s"] for r in records)
    possible = path_tok - tree_tok
    rows = [
        ("steps", f"{records[-1]['step']}  ({len(records)} this run, {wall:.1f} s wall)"),
        ("packing / objective", f"{cfg.packing} / {cfg.objective}"),
        ("loss first -> last", f"{records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}"),
        ("path tokens", f"{path_tok:,}  (what the per-path baseline computes)"),
        ("tree tokens", f"{tree_tok:,}  (POR {1 - tree_tok / path_tok:.1%})"),
        (
            "computed tokens",
            f"{comp_tok:,}  (ERR {(path_tok - comp_tok) / possible if possible else 1.0:.1%})",
        ),
        ("path tokens / s", f"{path_tok / step_time:,.0f}" if step_time > 0 else "-"),
        ("peak memory", f"{max(r['peak_memory'] for r in records):,.0f} MiB"),
    ]
    rows += _reward_rows(records)
    rows += [(f"{name} ->", str(path)) for name, path in outputs.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _reward_rows(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Summary rows of the steps' rewards (:func:`reward_metrics`), if the data has rewards."""
    rewarded = [r for r in records if "reward_mean" in r]
    if not rewarded:
        return []
    first, last = rewarded[0], rewarded[-1]
    rows = [
        ("reward mean first -> last", f"{first['reward_mean']:.4g} -> {last['reward_mean']:.4g}"),
        ("reward std first -> last", f"{first['reward_std']:.4g} -> {last['reward_std']:.4g}"),
        (
            "reward min / max",
            f"{min(r['reward_min'] for r in rewarded):.4g} / {max(r['reward_max'] for r in rewarded):.4g}",
        ),
    ]
    zero = [r["zero_adv_groups"] for r in rewarded if "zero_adv_groups" in r]
    if zero:
        rows.append(("zero-advantage groups", f"{sum(zero) / len(zero):.1%} of groups (mean over steps)"))
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
