"""The training loop behind ``treetrain train``.

One optimizer step takes ``batch_trees`` whole trees (a tree never straddles two steps):

1. the loss normalizer is computed over those whole trees, before anything runs;
2. ``packing="tree"``: a tree with more distinct tokens than ``capacity`` is partitioned into parts
   of whole paths, and trees and parts are packed together into micro-batches;
   ``packing="sequence"`` (the baseline, :mod:`treetrain.objectives.baseline`): every path becomes its own
   sequence (a one-path tree, so the mask is block-diagonal causal), packed into micro-batches under
   the same token budget; the objective makes the micro-batches and gives their loss;
3. every micro-batch runs forward and backward; its loss is already divided by the global
   normalizer, so accumulating gradients over micro-batches gives the full-batch gradient;
4. grad clipping, AdamW step, LR schedule step, one line of ``metrics.jsonl``.

Under ``torchrun`` (FSDP2, :mod:`treetrain.parallel.fsdp`) every rank reads the same trees, the
step's trees and parts are assigned to ranks by FLOP cost, every rank runs as many passes as the
busiest one (idle passes add zero gradient) and gradients and metrics are summed over ranks, so a
step equals the single-process step. A non-finite loss or gradient norm stops the run before the
optimizer step (:class:`NonFiniteError`), leaving the last checkpoint as it was.

This module holds the loop and the command's entry point (its flags: :mod:`treetrain.train.flags`);
it composes pieces built elsewhere, along the data flow:

- :mod:`treetrain.train.build`: device, dtype, model, reference model, optimizer, LR schedule;
- :mod:`treetrain.train.batches`: trees from the data file, grouped per step and packed (:class:`StepBatch`);
- :mod:`treetrain.objectives.registry`: the objective, a
  :class:`treetrain.objectives.interface.TrainObjective`: model class, record check, extra models
  (reference, critic), how the step's trees become micro-batches (tree | sequence), loss, metrics;
- :mod:`treetrain.train.kit`: what the objective's extra models get from the run (FSDP2, AdamW,
  checkpoint state, export);
- :mod:`treetrain.train.step`: one optimizer step (:func:`train_step`);
- :mod:`treetrain.train.outputs`: metrics lines, the summary table, the plot;
- :mod:`treetrain.train.console`: the start banner and a line per step;
- :mod:`treetrain.train.evaluate`: ``--eval-data``, the objective's loss on held-out trees.

The names of those modules stay importable from here (``from treetrain.train.loop import build_model``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from treetrain.models.lora import apply_lora, is_peft_model, save_adapter
from treetrain.models.lora import config_from_train as lora_config_of
from treetrain.objectives import moe_aux
from treetrain.objectives.registry import build_objective
from treetrain.parallel import fsdp as distributed
from treetrain.train.batches import (
    StepBatch,
    _per_tree_budget,
    _reader_options,
    _tokenizer,
    _tokenizer_name,
    data_path,
    make_batches,
    prefetched,
    total_steps,
)
from treetrain.train.build import (
    build_model,
    build_optimizer,
    build_scheduler,
    configure_model,
    default_model_config,
    lr_factor,
    model_tokenizer,
    resolve_device,
    resolve_dtype,
    schedule_note,
    set_schedule_step,
)
from treetrain.train.checkpoint import CheckpointError
from treetrain.train.config import TrainConfig, config_from_args, validate
from treetrain.train.console import show_progress_bars
from treetrain.train.kit import RunKit, checkpoint_state, drop_empty_groups, export_extras
from treetrain.train.outputs import (
    log_metrics,
    peak_memory_mib,
    plot_metrics,
    step_record,
    summary_table,
    truncate_metrics,
)
from treetrain.train.step import NonFiniteError, train_step
from treetrain.train.trackers import open_trackers

__all__ = [
    "StepBatch",
    "build_model",
    "build_optimizer",
    "build_scheduler",
    "default_model_config",
    "lr_factor",
    "make_batches",
    "train",
    "train_step",
]


# ---- the loop ----------------------------------------------------------------------------------


@dataclass
class Run:
    """What the loop works on, built by :func:`setup`."""

    cfg: TrainConfig
    device: torch.device
    autocast_dtype: torch.dtype | None
    model: nn.Module
    objective: Any  # treetrain.objectives.interface.TrainObjective: loss, extra models (reference, critic)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    steps: int
    out: Path
    start_step: int = 0
    trees_done: int = 0
    total_trees: int | None = None  # the run's last tree (``--epochs``); None: ``steps`` decide
    cp: Any = None  # parallel.cp.CPLayout (dp x cp mesh); set by setup
    eval_batch: StepBatch | None = None  # --eval-data, packed once (treetrain.train.evaluate)
    quiet: bool = False  # no banner, no step lines (the Python API's quiet=True)


@dataclass
class TrainResult:
    output: Path
    metrics: Path
    final: Path
    plot: Path | None
    records: list[dict[str, Any]]


def setup(cfg: TrainConfig, quiet: bool = False) -> Run:
    """Model, objective, reference model, optimizer, schedule; resumed from the latest checkpoint
    under ``OUTPUT/checkpoints`` with ``resume``. Without ``output``: a new run directory
    (:func:`treetrain.train.rundir.default_output`); without ``tokenizer``: the ``--model``
    directory's, if it has one. Prints the start banner unless ``quiet``."""
    from treetrain.train import checkpoint, guards, rundir

    info = distributed.init_distributed("cpu" if cfg.device == "cpu" else "auto")
    device = info.device if info.distributed else resolve_device(cfg.device)
    param_dtype, autocast_dtype = resolve_dtype(cfg.dtype, device)
    out = Path(cfg.output) if cfg.output is not None else rundir.default_output(cfg.resume)
    cfg = dataclasses.replace(cfg, output=str(out), tokenizer=model_tokenizer(cfg.model, cfg.tokenizer))

    rundir.check_output(out, resume=cfg.resume, overwrite=cfg.overwrite)  # before any work or write
    distributed.barrier()
    if info.is_main and cfg.overwrite:
        rundir.clear_run(out)
    out.mkdir(parents=True, exist_ok=True)
    if info.is_main:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    objective = build_objective(cfg)  # --objective and loss.*: the loop composes what it declares
    if cfg.cp > 1 and (why := objective.cp_refusal()) is not None:
        raise ValueError(f"--objective {cfg.objective}: --cp {cfg.cp} is not supported: {why}; use --cp 1")
    model = configure_model(
        build_model(
            cfg.model,
            cfg.seed,
            param_dtype,
            device,
            objective.model_class,
            trust_remote_code=cfg.trust_remote_code,
        ),
        cfg.activation_checkpointing,
    )
    moe_aux.aux_coef(model)  # refuses before the first step an aux coefficient set for absent routers
    mixed = autocast_dtype is not None and device.type == "cuda"
    # its extra models (a reference, a critic: sharded by the kit) from the initial policy
    objective.build_models(model, RunKit(cfg, device, param_dtype, info.distributed, mixed))
    lora = lora_config_of(cfg)
    model = apply_lora(model, lora) if lora is not None else model
    # FSDP2 from outside the model (a no-op in one process), before the optimizer sees the parameters
    model = distributed.shard_model(model, mixed_precision=mixed)
    optimizer = build_optimizer(model, cfg)
    if objective.trained():  # DCP's state of several optimizers allows no empty group (LoRA's no-decay)
        drop_empty_groups(optimizer)
    vocab_size = model.config.get_text_config().vocab_size
    counts = None  # the whole file read and checked before step 1 (--epochs counts its trees so)
    bars = show_progress_bars(cfg.progress) and info.is_main  # a terminal's: validating a large file
    if not cfg.lazy_validate or cfg.epochs is not None:
        options = _reader_options(_per_tree_budget(cfg), vocab_size, objective)
        counts = guards.validate_data(data_path(cfg), options, bars)
    steps, total_trees = total_steps(cfg, vocab_size, counts.samples if counts is not None else None)
    scheduler = build_scheduler(optimizer, cfg, steps)
    run = Run(cfg, device, autocast_dtype, model, objective, optimizer, scheduler, steps, out, quiet=quiet)
    run.total_trees = total_trees
    eval_counts = None
    if cfg.eval_data is not None:
        from treetrain.train.evaluate import eval_batch

        run.eval_batch, eval_counts = eval_batch(cfg, vocab_size, objective, bars)
    from treetrain.parallel.cp import init_cp

    run.cp = init_cp(cfg.cp)
    latest = checkpoint.latest_checkpoint(out) if cfg.resume else None
    if cfg.resume and latest is None and info.is_main:
        print(f"treetrain train: --resume: no checkpoint under {out / 'checkpoints'}; starting from step 0")
    if latest is not None:
        state = checkpoint_state(model, optimizer, objective)  # with a critic: both models and optimizers
        run.start_step, data_state = checkpoint.load_checkpoint(latest, *state, scheduler)
        guards.check_resume(latest, data_state, data_path(cfg), cfg, announce=info.is_main)
        run.trees_done = int(data_state.get("trees_consumed", 0))
        lr = set_schedule_step(optimizer, scheduler, cfg, steps, run.start_step)  # not the saved lr
        note = schedule_note(data_state.get("config"), cfg, steps, run.start_step, lr)
        if note and info.is_main:
            print(f"treetrain train: resuming {latest.name}: {note}", file=sys.stderr)
    if info.is_main and not quiet:
        from treetrain.train.console import banner

        dtypes = {"param_dtype": param_dtype, "autocast": autocast_dtype}
        sizes = {"steps": steps, "start_step": run.start_step, "counts": counts, "eval_counts": eval_counts}
        print(banner(cfg, model, device=device, data=data_path(cfg), **dtypes, **sizes), flush=True)
    return run


