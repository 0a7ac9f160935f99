"""Experiment trackers: the scalars of every ``metrics.jsonl`` line, through each library's own API.

``--report-to tensorboard,wandb,mlflow,trackio`` (default ``none``). Each tracker writes under the
run's output directory unless its own environment says otherwise:

- ``tensorboard``: event files in ``OUTPUT/tensorboard`` (``torch.utils.tensorboard.SummaryWriter``);
- ``wandb``: ``wandb.init(dir=OUTPUT)``; offline with ``WANDB_MODE=offline`` (run files in
  ``OUTPUT/wandb``), online once logged in; project from ``WANDB_PROJECT`` (default ``treetrain``);
- ``mlflow``: ``MlflowClient`` on ``MLFLOW_TRACKING_URI``, default a local store
  ``sqlite:///OUTPUT/mlflow.db`` (MLflow's recommended local backend; its plain-file store is
  deprecated), experiment ``treetrain``;
- ``trackio``: ``trackio.init``/``log``/``finish``; its local database goes to ``OUTPUT/trackio``
  unless ``TRACKIO_DIR`` is set (trackio reads it once, at import).

Each logs the numeric fields of a record (not ``step``, which is the x axis), so the trackers and
``metrics.jsonl`` hold the same numbers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["TRACKERS", "Trackers", "open_trackers", "parse_report_to", "scalars"]

# name -> (module that must import, pip extra)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}


def parse_report_to(value: str | Sequence[str] | None) -> list[str]:
    """``"tensorboard,wandb"`` (or a list) -> ``["tensorboard", "wandb"]``; ``none``/empty -> ``[]``.

    Checks each name and that its library is installed (the error names the pip extra).
    """
    if value is None:
        return []
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [str(n).strip().lower() for n in names if str(n).strip()]
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"--report-to: 'none' cannot be combined with other trackers, got {value!r}")
        return []
    out = []
    for name in names:
        if name not in TRACKERS:
            known = ", ".join([*TRACKERS, "none"])
            raise ValueError(f"--report-to: unknown tracker {name!r}; choose from {known}")
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ValueError(
                f"--report-to {name}: the {module} package is not installed; pip install 'treetrain[{extra}]'"
            )
        if name not in out:
            out.append(name)
    return out


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numeric fields of a metrics record, except ``step``."""
    out = {}
    for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out


class _TensorBoard:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        self.writer.add_text("config", f"```\n{config}\n```")

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        import wandb

        project = os.environ.get("WANDB_PROJECT", "treetrain")
        self.run = wandb.init(project=project, dir=str(out), config=config, name=out.name)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(out / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "treetrain")
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            artifacts = (out / "mlartifacts").resolve().as_uri()
            exp_id = self.client.create_experiment(name, artifact_location=artifacts)
        self.run_id = self.client.create_run(exp_id, run_name=out.name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in config.items()]
        self.client.log_batch(self.run_id, params=params)

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Trackio:
    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        import sys

        if "trackio" not in sys.modules:
            os.environ.setdefault("TRACKIO_DIR", str((out / "trackio").resolve()))
        import trackio

        self.trackio = trackio
        project = os.environ.get("TRACKIO_PROJECT", "treetrain")
        trackio.init(project=project, name=out.name, config=config, auto_log_gpu=False, auto_log_cpu=False)

    def log(self, values: dict[str, float], step: int) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


_CLASSES = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _MLflow, "trackio": _Trackio}


class Trackers:
    """The open trackers of one run; ``log(record)`` sends a metrics record to each."""

    def __init__(self, trackers: list) -> None:
        self.trackers = trackers

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        for t in self.trackers:
            t.log(values, int(record["step"]))


@contextlib.contextmanager
def open_trackers(
    names: str | Sequence[str] | None, out: str | Path, config: dict[str, Any], enabled: bool = True
) -> Iterator[Trackers]:
    """Open the named trackers for a run writing to ``out``; closes (finishes) them on exit.

    ``enabled=False`` (a non-main rank) opens none.
    """
    opened: list = []
    try:
        if enabled:
            for name in parse_report_to(names):
                opened.append(_CLASSES[name](Path(out), config))
        yield Trackers(opened)
    finally:
        for t in reversed(opened):
            t.close()
