"""treetrain's verl engine with images (Qwen2.5-VL, Qwen3-VL) == verl's own FSDP2 engine, same batch.

verl hands a vision-language micro-batch with ``multi_modal_inputs`` (per row the processor's
``pixel_values``, ``image_grid_thw``, ``images_seqlens``) and ``position_ids [B, 4, j]`` (text
positions, then the model's 3-D rotary rows): ``treetrain.integrations.verl_images`` splits each
row's inputs into one ``ImageInput`` per image (rows sharing a prompt's image share its tokens and
its encode; identical placeholder ids with other pixels part at the image) and checks verl's
rotary positions against the model's own.

The end-to-end cases run ``tests/verl_vlm_worker.py`` under torchrun (Qwen2.5-VL on 1 and 2 gloo
ranks, Qwen3-VL, with deepstack features, on 2) (its
docstring: a GRPO group sharing an image prompt, a group with another image of the same size, a
second image in a tool result, a text-only row; verl's engine runs padded, as its packed
vision-language path is flash-attention only). Compared as in ``tests/test_integrations_verl.py``:
log-probs and entropies, verl's PPO loss, every gradient (vision tower included), ``train_batch``'s
grad norm, each within 4x verl's own float32 error against a float64 per-row HF forward.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

from treetrain.integrations import verl as tv  # noqa: E402
from treetrain.integrations.verl_images import check_rope_positions, check_unpatched, row_images  # noqa: E402
from treetrain.integrations.verl_rows import RowTree  # noqa: E402

from .test_integrations_verl import _check_role  # noqa: E402
from .verl_vlm_batch import image, mm_inputs, placeholders, rope_positions  # noqa: E402
from .vlm_zoo import vlm_model  # noqa: E402

HERE = os.path.dirname(__file__)
IMAGE = 100
CONFIG = SimpleNamespace(image_token_id=IMAGE, vision_config=SimpleNamespace(spatial_merge_size=2))
MODEL = SimpleNamespace(config=CONFIG)


def _mm(*grids, seed=0) -> dict:
    """A row's ``multi_modal_inputs`` for images of these ``(t, h, w)`` grids (random patches)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor(grids)
    return {
        "pixel_values": torch.randn(int(grid.prod(-1).sum()), 12, generator=g),
        "image_grid_thw": grid,
        "images_seqlens": grid[:, 1] * grid[:, 2],
    }


def _batch(rows, mm) -> TensorDict:
    ids = torch.nested.as_nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)
    td = TensorDict({"input_ids": ids}, batch_size=[len(rows)])
    tu.assign_non_tensor(td, multi_modal_inputs=mm)
    return td


def test_rows_become_a_tree_with_images():
    """Two samples of a prompt with image ``a`` share its tokens; a prompt with the same placeholder
    ids and grid but other pixels (``b``) parts at the image; a second image in a row; a text row."""
    a, b = _mm((1, 2, 4), seed=1), _mm((1, 2, 4), seed=2)
    prompt = [5, IMAGE, IMAGE, 6]  # 8 patches, 2x2 merge: 2 placeholders
    rows = [prompt + [7, 8], prompt + [9], prompt + [7, 8], [5, 6, 7]]
    ab = {k: torch.cat([a[k], b[k]]) for k in a}
    rows.append(prompt + [3, IMAGE, IMAGE])  # a, then b in a tool result
    mm = [{k: v.clone() for k, v in a.items()}, dict(a), dict(b), {}, ab]
    images = row_images(_batch(rows, mm), MODEL)
    assert [len(r) for r in images] == [1, 1, 1, 0, 2]
    assert [im.num_tokens for im in images[4]] == [2, 2]
    assert images[0][0].key == images[1][0].key == images[4][0].key  # a, as separate copies
    assert images[2][0].key != images[0][0].key == images[4][0].key
    assert images[4][1].key == images[2][0].key
    flat = [t for r in rows for t in r]
    offsets = torch.tensor(np.cumsum([0] + [len(r) for r in rows]))
    tree = RowTree.build(torch.tensor(flat), offsets, images=images)
    # 5 (every row); a a 6, then [7 8], [9], [3 b b]; b b 6 7 8 (b's prompt parts at the image); 6 7
    assert tree.num_tokens == 1 + (3 + 2 + 1 + 3) + 5 + 2
    assert len(tree.packed.images) == 2  # a and b, each encoded once
    assert row_images(_batch([[5, 6]], [{}]), MODEL) is None  # no images: a text tree


