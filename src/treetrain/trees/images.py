"""Images in token paths: what an image is to the tree, and how it enters the trie key.

A vision-language model reads an image as a run of *placeholder* tokens (Qwen's ``<|image_pad|>``,
LLaVA's ``<image>``, ...) whose embeddings it replaces with the image's features, in order. A
placeholder is therefore not its token id alone: two paths with the same placeholder ids but
different pixels are different tokens. The trie is built on keys in which each placeholder carries
its image's content hash and its row in that image's features, so such paths part at the image,
and the same image reached by two paths is one set of features (encoded once per step).

Example: paths ``[1, P, P, 2]`` with image ``a`` and ``[1, P, P, 3]`` with image ``b != a`` (``P``
the placeholder id, 2 rows each): keys ``[1, K(a,0), K(a,1), 2]`` and ``[1, K(b,0), K(b,1), 3]``
share only ``1``; with ``b == a`` they share ``1 P P``.

:class:`ImageInput` is one image (or video) as the model's processor gives it: the tensors the
model's ``get_image_features`` takes for that image alone, how many placeholder tokens it fills
(the rows of its features) and which token id they carry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["ImageInput", "ImageTable", "keyed_paths", "resolve_keys"]

MODALITIES = ("image", "video")
_KEY_BASE = 1 << 62  # placeholder keys: base + (image << ROW_BITS) + row; token ids stay below it
ROW_BITS = 24  # up to 16.7M feature rows per image


def _tensor_digest(h, name: str, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image (or video) of a path, as its model reads it.

    ``tensors``: the keyword arguments of the model's ``get_image_features`` (``get_video_features``
    for a video) for this image alone, as its processor makes them: e.g. Qwen2-VL ``pixel_values
    [patches, C*T*P*P]`` and ``image_grid_thw [1, 3]``; LLaVA ``pixel_values [1, C, H, W]``.
    ``num_tokens``: the placeholder tokens it fills in a path (its feature rows).
    ``token_id``: the placeholder's token id (``config.image_token_id`` / ``video_token_id``).
    ``modality``: ``"image"`` or ``"video"``. ``key``: a content hash of the tensors (names, dtypes,
    shapes and bytes), computed once; equal keys mean the same image.

    Build them per image, or split a processor's batched output per row with
    :func:`treetrain.row_images`.
    """

    tensors: Mapping[str, torch.Tensor]
    num_tokens: int
    token_id: int
    modality: str = "image"
    key: bytes = field(default=b"", compare=False)

    def __post_init__(self):
        if self.modality not in MODALITIES:
            raise ValueError(f"ImageInput.modality: expected one of {MODALITIES}, got {self.modality!r}")
        if not isinstance(self.num_tokens, (int, np.integer)) or self.num_tokens < 1:
            raise ValueError(f"ImageInput.num_tokens: expected a positive int, got {self.num_tokens!r}")
        if self.num_tokens >= 1 << ROW_BITS:
            raise ValueError(f"ImageInput.num_tokens: {self.num_tokens} rows, at most {(1 << ROW_BITS) - 1}")
        bad = [k for k, v in self.tensors.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(f"ImageInput.tensors[{bad[0]!r}]: expected a torch.Tensor")
        if not self.key:
            h = hashlib.sha256(f"{self.modality}|{self.token_id}|{self.num_tokens}|".encode())
            for name in sorted(self.tensors):
                _tensor_digest(h, name, self.tensors[name])
            object.__setattr__(self, "key", h.digest())

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self.tensors.items())
        return f"ImageInput({self.modality}, {self.num_tokens} tokens, id {self.token_id}, {shapes})"


@dataclass(frozen=True)
class ImageTable:
    """The images of a tree: ``images`` (distinct, by content hash, in order of first use) and for
    every DFS token ``image [T]`` (index into ``images``, -1 for text) and ``row [T]`` (the feature
    row of that image it carries, -1 for text)."""

    images: tuple[ImageInput, ...]
    image: np.ndarray
    row: np.ndarray


def _check_images(i: int, imgs) -> list[ImageInput]:
    if imgs is None:
        return []
    if not isinstance(imgs, Sequence) or isinstance(imgs, (str, bytes)):
        raise ValueError(f"images[{i}]: expected a list of ImageInput (one per image of path {i}, in order)")
    for j, im in enumerate(imgs):
        if not isinstance(im, ImageInput):
            raise ValueError(
                f"images[{i}][{j}]: expected an ImageInput, got {type(im).__name__} (build them with "
                "treetrain.ImageInput, or treetrain.row_images from the processor's batched output)"
            )
    return list(imgs)


def keyed_paths(
    paths: Sequence[np.ndarray], images: Sequence[Sequence[ImageInput] | None]
) -> tuple[list[np.ndarray], list[ImageInput]]:
    """Each path with its placeholder tokens replaced by keys that carry their image, and the
    distinct images (by content hash, in order of first use).

    Path ``i``'s placeholders (its tokens whose id is the ``token_id`` of one of its images) are
    consumed in order: the first ``images[i][0].num_tokens`` belong to its first image, and so on.
    Raises ``ValueError`` naming the path when the counts or ids do not match.
    """
    distinct: dict[bytes, int] = {}
    table: list[ImageInput] = []
    out = []
    for i, (path, imgs) in enumerate(zip(paths, images)):
        imgs = _check_images(i, imgs)
        if not imgs:
            out.append(path)
            continue
        ids = np.array(sorted({im.token_id for im in imgs}), dtype=np.int64)
        where = np.flatnonzero(np.isin(path, ids))
        need = sum(im.num_tokens for im in imgs)
        if where.size != need:
            counts = " + ".join(str(im.num_tokens) for im in imgs)
            raise ValueError(
                f"path {i}: {where.size} image placeholder tokens (ids {ids.tolist()}) but its "
                f"{len(imgs)} image(s) fill {counts} = {need}; each image's placeholders must be in the "
                "path, in the order of its images (render the text with the model's processor)"
            )
        keyed = path.copy()
        start = 0
        for j, im in enumerate(imgs):
            at = where[start : start + im.num_tokens]
            if not (path[at] == im.token_id).all():
                raise ValueError(
                    f"path {i}, image {j} ({im.modality}): its placeholders must be token {im.token_id}, "
                    f"found {sorted(set(path[at].tolist()) - {im.token_id})} among them"
                )
            g = distinct.setdefault(im.key, len(table))
            if g == len(table):
                table.append(im)
            keyed[at] = _KEY_BASE + (g << ROW_BITS) + np.arange(im.num_tokens)
            start += im.num_tokens
        out.append(keyed)
    return out, table


def resolve_keys(keys: np.ndarray, table: Sequence[ImageInput]) -> tuple[np.ndarray, ImageTable]:
    """Trie keys ``[T]`` -> the real token ids ``[T]`` and the tree's :class:`ImageTable`."""
    is_image = keys >= _KEY_BASE
    rel = np.where(is_image, keys - _KEY_BASE, 0)
    image = np.where(is_image, rel >> ROW_BITS, -1)
    row = np.where(is_image, rel & ((1 << ROW_BITS) - 1), -1)
    token_of = np.array([im.token_id for im in table] or [0], dtype=np.int64)
    tokens = np.where(is_image, token_of[np.maximum(image, 0)], keys)
    return tokens, ImageTable(tuple(table), image.astype(np.int64), row.astype(np.int64))