def run_loop(run: Run, metrics_path: Path) -> list[dict[str, Any]]:
    """The optimizer steps: one ``train_step`` per batch, a metrics line, the progress bar, and a
    resumable checkpoint every ``checkpoint_every`` steps."""
    from tqdm.auto import tqdm

    from treetrain.train import checkpoint
    from treetrain.train.console import step_line
    from treetrain.train.evaluate import eval_due, eval_step
    from treetrain.train.signals import Preempted, StopOnSignal

    cfg, device = run.cfg, run.device
    info = distributed.init_distributed()
    vocab_size = run.model.config.get_text_config().vocab_size
    from treetrain.parallel.cp import init_cp

    cp = run.cp or init_cp(1)
    batches = prefetched(
        make_batches(
            _per_tree_budget(cfg),
            vocab_size,
            run.steps - run.start_step,
            run.trees_done,
            rank=cp.dp_rank,
            world_size=cp.dp_size,
            model_config=run.model.config,
            total_trees=run.total_trees,
            objective=run.objective,
        ),
        cfg.prefetch,
    )
    records: list[dict[str, Any]] = []
    if info.is_main and run.start_step:
        truncate_metrics(metrics_path, run.start_step)
    with (
        contextlib.closing(batches) if hasattr(batches, "close") else contextlib.nullcontext(),
        StopOnSignal(announce=info.is_main) as stop,
        open(metrics_path, "a" if run.start_step else "w")
        if info.is_main
        else contextlib.nullcontext() as fh,
        tqdm(
            total=run.steps,
            initial=run.start_step,
            unit="step",
            disable=not (show_progress_bars(cfg.progress) and info.is_main),
        ) as bar,
        open_trackers(cfg.report_to, run.out, cfg.to_dict(), enabled=info.is_main) as trackers,
    ):
        for step, batch in enumerate(batches, start=run.start_step + 1):
            lr = run.optimizer.param_groups[0]["lr"]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            try:
                metrics = train_step(
                    run.model,
                    run.optimizer,
                    batch,
                    run.objective,
                    grad_clip=cfg.grad_clip,
                    autocast_dtype=run.autocast_dtype,
                    backend=cfg.attention,
                    cp=cp,
                )
            except NonFiniteError as e:
                last = checkpoint.latest_checkpoint(run.out)
                where = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
                raise NonFiniteError(
                    f"step {step}: {e}; stopped before the optimizer step, nothing of this step was "
                    f"applied and {where} (continue from it with --resume after fixing the cause, "
                    "e.g. a lower --lr)"
                ) from None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            run.scheduler.step()
            record = step_record(step, metrics, lr, batch, seconds, peak_memory_mib(device))
            if run.eval_batch is not None and eval_due(cfg, step, run.steps):
                record |= eval_step(
                    run.model, run.eval_batch, run.objective, autocast_dtype=run.autocast_dtype,
                    backend=cfg.attention, cp=cp,
                )  # fmt: skip
            records.append(record)
            if fh is not None:
                log_metrics(fh, record)
                trackers.log(record)
                if not run.quiet:
                    bar.write(step_line(record, run.steps), file=sys.stdout)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            bar.update(1)
            stopping = stop.should_stop()
            if stopping or (cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == run.steps)):
                saved = save_step(run, step, batch.trees_consumed)
            if stopping:
                bar.close()
                raise Preempted(stop.signum, step, str(saved))
    return records


