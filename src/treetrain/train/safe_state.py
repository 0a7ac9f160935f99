"""Checkpoint state as plain data: nothing read back from a checkpoint can run code.

- RNG states (torch, CUDA, numpy, python) and the LR scheduler's ``state_dict`` are JSON
  (byte tensors as hex strings): :func:`rng_to_json` / :func:`rng_from_json`,
  :func:`scheduler_to_json` / :func:`scheduler_from_json`.
- Model and optimizer go through ``torch.distributed.checkpoint`` (DCP). Its tensors are read with
  ``torch.load(weights_only=True)`` already; its two other readers are replaced here:
  :class:`SafeReader` unpickles the ``.metadata`` file with an allow-list of DCP's own metadata
  classes (stock DCP uses a bare ``pickle.load``), and :class:`SafePlanner` reads the non-tensor
  values (the optimizer's ``param_groups``: floats, tuples, bools) with ``weights_only=True``
  (stock DCP: ``weights_only=False``).
- :func:`sha256_file`: the integrity hash the checkpoint manifest records per file.

Anything else in a file (a pickled callable, an unknown class) raises :class:`UnsafeStateError`.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

__all__ = [
    "SafePlanner",
    "SafeReader",
    "UnsafeStateError",
    "rng_from_json",
    "rng_to_json",
    "scheduler_from_json",
    "scheduler_to_json",
    "sha256_file",
]


class UnsafeStateError(ValueError):
    """A checkpoint file holds something other than the plain data treetrain writes."""


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# ---- RNG ---------------------------------------------------------------------------------------


def _bytes_hex(t: torch.Tensor) -> str:
    return bytes(t.cpu().numpy().tobytes()).hex()


def _hex_bytes(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, str):
        raise UnsafeStateError(f"{what}: expected a hex string, got {type(value).__name__}")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise UnsafeStateError(f"{what}: not a hex string") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _ints(value: Any, what: str, n: int) -> list[int]:
    if not (isinstance(value, list) and len(value) == n and all(type(v) is int for v in value)):
        raise UnsafeStateError(f"{what}: expected a list of {n} integers")
    return value


def rng_to_json(cuda: bool) -> str:
    """This process's RNG states as JSON. ``cuda``: include the current CUDA device's state."""
    np_key, np_state, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": _bytes_hex(torch.get_rng_state()),
        "numpy": {
            "key": np_key,
            "state": [int(x) for x in np_state],
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "python": {"version": py_version, "state": list(py_state), "gauss_next": py_gauss},
    }
    if cuda:
        state["cuda"] = _bytes_hex(torch.cuda.get_rng_state())
    return json.dumps(state)


def rng_from_json(text: str | bytes) -> None:
    """Restore the RNG states written by :func:`rng_to_json` (after checking every field)."""
    s = _json_object(text, "RNG state")
    try:
        torch_state = _hex_bytes(s["torch"], "torch")
        n, p = s["numpy"], s["python"]
        np_state = (
            str(n["key"]),
            np.array(_ints(n["state"], "numpy.state", 624), dtype=np.uint32),
            int(n["pos"]),
            int(n["has_gauss"]),
            float(n["cached_gaussian"]),
        )
        gauss = p["gauss_next"]
        if gauss is not None and not isinstance(gauss, float):
            raise UnsafeStateError("python.gauss_next: expected a number or null")
        py_state = (int(p["version"]), tuple(_ints(p["state"], "python.state", 625)), gauss)
        cuda = _hex_bytes(s["cuda"], "cuda") if "cuda" in s else None
    except (KeyError, TypeError) as e:
        raise UnsafeStateError(f"RNG state: missing or malformed field {e}") from None
    try:
        torch.set_rng_state(torch_state)
        np.random.set_state(np_state)
        random.setstate(py_state)
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda)
    except (RuntimeError, ValueError, TypeError) as e:
        raise UnsafeStateError(f"RNG state: rejected by the generator: {e}") from None


# ---- LR scheduler ------------------------------------------------------------------------------


def _json_object(text: str | bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise UnsafeStateError(f"{what}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise UnsafeStateError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def scheduler_to_json(scheduler: Any) -> str:
    """``scheduler.state_dict()`` as JSON; a scheduler whose state is not plain data (numbers,
    strings, lists, dicts) is a ``ValueError``: it cannot be checkpointed without pickling."""
    try:
        return json.dumps(scheduler.state_dict())
    except TypeError as e:
        raise ValueError(
            f"{type(scheduler).__name__}.state_dict() is not plain data ({e}); treetrain checkpoints "
            "store only JSON-serializable scheduler state"
        ) from None


def scheduler_from_json(scheduler: Any, text: str | bytes) -> None:
    scheduler.load_state_dict(_json_object(text, "scheduler state"))


# ---- DCP: metadata and non-tensor values -------------------------------------------------------

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name among torch's layouts
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata`` and nothing else: every class or function the pickle names must
    be one of DCP's metadata dataclasses, ``torch.Size``, a torch dtype or a path."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeStateError(
            f"the DCP metadata names {module}.{name}, which is not a checkpoint metadata type "
            "(refused: unpickling it could run code)"
        )


class SafeReader(FileSystemReader):
    """DCP's file reader with the ``.metadata`` pickle read by an allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except UnsafeStateError:
                raise
            except Exception as e:  # a truncated or garbled pickle
                raise UnsafeStateError(f"the DCP metadata does not unpickle: {e!r}") from None
        if not isinstance(metadata, Metadata):
            raise UnsafeStateError(f"the DCP metadata is a {type(metadata).__name__}, not a Metadata")
        for info in (metadata.storage_data or {}).values():  # shard files: names inside this directory
            rel = Path(str(getattr(info, "relative_path", "")))
            if rel.is_absolute() or len(rel.parts) != 1 or rel.name in ("", ".", ".."):
                raise UnsafeStateError(f"the DCP metadata points at {str(rel)!r}, outside the checkpoint")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            why = [ln for ln in str(e).splitlines() if "GLOBAL" in ln] or [str(e)]
            raise UnsafeStateError(
                f"{read_item.dest_index.fqn}: not plain data, unpickling it could run code ({why[0].strip()})"
            ) from None
        # hand the parent a re-serialization of the checked plain value (no private DCP helpers)
        plain = io.BytesIO()
        torch.save(obj, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)
