"""What a run prints while it runs (main rank, unless the run is quiet), with or without the progress
bar: a start banner (what trains on what, where) and one line per step.

Banner example (the defaults: the embedded model on the bundled sample)::

    treetrain train: model      embedded tiny Qwen3 (qwen3), random init from --seed 0
                     parameters 9,798,016 trainable of 9,798,016
                     data       the bundled sample agent-dialogues.jsonl.gz: 8 trees, 107 paths, ...
                     run        3 steps of 1 tree, objective sft, packing tree, lr 0.001 (cosine)
                     device     cpu, float32
                     output     runs/train

Step line example: ``step 2/3  loss 11.8996  lr 0.0005  grad_norm 1.52  path tokens/s 10,201``
(``reward_mean`` where the data has rewards, ``eval/loss`` on the steps that evaluate).

Progress bars (the steps', the validation of a large file, transformers' loading and saving) draw
only where someone watches them redraw: stderr a terminal (or a notebook). Into a file or a pipe
their redraws would mix into the step lines, which are the progress there (:func:`show_progress_bars`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from treetrain.models.pretrained import PRETRAINED, is_pretrained_name
from treetrain.train.config import TrainConfig

__all__ = ["banner", "model_description", "parameter_counts", "show_progress_bars", "step_line"]


def show_progress_bars(enabled: bool, stream: TextIO | None = None) -> bool:
    """Whether progress bars draw: ``enabled`` (``--progress``, the default) and ``stream`` (stderr,
    where they draw) a terminal, or a notebook's output (tqdm draws a widget there). Written to a
    file or a pipe, a bar's redraws would mix into the step lines: none then, the step lines alone."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return enabled and (bool(isatty and isatty()) or "ipykernel" in sys.modules)


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, all)`` parameter counts (global counts under FSDP2: a DTensor's ``numel``)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def model_description(cfg: TrainConfig, model: nn.Module) -> str:
    """Which model trains: the embedded one, a model known by name (its pretrained weights), a
    directory's weights, or a directory's config."""
    kind = getattr(model.config, "model_type", "?")
    if cfg.model is None:
        return f"embedded tiny Qwen3 ({kind}), random init from --seed {cfg.seed}"
    if is_pretrained_name(cfg.model):
        return f"{cfg.model} ({kind}, pretrained weights: {PRETRAINED[cfg.model].about})"
    path = Path(cfg.model)
    if any(path.glob("*.safetensors")) or any(path.glob("*.bin")):
        return f"{cfg.model} ({kind}, its weights)"
    return f"{cfg.model} ({kind}, config.json only: random init from --seed {cfg.seed})"


def _dtype(cfg: TrainConfig, param_dtype: torch.dtype, autocast: torch.dtype | None) -> str:
    name = str(param_dtype).removeprefix("torch.")
    if autocast is None:
        return name
    return f"{str(autocast).removeprefix('torch.')} autocast, {name} weights"


def banner(
    cfg: TrainConfig,
    model: nn.Module,
    *,
    steps: int,
    start_step: int,
    counts: Any,
    device: torch.device,
    param_dtype: torch.dtype,
    autocast: torch.dtype | None,
    data: Path,
    eval_counts: Any = None,
) -> str:
    """The start banner: model, trainable parameters, data (trees, paths, tokens), the run, device and
    dtype, tokenizer, output. ``counts``: the data file's ``DataCounts`` (None when it was not read
    ahead, ``--lazy-validate``)."""
    trainable, total = parameter_counts(model)
    adapter = " (LoRA adapter)" if cfg.lora_r or cfg.peft_config is not None else ""
    rows = [
        ("model", model_description(cfg, model)),
        ("parameters", f"{trainable:,} trainable of {total:,}{adapter}"),
        ("data", _data_line(data if cfg.data is not None else f"the bundled sample {data.name}", counts)),
    ]
    if cfg.eval_data is not None:
        n = cfg.eval_every
        every = "" if not n else "every step and " if n == 1 else f"every {n} steps and "
        held_out = _data_line(Path(cfg.eval_data), eval_counts)
        rows.append(("eval data", f"{held_out}; {every}after the last step"))
    per = f"{cfg.batch_trees} tree{'s' if cfg.batch_trees > 1 else ''}"
    first = f", from step {start_step + 1} (resumed)" if start_step else ""
    rows += [
        (
            "run",
            f"{steps} step{'s' if steps > 1 else ''} of {per}{first}, objective {cfg.objective}, "
            f"packing {cfg.packing}, lr {cfg.lr:g} ({cfg.schedule})",
        ),
        ("device", f"{device}, {_dtype(cfg, param_dtype, autocast)}"),
    ]
    if cfg.tokenizer is not None:
        origin = ""
        if cfg.tokenizer == cfg.model:
            origin = " (the --model's own)" if is_pretrained_name(cfg.model) else " (the --model directory's)"
        rows.append(("tokenizer", f"{cfg.tokenizer}{origin}"))
    rows.append(("output", str(cfg.output)))
    width = max(len(k) for k, _ in rows)
    head = "treetrain train: "
    lines = [f"{head if i == 0 else ' ' * len(head)}{k:<{width}} {v}" for i, (k, v) in enumerate(rows)]
    return "\n".join(lines)


def _data_line(path: Path | str, counts: Any) -> str:
    if counts is None:
        return f"{path} (not read ahead: --lazy-validate)"
    return (
        f"{path}: {counts.samples:,} trees, {counts.paths:,} paths, {counts.path_tokens:,} path tokens, "
        f"{counts.tree_tokens:,} tree tokens (POR {counts.por:.1%})"
    )


def step_line(record: dict[str, Any], steps: int) -> str:
    """One line for a step's metrics record: step, loss, lr, grad norm, path tokens/s, and the reward
    mean and eval loss where the record has them."""
    parts = [
        f"step {record['step']}/{steps}",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.3g}",
        f"grad_norm {record['grad_norm']:.3g}",
        f"path tokens/s {record['tokens_per_s']:,.0f}",
    ]
    if "reward_mean" in record:
        parts.append(f"reward_mean {record['reward_mean']:.4g}")
    parts += [f"{k} {v:.4f}" for k, v in record.items() if k in ("eval/loss", "eval/reward_mean")]
    return "  ".join(parts)