def save_step(run: Run, step: int, trees_consumed: int) -> Path:
    """Checkpoint ``step`` (with the data file's fingerprint and the config, checked on resume)."""
    from treetrain.train.guards import save_or_explain

    model, optimizer = checkpoint_state(run.model, run.optimizer, run.objective)  # with a critic: both
    return save_or_explain(run.out, step, model, optimizer, run.scheduler, trees_consumed, run.cfg)


def train(cfg: TrainConfig | dict[str, Any], *, quiet: bool = False) -> TrainResult:
    """Run ``cfg`` end to end: setup, the loop, the final model (``save_pretrained``, safetensors,
    loadable with plain transformers), the plot and the summary table (unless ``quiet``)."""
    from treetrain.train.logs import library_progress_bars

    if isinstance(cfg, dict):  # the YAML form: {"steps": 1, "lr": 1e-4, "loss": {...}}
        from treetrain.train.config import merge

        cfg = merge(TrainConfig(), cfg, "train(config)")
    elif not isinstance(cfg, TrainConfig):
        raise ValueError(f"train: expected a TrainConfig or a dict of options, got {type(cfg).__name__}")
    cfg = validate(cfg)
    with library_progress_bars(show_progress_bars(cfg.progress)):  # --no-progress: transformers' too
        return _train(cfg, quiet)


