"""Images in chat records: loading image parts, and expanding the template's image markers into the
model's placeholder runs with one :class:`~treetrain.trees.images.ImageInput` per image.

Accepted image parts of a message's ``content`` list (user, tool, any role):

- OpenAI: ``{"type": "image_url", "image_url": {"url": URL}}`` (``image_url`` may be the URL string)
- Hugging Face: ``{"type": "image", "path" | "url" | "image": ...}``
- TRL: ``{"type": "image"}`` placeholders taking the record's ``images`` list in order

A URL or path is ``data:image/...;base64,...``, an absolute path, or a path relative to the data
file's directory (:data:`BASE_DIR`). A table's image feature (``{"bytes": ..., "path": ...}``) and PIL
images are accepted too. Each part becomes ``{"type": "image"}`` for the chat template; the rendered
text is tokenized and each image marker token (``config.image_token_id``, rendered once per image)
is expanded into the image's placeholder run (Qwen2-VL-style grids: ``prod(grid_thw) / merge^2``
tokens). Placeholders never get loss. The image's key is the sha256 of its decoded RGB pixels (and
size), so identical screenshots in two rows merge and different pixels part.
"""

from __future__ import annotations

import base64
import binascii
import contextvars
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BASE_DIR", "ImageError", "VisionInfo", "expand_images", "extract_images", "vision_info"]

BASE_DIR: contextvars.ContextVar[Path | None] = contextvars.ContextVar("treetrain_image_base", default=None)
_ATTR = "_treetrain_vision"


class ImageError(ValueError):
    """A bad image part; ``where`` locates it in the conversation (message index, ``content``, part)."""

    def __init__(self, message: str, where: tuple = ()):
        super().__init__(message)
        self.where = where


@dataclass(frozen=True)
class VisionInfo:
    """A model directory's image side: its image processor, placeholder token id, spatial merge."""

    image_processor: Any
    image_token_id: int
    merge: int
    max_pixels: int | None
    model_dir: str


def vision_info(tokenizer) -> VisionInfo | None:
    """The :class:`VisionInfo` :func:`attach_vision` put on ``tokenizer``, else None (text-only)."""
    return getattr(tokenizer, _ATTR, None)


