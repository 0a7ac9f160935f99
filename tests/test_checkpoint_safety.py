"""Checkpoints run no code and detect corruption: a code-running pickle planted in each file a
resume reads (with the manifest's sha256 updated to match, as a malicious sharer would) is refused
or ignored, never executed; a tampered or truncated file is named in a clear error."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from treetrain.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint

from .test_checkpoint import build, step

STATE_FILES = ["state/.metadata", "state/__0_0.distcp"]


class Payload:
    """Unpickling this creates the directory ``marker``: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def pickled(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def torch_saved(marker: Path) -> bytes:
    """The payload in torch's own zip format (what ``torch.save`` writes)."""
    buf = io.BytesIO()
    torch.save({"state": Payload(marker)}, buf)
    return buf.getvalue()


def plant(ck: Path, rel: str, data: bytes) -> None:
    """Replace ``ck/rel`` and update ``meta.json``'s size and sha256 for it, so only the loader's
    own refusal to run code stands between the file and the process."""
    (ck / rel).parent.mkdir(parents=True, exist_ok=True)
    if rel != "meta.json":
        meta = json.loads((ck / "meta.json").read_text())
        meta["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (ck / "meta.json").write_text(json.dumps(meta))
    (ck / rel).write_bytes(data)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    model, opt, sched = build()
    step(model, opt, sched)
    return save_checkpoint(tmp_path_factory.mktemp("saved"), 1, model, opt, sched, {"trees_consumed": 1})


@pytest.fixture
def ck(saved, tmp_path) -> Path:
    """A fresh copy of one saved checkpoint (``RUN/checkpoints/step_1``)."""
    shutil.copytree(saved.parent, tmp_path / "run" / "checkpoints")
    return tmp_path / "run" / "checkpoints" / "step_1"


def test_payload_runs_when_unpickled(tmp_path):
    """Positive control: the payload does run under plain pickle and ``weights_only=False``."""
    pickle.loads(pickled(tmp_path / "a"))
    torch.load(io.BytesIO(torch_saved(tmp_path / "b")), weights_only=False)
    assert (tmp_path / "a").is_dir() and (tmp_path / "b").is_dir()


def test_checkpoint_files_are_plain_data(ck):
    """What treetrain writes itself is JSON; only DCP's state/ holds pickles (read safely)."""
    names = sorted(str(p.relative_to(ck)) for p in ck.rglob("*") if p.is_file())
    assert names == ["meta.json", "rng/rank_0.json", "scheduler.json", *STATE_FILES]
    for rel in ("meta.json", "rng/rank_0.json", "scheduler.json"):
        assert isinstance(json.loads((ck / rel).read_text()), dict)
    meta = json.loads((ck / "meta.json").read_text())
    for rel, entry in meta["files"].items():
        assert entry == {
            "bytes": (ck / rel).stat().st_size,
            "sha256": hashlib.sha256((ck / rel).read_bytes()).hexdigest(),
        }


@pytest.mark.parametrize("rel", ["scheduler.json", "rng/rank_0.json", "state/.metadata", "meta.json"])
@pytest.mark.parametrize("fmt", [pickled, torch_saved])
def test_planted_pickle_is_refused(ck, tmp_path, rel, fmt):
    marker = tmp_path / "pwned"
    plant(ck, rel, fmt(marker))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ck, *build(seed=1))
    assert not marker.exists()
    assert str(ck) in str(e.value)
    assert "refused" in str(e.value) or "JSON" in str(e.value) or "unreadable" in str(e.value)


def test_planted_pointer_is_ignored(ck, tmp_path):
    """``latest`` is only ever read as a step name: a pickle there is a garbled pointer."""
    marker = tmp_path / "pwned"
    (ck.parent / "latest").write_bytes(pickled(marker))
    assert load_checkpoint(ck.parent.parent, *build(seed=1))[0] == 1  # falls back to step_1
    assert not marker.exists()


def test_planted_legacy_pickles_are_ignored(ck, tmp_path):
    """The format-1 names (scheduler.pt, rng/rank_0.pt) are never opened."""
    marker = tmp_path / "pwned"
    (ck / "scheduler.pt").write_bytes(torch_saved(marker))
    (ck / "rng" / "rank_0.pt").write_bytes(torch_saved(marker))
    assert load_checkpoint(ck, *build(seed=1)) == (1, {"trees_consumed": 1})
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("where", ["optimizer", "model"])
def test_planted_object_in_dcp_shard_is_refused(ck, tmp_path, where):
    """A DCP shard whose non-tensor value (an optimizer hyperparameter) or model entry is a
    code-running object, written with DCP itself (so ``.metadata`` and offsets are consistent)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    marker = tmp_path / "pwned"
    model, opt, _ = build()
    step(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    msd, osd = get_state_dict(model, opt)
    if where == "optimizer":
        osd["param_groups"][0]["lr"] = Payload(marker)
    else:
        msd["lm_head.weight"] = Payload(marker)
    evil = tmp_path / "evil"
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=evil, no_dist=True)
    for f in evil.iterdir():
        shutil.copy(f, ck / "state" / f.name)
        plant(ck, f"state/{f.name}", f.read_bytes())
    with pytest.raises(CheckpointError, match=r"refused: .*could run code \(.*GLOBAL posix.mkdir"):
        load_checkpoint(ck, *build(seed=1))
    assert not marker.exists()


# ---- integrity ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_three(tmp_path_factory) -> Path:
    model, opt, sched = build()
    run = tmp_path_factory.mktemp("three")
    for s in (1, 2, 3):
        step(model, opt, sched)
        save_checkpoint(run, s, model, opt, sched, {"s": s}, keep=3)
    return run / "checkpoints"


def _three_checkpoints(saved_three: Path, tmp_path: Path) -> Path:
    """A fresh copy of three checkpoints (steps 1, 2, 3) in ``tmp_path/checkpoints``."""
    shutil.copytree(saved_three, tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


@pytest.mark.parametrize("rel", [*STATE_FILES, "scheduler.json", "rng/rank_0.json"])
def test_tampered_file_is_named_with_previous_good(saved_three, tmp_path, rel):
    root = _three_checkpoints(saved_three, tmp_path)
    f = root / "step_3" / rel
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path, *build(seed=1))
    msg = str(e.value)
    assert f"{rel} does not match its sha256" in msg
    assert f"the previous good checkpoint is {root / 'step_2'}" in msg


def test_truncated_file_and_corrupt_previous(saved_three, tmp_path):
    root = _three_checkpoints(saved_three, tmp_path)
    shard = root / "step_3" / "state" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    sched = root / "step_2" / "scheduler.json"
    sched.write_text(sched.read_text().replace("0", "1", 1))  # step_2 is bad too: step_1 is named
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(root / "step_3")
    assert "state/__0_0.distcp has" in str(e.value) and "bytes, expected" in str(e.value)
    assert f"the previous good checkpoint is {root / 'step_1'}" in str(e.value)
    (root / "step_1" / "meta.json").write_text("{")
    with pytest.raises(CheckpointError, match="no earlier checkpoint verifies"):
        verify_checkpoint(root / "step_3")


def test_missing_file_and_format_1_are_refused(tmp_path, ck):
    (ck / "rng" / "rank_0.json").unlink()
    with pytest.raises(CheckpointError, match="rng/rank_0.json is missing"):
        verify_checkpoint(ck)
    meta = json.loads((ck / "meta.json").read_text())
    (ck / "meta.json").write_text(json.dumps(meta | {"format": 1}))
    with pytest.raises(CheckpointError, match="format 1 stored RNG and scheduler state as pickles"):
        load_checkpoint(ck, *build(seed=1))


@pytest.mark.parametrize("rel", ["../../outside.json", "/etc/hostname"])
def test_manifest_paths_stay_inside_the_checkpoint(ck, rel):
    meta = json.loads((ck / "meta.json").read_text())
    meta["files"][rel] = {"bytes": 1, "sha256": "0" * 64}
    (ck / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="a path outside the checkpoint"):
        verify_checkpoint(ck)


def test_dcp_metadata_cannot_point_outside_the_checkpoint(ck):
    """A ``.metadata`` (only allowed classes) whose shard paths lead out of ``state/``."""
    import dataclasses

    from treetrain.train.safe_state import SafeReader

    metadata = SafeReader(ck / "state").read_metadata()
    metadata.storage_data = {
        k: dataclasses.replace(v, relative_path="../../../secret") for k, v in metadata.storage_data.items()
    }
    plant(ck, "state/.metadata", pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        load_checkpoint(ck, *build(seed=1))