def _train(cfg: TrainConfig, quiet: bool) -> TrainResult:
    from treetrain.models.pretrained import resolve_model
    from treetrain.train.build import is_vision_language
    from treetrain.train.checkpoint import export_pretrained, export_processor_files

    run = setup(cfg, quiet)
    cfg = run.cfg  # with the output directory and tokenizer it resolved
    metrics_path = run.out / "metrics.jsonl"
    t0 = time.perf_counter()
    records = run_loop(run, metrics_path)
    wall = time.perf_counter() - t0
    if is_peft_model(run.model):  # the adapter alone, for peft.PeftModel.from_pretrained
        final = save_adapter(run.model, run.out / "final")
    else:
        final = export_pretrained(run.model, run.out / "final")
    is_main = distributed.init_distributed().is_main
    tokenizer = _tokenizer_name(cfg)  # a directory, "qwen", or a named model's cached directory
    if tokenizer is not None and is_main:  # beside the model: AutoTokenizer and chat template load
        _tokenizer(tokenizer, cfg.trust_remote_code).save_pretrained(final)
    source = resolve_model(cfg.model)
    if source is not None and is_vision_language(Path(source)):  # its processor: AutoProcessor loads final/
        export_processor_files(source, final)
    plot = plot_metrics(records, run.out / "training.png") if cfg.plot and records and is_main else None
    outputs = {"metrics": metrics_path, "model": final} | ({"plot": plot} if plot else {})
    outputs |= export_extras(run.objective, run.out)  # a critic: OUTPUT/final_critic (transformers)
    if not quiet and is_main:
        print(f"treetrain train: done, outputs in {run.out.resolve()}/")
        print(summary_table(records, cfg, outputs, wall, whole_run=_whole_run(metrics_path, run.start_step)))
    return TrainResult(output=run.out, metrics=metrics_path, final=final, plot=plot, records=records)


def _whole_run(metrics_path: Path, start_step: int) -> list[dict[str, Any]] | None:
    """A resumed run's ``metrics.jsonl`` records from step 1 (None when this run started at step 0)."""
    if not start_step or not metrics_path.is_file():
        return None
    lines = metrics_path.read_text().splitlines()
    return [json.loads(ln) for ln in lines if ln.strip()]


# ---- command line ------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    """``treetrain train``: defaults < ``--config`` < flags < ``--set``, then :func:`train`."""
    from treetrain.train.guards import CheckpointWriteError
    from treetrain.train.signals import Preempted

    try:
        cfg = config_from_args(args)
        if not cfg.verbose:
            from treetrain.train.logs import quiet_library_loggers

            quiet_library_loggers()
        train(cfg)
        # Leave together: a rank that closes its gloo pairs while a peer is still finishing (rank 0
        # writes the tokenizer, plot and summary after the last collective) can make the peer's
        # process group abort in teardown ("terminate called without an active exception", seen
        # once in CI on a loaded machine).
        distributed.barrier()
    except CheckpointError as e:  # a corrupted, tampered or unsafe checkpoint: named, no traceback
        if distributed.init_distributed().is_main:
            print(f"treetrain train: error: {e}", file=sys.stderr)
        return 1
    except (NonFiniteError, CheckpointWriteError, Preempted) as e:
        if distributed.init_distributed().is_main:
            print(f"treetrain train: stopped: {e}", file=sys.stderr)
        return e.exit_code if isinstance(e, Preempted) else 1
    except RuntimeError as e:  # a peer died or timed out (torchrun stops the rest)
        peer_gone = isinstance(e, torch.distributed.DistError) or any(
            s in str(e) for s in ("gloo", "Connection reset", "Connection closed", "NCCL", "Broken pipe")
        )
        if not (peer_gone and distributed.init_distributed().distributed):
            raise
        import signal

        with contextlib.suppress(ValueError):  # torchrun's SIGTERM to the survivors: say why first
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rank = distributed.init_distributed().rank
        print(
            f"treetrain train: rank {rank}: stopped: a collective failed, another rank is gone or "
            f"stuck ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
            file=sys.stderr,
        )
        return 1
    finally:
        distributed.destroy()
    return 0