def attach_vision(tokenizer, path: Path) -> None:
    """When ``path`` is a vision-language model directory with an image processor, load it (offline)
    and attach a :class:`VisionInfo` to ``tokenizer``."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file() or not any(
        (path / f).is_file() for f in ("processor_config.json", "preprocessor_config.json")
    ):
        return
    cfg = json.loads(cfg_file.read_text())
    token = cfg.get("image_token_id", cfg.get("image_token_index"))
    if token is None:
        return
    from transformers import AutoImageProcessor

    ip = AutoImageProcessor.from_pretrained(str(path), local_files_only=True, backend="pil")
    merge = int(getattr(ip, "merge_size", None) or cfg.get("vision_config", {}).get("spatial_merge_size", 1))
    size = getattr(ip, "size", None) or {}
    # Qwen2-VL's processors keep max_pixels as size["longest_edge"] (a pixel count, not an edge)
    longest = size.get("longest_edge") if hasattr(size, "get") else getattr(size, "longest_edge", None)
    max_pixels = (getattr(ip, "max_pixels", None) or longest) if hasattr(ip, "merge_size") else None
    setattr(tokenizer, _ATTR, VisionInfo(ip, int(token), merge, max_pixels, str(path)))


# ---- loading ------------------------------------------------------------------------------------


def _open(source: Any, what: str):
    from PIL import Image

    try:
        if isinstance(source, Image.Image):
            return source.convert("RGB")
        if isinstance(source, dict):  # a datasets Image feature
            if source.get("bytes"):
                return Image.open(io.BytesIO(source["bytes"])).convert("RGB")
            source = source.get("path")
        if not isinstance(source, str) or not source:
            raise ImageError(f"{what}: expected a data URL or a file path, got {type(source).__name__}")
        if source.startswith("data:"):
            head, _, payload = source.partition(",")
            if not head.endswith(";base64") or not payload:
                raise ImageError(f"{what}: bad data URL (expected data:image/<type>;base64,<data>)")
            try:
                raw = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ImageError(f"{what}: bad data URL: its base64 payload does not decode") from None
            return Image.open(io.BytesIO(raw)).convert("RGB")
        if source.startswith(("http://", "https://")):
            raise ImageError(f"{what}: {source} is a web URL; treetrain never downloads: save it to a file")
        p = Path(source)
        if not p.is_absolute():
            p = (BASE_DIR.get() or Path.cwd()) / p
        if not p.is_file():
            raise ImageError(f"{what}: image file {p} not found (paths are relative to the data file)")
        return Image.open(p).convert("RGB")
    except ImageError:
        raise
    except Exception as e:  # PIL.UnidentifiedImageError, OSError, truncated data
        msg = f"{what}: unreadable image ({type(e).__name__}: {e}); give a PNG/JPEG file"
        raise ImageError(msg) from None


def _source(part: dict):
    t = part.get("type")
    if t == "image_url":
        u = part.get("image_url")
        return u.get("url") if isinstance(u, dict) else u
    for k in ("image", "path", "url"):
        if part.get(k) is not None:
            return part[k]
    return None


def extract_images(messages: list[dict], images: list | None = None) -> tuple[list[dict], list, list]:
    """Messages with every image part replaced by ``{"type": "image"}``, the loaded PIL images (in
    order) and where each part is (``(message, "content", part)``). ``images``: the record's TRL
    ``images`` column, taken in order by bare ``{"type": "image"}`` parts."""
    out, pil, wheres = [], [], []
    column = list(images or [])
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                where = (i, "content", j)
                src = _source(part)
                if src is None:
                    if not column:
                        msg = "an image placeholder with no image left in the record's images"
                        raise ImageError(msg, where)
                    src = column.pop(0)
                try:
                    pil.append(_open(src, "image"))
                except ImageError as e:
                    raise ImageError(str(e), where) from None
                wheres.append(where)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**m, "content": parts})
    if column:
        n = len(column)
        raise ImageError(f"{n} image(s) of the record's images have no {{'type': 'image'}} placeholder")
    return out, pil, wheres


# ---- expanding ----------------------------------------------------------------------------------


def _pixel_key(img) -> bytes:
    h = hashlib.sha256(f"{img.size}|{img.mode}|".encode())
    h.update(img.tobytes())
    return h.digest()


def expand_images(
    info: VisionInfo, ids: list[int], mask: list[int], images: list, wheres: list
) -> tuple[np.ndarray, np.ndarray, list]:
    """Rendered ``ids [T]`` / ``mask [T]`` with one marker token per image -> ids and mask with each
    marker expanded to its placeholder run (mask 0 there), and one ImageInput per image, in order."""
    import torch

    from treetrain.trees.images import ImageInput

    ids_a = np.asarray(ids, dtype=np.int64)
    at = np.flatnonzero(ids_a == info.image_token_id)
    if at.size != len(images):
        raise ImageError(
            f"the chat template rendered {at.size} image markers for {len(images)} image parts (a "
            "template that drops images, e.g. in tool or system messages, would train without them): fix "
            "the template or move the image to a message whose images it renders",
            wheres[min(at.size, len(wheres) - 1)] if wheres else (),
        )
    out_ids, out_mask, inputs, prev = [], [], [], 0
    for pos, img, where in zip(at, images, wheres):
        w, h = img.size
        if info.max_pixels and w * h > info.max_pixels:
            raise ImageError(
                f"image of {w}x{h} = {w * h} pixels exceeds the processor's max_pixels {info.max_pixels} "
                "(it would be resized, silently); downscale it, or raise max_pixels in the model "
                f"directory's processor config ({info.model_dir})",
                where,
            )
        try:
            feats = info.image_processor(images=[img], return_tensors="pt")
        except Exception as e:
            raise ImageError(f"the image processor failed on it ({type(e).__name__}: {e})", where) from None
        tensors = {k2: v for k2, v in feats.items() if isinstance(v, torch.Tensor)}
        grid = tensors.get("image_grid_thw")
        if grid is None:
            raise ImageError(
                "images from chat records are supported for grid processors (Qwen2-VL, Qwen2.5-VL, "
                f"Qwen3-VL); {type(info.image_processor).__name__} is not (use the TRL trainers)",
                where,
            )
        n = int(grid.prod()) // (info.merge**2)
        if n < 1 or n * info.merge**2 != int(grid.prod()):
            raise ImageError(f"image grid {grid.tolist()} does not divide into merge {info.merge}", where)
        out_ids += [ids_a[prev:pos], np.full(n, info.image_token_id)]
        out_mask += [np.asarray(mask[prev:pos], dtype=np.float64), np.zeros(n)]
        prev = pos + 1
        inputs.append(ImageInput(tensors, num_tokens=n, token_id=info.image_token_id, key=_pixel_key(img)))
    out_ids.append(ids_a[prev:])
    out_mask.append(np.asarray(mask[prev:], dtype=np.float64))
    return np.concatenate(out_ids).astype(np.int64), np.concatenate(out_mask), inputs
