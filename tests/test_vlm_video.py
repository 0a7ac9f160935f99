"""Videos in trees: the types of ``support_vision.VIDEO_EXACT`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen3.5, their MoE variants) with videos of t > 1 temporal patches whose frames differ, through the
model's own ``get_video_features`` and 3D positions (temporal positions per frame; Qwen2.5-VL's
spaced by ``second_per_grid_ts``; Qwen3-style frames each after their timestamp), against each path's
own Hugging Face forward with its videos and images; every other type refuses a video by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from treetrain.logprobs import path_logprobs
from treetrain.models.support import VERIFIED_FROM, _version
from treetrain.models.support_vision import VIDEO_EXACT
from treetrain.trees.images import ImageInput

from .hybrid_models import float64_everywhere
from .reference import rel_err
from .test_vlm_zoo import (
    F64_GRAD,
    F64_LOGP,
    IMAGE_MOVES,
    SHIPPED_GRAD,
    SHIPPED_LOGP,
    _per_param,
    _run,
)
from .vlm_zoo import VIDEO, video_tree, vlm_model

NEW_ENOUGH = _version(transformers.__version__) >= _version(VERIFIED_FROM)


def _last_frame_changed(video: ImageInput) -> ImageInput:
    """``video`` with its last temporal patch's pixels redrawn (rows are frame-major)."""
    t, h, w = video.tensors["video_grid_thw"][0].tolist()
    pv = video.tensors["pixel_values_videos"].clone()
    pv[(t - 1) * h * w :] = torch.randn_like(pv[(t - 1) * h * w :])
    return ImageInput({**video.tensors, "pixel_values_videos": pv}, video.num_tokens, video.token_id, "video")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(VIDEO_EXACT))
def test_video_exact(model_type):
    """Tree log-probs and every parameter gradient equal each path's own forward with its videos:
    float64 (casts lifted) to rounding, as shipped within HF's own float32 error; and changing one
    frame of a video moves the log-probs of the path that holds it."""
    if not NEW_ENOUGH:
        pytest.skip(f"transformers {transformers.__version__}: videos are verified on {VERIFIED_FROM} on")
    base = vlm_model(model_type)
    paths, videos = video_tree(base)
    with float64_everywhere():
        truth_lp, truth = _run(copy.deepcopy(base), paths, videos, tree=False)
        f64_lp, f64 = _run(copy.deepcopy(base), paths, videos, tree=True)
        with torch.no_grad():
            changed = [[videos[0][0], _last_frame_changed(videos[0][1])], *videos[1:]]
            moved = path_logprobs(base, paths, images=changed)
    logp = max(rel_err(a, b) for a, b in zip(f64_lp, truth_lp))
    worst = max(_per_param(f64, truth).items(), key=lambda kv: kv[1])
    assert logp < F64_LOGP and worst[1] < F64_GRAD, (model_type, logp, worst)
    assert rel_err(moved[0], f64_lp[0]) > IMAGE_MOVES, model_type  # the changed frame acts
    # only in its own path (to rounding: MoE experts batch the changed tokens with the others)
    assert max(rel_err(a, b) for a, b in zip(moved[1:], f64_lp[1:])) < F64_LOGP, model_type
    # as shipped: the bounds of test_vlm_exact
    ref_lp, ref = _run(copy.deepcopy(base), paths, videos, tree=False)
    got_lp, got = _run(copy.deepcopy(base), paths, videos, tree=True)
    assert max(rel_err(a, b) for a, b in zip(got_lp, ref_lp)) < SHIPPED_LOGP, model_type
    own = _per_param(ref, truth)
    off = {n: e for n, e in _per_param(got, ref).items() if e >= max(SHIPPED_GRAD, 2 * own[n])}
    assert not off, (model_type, off)


def test_video_refused_by_name():
    """A type verified with images only refuses a video through path_logprobs, naming the type, the
    input and what works (LLaVA-NeXT-Video: its name says video; its video path is not compared)."""
    model = vlm_model("llava_next_video")
    vc = model.config.vision_config
    video = ImageInput(
        {"pixel_values_videos": torch.randn(1, 2, 3, vc.image_size, vc.image_size, dtype=torch.float64)},
        num_tokens=2,
        token_id=VIDEO,
        modality="video",
    )
    with pytest.raises(ValueError, match=r"video inputs .*'llava_next_video'.*images only.*frames as images"):
        path_logprobs(model, [[5, 6, VIDEO, VIDEO, 7]], images=[[video]])
