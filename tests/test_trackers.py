"""``--report-to``: one real training run (its own process, as a user runs it) reports to TensorBoard,
W&B (offline), MLflow (local store) and Trackio (local store); each is read back with its own
reader and holds the same scalars as ``metrics.jsonl``."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from treetrain.train.trackers import TRACKERS, parse_report_to, scalars

from .reference import tiny_config
from .test_train import write_trees

CHECKED = ("loss", "grad_norm", "lr", "por", "err", "tokens_per_s", "tokens")

# one xdist worker takes the module: the module-scoped tracked_run (a training process with all four
# trackers) ran once per worker that got one of its tests
pytestmark = pytest.mark.xdist_group("trackers")


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("trackers")
    write_trees(d / "trees.jsonl", n_trees=3)
    tiny_config("qwen3", vocab=97).save_pretrained(d / "tiny")
    out = d / "run"
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TRACKIO_DIR", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [
        sys.executable,
        "-m",
        "treetrain",
        "train",
        "--data",
        str(d / "trees.jsonl"),
        "--model",
        str(d / "tiny"),
    ]
    cmd += ["--output", str(out), "--steps", "2", "--no-progress", "--prefetch", "0"]
    cmd += ["--report-to", "tensorboard,wandb,mlflow,trackio"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    return out, records, env


def _same(logged: dict[int, dict[str, float]], records, rel: float = 0.0) -> None:
    """``logged[step][name]`` equals the metrics.jsonl value (within ``rel`` for float32 stores)."""
    assert sorted(logged) == [r["step"] for r in records]
    for r in records:
        for name in CHECKED:
            want, got = float(r[name]), logged[r["step"]][name]
            assert abs(got - want) <= rel * abs(want), (r["step"], name, got, want)


@pytest.mark.slow  # one real run with all four trackers: ~15 s, most of it MLflow's store setup
def test_tensorboard_event_file(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, records, _ = tracked_run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    logged: dict[int, dict[str, float]] = {}
    for name in acc.Tags()["scalars"]:
        for ev in acc.Scalars(name):
            logged.setdefault(ev.step, {})[name] = ev.value
    _same(logged, records, rel=1e-6)  # TensorBoard stores float32


def _wandb_history(path: str) -> list[dict]:
    """History rows of an offline ``run-*.wandb`` file: LevelDB-log framing (32 KiB blocks, 7-byte
    chunk headers: crc, length, type full/first/middle/last) around ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunks, rows = Path(path).read_bytes(), 7, [], []  # 7: the file's own header
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        body, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        chunks = [body] if kind in (1, 2) else chunks + [body]
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(b"".join(chunks))
            if rec.WhichOneof("record_type") == "history":
                rows.append(
                    {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
                )
    return rows


@pytest.mark.slow  # one real run with all four trackers: ~15 s, most of it MLflow's store setup
def test_wandb_offline_run(tracked_run):
    out, records, _ = tracked_run
    (run_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    logged = {row["_step"]: row for row in _wandb_history(run_file)}
    _same(logged, records)


@pytest.mark.slow  # one real run with all four trackers: ~15 s, most of it MLflow's store setup
def test_mlflow_local_store(tracked_run):
    from mlflow.tracking import MlflowClient

    out, records, _ = tracked_run
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("treetrain").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["objective"] == "sft"
    logged: dict[int, dict[str, float]] = {}
    for name in CHECKED:
        for m in client.get_metric_history(run.info.run_id, name):
            logged.setdefault(m.step, {})[name] = m.value
    _same(logged, records)


@pytest.mark.slow  # one real run with all four trackers: ~15 s, most of it MLflow's store setup
def test_trackio_local_store(tracked_run):
    out, records, env = tracked_run
    code = (
        "import json; from trackio.sqlite_storage import SQLiteStorage; "
        "print(json.dumps(SQLiteStorage.get_logs('treetrain', 'run')))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=dict(env, TRACKIO_DIR=str(out / "trackio")),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip  # trackio reads TRACKIO_DIR once, at import: its own process
    assert proc.returncode == 0, proc.stderr
    logged = {row["step"]: row for row in json.loads(proc.stdout.strip().splitlines()[-1])}
    _same(logged, records)


def test_scalars_are_the_numeric_fields():
    assert scalars({"step": 3, "loss": 1.5, "trees": 2, "name": "x", "flag": True, "x": float("nan")}) == {
        "loss": 1.5,
        "trees": 2.0,
    }


def test_report_to_errors(monkeypatch):
    assert parse_report_to("none") == [] and parse_report_to(None) == []
    assert parse_report_to("TensorBoard, mlflow,tensorboard") == ["tensorboard", "mlflow"]
    with pytest.raises(ValueError, match="unknown tracker 'comet'"):
        parse_report_to("comet")
    with pytest.raises(ValueError, match="cannot be combined"):
        parse_report_to("none,wandb")
    monkeypatch.setitem(TRACKERS, "wandb", ("treetrain_no_such_module", "wandb"))
    with pytest.raises(ValueError, match=r"pip install 'treetrain\[wandb\]'"):
        parse_report_to("wandb")