def test_row_images_refuse_what_they_cannot_run():
    rows = [[5, IMAGE, IMAGE, 6]]
    video = {"pixel_values_videos": torch.zeros(8, 12), "video_grid_thw": torch.tensor([[2, 2, 2]])}
    with pytest.raises(ValueError, match="video inputs"):
        row_images(_batch(rows, [video]), MODEL)
    bad = _mm((1, 2, 4))
    bad["pixel_values"] = bad["pixel_values"][:6]
    with pytest.raises(ValueError, match="row 0: 6 patches"):
        row_images(_batch(rows, [bad]), MODEL)


def test_verls_rotary_positions_are_checked_against_the_models():
    model = vlm_model("qwen2_5_vl", dtype=torch.float32)
    a = image(model, 1)
    rows = [[5] + placeholders(model, a) + [6, 7], [5] + placeholders(model, a) + [8], [5, 6, 7]]
    mm = [mm_inputs([a]), mm_inputs([a]), {}]
    td = _batch(rows, mm)
    pos = torch.cat([rope_positions(model, torch.tensor(r), m) for r, m in zip(rows, mm)], 1)
    ids = td["input_ids"]
    tree = RowTree.build(ids.values(), ids.offsets(), pos, model, row_images(td, model))
    check_rope_positions(pos[1:], tree.dfs, tree.packed, model)  # verl's == the model's own
    wrong = pos.clone()
    wrong[2, 4] += 1  # one placeholder's height
    with pytest.raises(ValueError, match="packed position 4"):
        check_rope_positions(wrong[1:], tree.dfs, tree.packed, model)


def test_vision_configs_and_patched_classes():
    hf = SimpleNamespace(model_type="qwen2_5_vl", vision_config={})
    model = SimpleNamespace(hf_config=hf, lora_rank=0, lora_adapter_path=None, use_liger=False,
                            use_fused_kernels=False)  # fmt: skip
    engine = SimpleNamespace(ulysses_sequence_parallel_size=1, qat=SimpleNamespace(enable=False))
    tv.check_supported(model, engine, vision=True)  # the actor runs it
    with pytest.raises(ValueError, match="'qwen2_5_vl' as a critic"):
        tv.check_supported(model, engine)
    hf.model_type = "llava"
    with pytest.raises(ValueError, match="'llava' \\(it runs qwen2_5_vl"):
        tv.check_supported(model, engine, vision=True)
    td = TensorDict({}, batch_size=[1])
    tu.assign_non_tensor(td, multi_modal_inputs=[{}])
    tv._check_micro_batch(td, vision=True)
    with pytest.raises(ValueError, match="multi_modal_inputs"):
        tv._check_micro_batch(td, vision=False)

    class Patched(torch.nn.Module):
        pass

    Patched.forward = lambda self: None
    Patched.forward.__module__ = "verl.models.transformers.qwen2_vl"
    check_unpatched({torch.nn.Linear})
    with pytest.raises(ValueError, match="Patched.forward is verl's"):
        check_unpatched({torch.nn.Linear, Patched})


def _run_worker(tmp_path, world: int, model_type: str) -> list[dict]:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "src"), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--standalone",
           os.path.join(HERE, "verl_vlm_worker.py"), str(tmp_path), model_type]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("model_type, world", [("qwen2_5_vl", 1), ("qwen2_5_vl", 2), ("qwen3_vl", 2)])
def test_tree_engine_equals_verl_engine_with_images(tmp_path, model_type, world):
    """verl's no-padding batch (``v0``) and the V1 trainer's nested one (``v1``); on 2 ranks a rank's
    text-only micro-batch runs beside the other's images (the tower on a blank image, as verl's
    forward: the ranks' all-gathers match)."""
    results = _run_worker(tmp_path, world, model_type)
    patched = f"ForConditionalGeneration.forward is verl's (verl.models.transformers.{model_type[:5]}_vl)"
    for res in results:
        for layout in ("v0", "v1"):
            lm = res["lm"][layout]
            _check_role(lm, ("log_probs", "entropy"), last=lm["last"])
            assert any(name.startswith("model.visual.") for name in lm["verl"]["grads"])
        # after verl's engine patched transformers' classes, the tree engine refuses by name
        assert patched in res["refused"], res["refused"]
    if world == 2:
        text_only = [r["text_only_forwards"] for r in results]
        assert any(any(t) for t in text_only) and not all(any(t) for t in text_only)
