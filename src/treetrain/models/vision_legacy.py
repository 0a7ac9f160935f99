"""Precomputed image features for vision-language forwards that cannot take them (transformers < 5.24).

transformers 5.24's multimodal forwards take the encoder outputs ready-made (``mm_encoder_outputs``:
:mod:`treetrain.models.vision_encode` hands them the features of each distinct image, gathered
into DFS placeholder order). Older forwards (5.10.4, the version verl 0.9.1 installs) have no such
parameter: they encode ``pixel_values`` themselves, in the call
``self.get_image_features(pixel_values, image_grid_thw, **kwargs)``, and scatter its
``pooler_output`` (and Qwen3-VL's ``deepstack_features``) into the placeholders in order.

For such a forward, :func:`features_through_forward` hands the same precomputed outputs through
that call: for the duration of the forward, the model's ``get_image_features`` (and
``get_video_features``) is an instance attribute returning them (the class's method is untouched
and the attribute is removed after), and the forward gets a non-None stand-in ``pixel_values`` so it
takes its image branch. Its positions are the explicit ones the tree forward passes
(:mod:`treetrain.models.vision_positions`, the model's own ``compute_3d_position_ids`` per path,
which 5.10.4 has), so the stand-in's missing grids are never read.

The 5.10.4 output layout differs in one place: Qwen3-VL's ``deepstack_features`` is one flat
``[rows, H]`` tensor per layer (5.24: a list per layer, one entry per image, concatenated by the
forward), so each layer's list is concatenated here. Verified exact (float64, log-probs and every
gradient, vision tower included, against each path's own forward) on transformers 5.10.4 for
Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (``support_vision.VISION_EXACT_FROM``).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["features_through_forward", "takes_encoder_outputs"]

_METHOD = {"image": "get_image_features", "video": "get_video_features"}
_PIXELS = {"image": "pixel_values", "video": "pixel_values_videos"}
_KEY = "mm_encoder_outputs"
_NONE = object()


def takes_encoder_outputs(outer: nn.Module) -> bool:
    """Whether the multimodal model's forward takes ``mm_encoder_outputs`` (transformers >= 5.24)."""
    return _KEY in inspect.signature(outer.forward).parameters


def _legacy_layout(out):
    """A 5.24-layout encoder output as the 5.10 forward reads ``get_image_features``' output: each
    per-layer field (deepstack) one tensor per layer."""
    stacked = getattr(out, "deepstack_features", None)
    if stacked is not None:
        out.deepstack_features = [
            torch.cat(list(layer)) if isinstance(layer, (list, tuple)) else layer for layer in stacked
        ]
    return out


@contextmanager
def features_through_forward(outer: nn.Module, extra: dict):
    """The decoder keywords ``extra`` for ``outer``'s forward: as they are where it takes
    ``mm_encoder_outputs``; else, while the context is open, its precomputed outputs are what the
    forward's own ``get_image_features`` / ``get_video_features`` calls return, and stand-in
    ``pixel_values`` / ``pixel_values_videos`` make it take its image / video branch."""
    outputs = extra.get(_KEY)
    if outputs is None or takes_encoder_outputs(outer):
        yield extra
        return
    extra = {k: v for k, v in extra.items() if k != _KEY}
    saved = {}  # what the instance held before (a wrapper of its own), put back after
    try:
        for modality, out in outputs.items():
            name = _METHOD[modality]
            saved[name] = outer.__dict__.get(name, _NONE)
            out = _legacy_layout(out)
            object.__setattr__(outer, name, lambda *args, _out=out, **kwargs: _out)
            extra[_PIXELS[modality]] = torch.empty(0)  # read only by the (overridden) feature call
        yield extra
    finally:
        for name, before in saved.items():
            if before is _NONE:
                outer.__dict__.pop(name, None)
            else:
                outer.__dict__[name] = before
