"""The vision-language rollout batch of tests/verl_vlm_worker.py, as verl's agent loop builds it (no
verl import: the unit tests use it in a process whose verl platform is chosen)."""

from __future__ import annotations

import torch

from tests.vlm_zoo import IMAGE

VISION_START, VISION_END = 102, 103


def image(model, seed: int, grid=(1, 4, 6)) -> dict[str, torch.Tensor]:
    """One image as a Qwen-VL processor makes it: flattened patches, its (t, h, w) grid."""
    vc = model.config.vision_config
    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    pixels = torch.randn(t * h * w, patch, generator=g)
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor([grid])}


def placeholders(model, image) -> list[int]:
    merge = model.config.vision_config.spatial_merge_size
    return [VISION_START] + [IMAGE] * (int(image["image_grid_thw"].prod()) // merge**2) + [VISION_END]


def mm_inputs(images: list[dict]) -> dict:
    """A row's ``multi_modal_inputs`` as verl's agent loop stores it (empty without images)."""
    if not images:
        return {}
    grid = torch.cat([im["image_grid_thw"] for im in images])
    return {
        "pixel_values": torch.cat([im["pixel_values"] for im in images]),
        "image_grid_thw": grid,
        "images_seqlens": torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]),
    }


def rope_positions(model, ids: torch.Tensor, mm: dict) -> torch.Tensor:
    """``[4, L]``: verl's agent loop's ``_compute_position_ids`` (text row, then the model's own
    ``get_rope_index`` with ``mm_token_type_ids`` marking the image placeholders)."""
    L = ids.numel()
    if not mm:
        return torch.arange(L).expand(4, L).clone()
    types = (ids == IMAGE).long()[None]
    grid = mm["image_grid_thw"]
    rope, _ = model.model.get_rope_index(
        ids[None], mm_token_type_ids=types, image_grid_thw=grid, attention_mask=torch.ones(1, L)
    )
    return torch.cat([torch.arange(L)[None], rope[:, 0]])


def global_batch(model, seed: int = 0) -> tuple[dict, list[dict]]:
    """verl's padded rollout layout (prompts left-, responses right-padded) and each row's images."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, 100, (n,), generator=g).tolist()  # noqa: E731
    a, b, c = image(model, 1), image(model, 2), image(model, 3, grid=(1, 2, 4))
    prompt_a = draw(2) + placeholders(model, a) + draw(3)
    prompt_b = draw(2) + placeholders(model, b) + draw(3)  # a's ids and grid, b's pixels
    r0, r1 = draw(6), draw(7)
    s0, s2 = draw(5), draw(4)
    tool = draw(2) + placeholders(model, c) + draw(2)  # an image in the response (a tool result)
    rows = [
        (prompt_a, r0, [a]), (prompt_a, r1, [a]), (prompt_a, list(r0), [a]), (prompt_a, r1[:3], [a]),
        (prompt_b, s0, [b]), (prompt_b, s0[:2] + tool, [b, c]), (prompt_b, s2, [b]),
        (draw(9), draw(5), []),
    ]  # fmt: skip
    B = len(rows)
    P, R = max(len(p) for p, _, _ in rows), max(len(r) for _, r, _ in rows)
    prompts, responses = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    pmask, rmask = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    position_ids = torch.zeros(B, 4, P + R, dtype=torch.long)
    mm = []
    for i, (p, r, ims) in enumerate(rows):
        prompts[i, P - len(p) :], pmask[i, P - len(p) :] = torch.tensor(p), 1
        responses[i, : len(r)], rmask[i, : len(r)] = torch.tensor(r), 1
        mm.append(mm_inputs(ims))
        attention = torch.cat([pmask[i], rmask[i]]).bool()
        position_ids[i][:, attention] = rope_positions(model, torch.tensor(p + r), mm[-1])
    response_mask = rmask * ((responses != IMAGE) & (responses != VISION_START) & (responses != VISION_END))
    adv = torch.randn(B, 1, generator=g).expand(B, R) * rmask  # GRPO: one advantage per sample
    full = dict(
        prompts=prompts,
        responses=responses,
        input_ids=torch.cat([prompts, responses], 1),
        attention_mask=torch.cat([pmask, rmask], 1),
        position_ids=position_ids,
        response_mask=response_mask,  # a tool result's image tokens are not the policy's
        old_log_probs=(-2.0 - torch.rand(B, R, generator=g)) * rmask,
        ref_log_prob=(-2.0 - torch.rand(B, R, generator=g)) * rmask,
        advantages=adv.contiguous(),
        values=torch.randn(B, R, generator=g) * rmask,
        returns=torch.randn(B, R, generator=g) * rmask,
    )
    return full, mm
