"""flat_logprobs == each row of the padded batch alone through the unmodified HF model (float64):
log-probs, entropies and every parameter gradient, for left/right padding, duplicate rows, rows that
are prefixes of others, a single row, temperature, a token budget, and nothing scored."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treetrain.integrations.flat import FlatBatch, flat_logprobs

from .reference import float64_casts, grad_err, grads, reference_copy, rel_err, tiny_model

PAD = 0
# rows: a group sharing [3 4 5], a duplicate, a prefix of another row, an unrelated row
ROWS = [[3, 4, 5, 6, 7, 8], [3, 4, 5, 9, 10], [3, 4, 5, 6, 7, 8], [3, 4, 5, 6], [11, 12, 13, 14, 15, 16, 17]]


def padded(rows, side: str, width: int | None = None):
    """``input_ids``, ``attention_mask`` ``[B, width]`` with each row padded on ``side``."""
    width = width or max(map(len, rows))
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        cols = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[b, cols] = torch.tensor(r)
        mask[b, cols] = 1
    return ids, mask


def reference(model, ids, mask, want, temperature=1.0):
    """Each row's real tokens alone through the HF model: ``[B, L]`` log-probs and entropies at ``want``."""
    B, L = ids.shape
    logp = torch.zeros(B, L, dtype=torch.float64)
    ent = torch.zeros(B, L, dtype=torch.float64)
    out_lp, out_ent = [], []
    for b in range(B):
        cols = torch.nonzero(mask[b])[:, 0]
        if cols.numel() < 2:
            continue
        logits = model(input_ids=ids[b, cols][None], use_cache=False).logits[0, :-1] / temperature
        lsm = torch.log_softmax(logits, -1)
        lp = lsm.gather(1, ids[b, cols[1:], None])[:, 0]
        en = -(lsm.exp() * lsm).sum(-1)
        keep = want[b, cols[1:]]
        out_lp.append((b * L + cols[1:][keep], lp[keep]))
        out_ent.append((b * L + cols[1:][keep], en[keep]))
    if out_lp:
        pos = torch.cat([p for p, _ in out_lp])
        logp = logp.view(-1).index_put((pos,), torch.cat([v for _, v in out_lp])).view(B, L)
        ent = ent.view(-1).index_put((pos,), torch.cat([v for _, v in out_ent])).view(B, L)
    return logp, ent


def compare(rows, side, *, keep=None, temperature=1.0, max_tokens=None, seed=0, width=None):
    """Max relative errors (log-probs, entropies, gradients) of flat_logprobs vs the reference."""
    ids, mask = padded(rows, side, width)
    B, L = ids.shape
    want = torch.ones(B, L, dtype=torch.bool)
    if keep is not None:
        want[:, : L - keep] = False
    with float64_casts():
        model = tiny_model("qwen3", seed=seed)
        ref = reference_copy(model)
        lp, ent = flat_logprobs(
            model, ids, mask, logits_to_keep=keep, temperature=temperature, return_entropy=True,
            max_tokens=max_tokens, backend="dense",
        )  # fmt: skip
        ref_lp, ref_ent = reference(ref, ids, mask, want, temperature)
        if keep is not None:
            ref_lp, ref_ent = ref_lp[:, L - keep :], ref_ent[:, L - keep :]
        g = torch.Generator().manual_seed(seed)
        c1, c2 = torch.randn(lp.shape, generator=g, dtype=torch.float64), torch.randn(lp.shape, generator=g)
        ((c1 * lp).sum() + (c2.double() * ent).sum()).backward()
        if not ref_lp.requires_grad:  # nothing to score (one-token rows): all zeros, no gradient
            assert not lp.any() and all(p.grad is None or not p.grad.any() for p in model.parameters())
            return 0.0, 0.0, 0.0
        ((c1 * ref_lp).sum() + (c2.double() * ref_ent).sum()).backward()
    assert lp.shape == ref_lp.shape and ent.shape == ref_lp.shape
    assert (lp[ref_lp == 0] == 0).all()  # padding and unscored positions are exactly 0
    if lp.numel() == 0:  # logits_to_keep=0
        return 0.0, 0.0, grad_err(grads(model), grads(ref))
    return rel_err(lp, ref_lp), rel_err(ent, ref_ent), grad_err(grads(model), grads(ref))


# float64 with HF's float32 casts lifted: only summation orders differ (SDPA over the tree vs over
# one row, chunked head), a few ulps amplified through 2 layers; 1e-11 leaves margin over ~1e-14.
TOL = 1e-11


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("keep", [None, 3])
def test_float64_matches_rows_alone(side, keep):
    errs = compare(ROWS, side, keep=keep)
    assert max(errs) < TOL, errs


def test_temperature_divides_logits():
    errs = compare(ROWS, "left", keep=4, temperature=0.7)
    assert max(errs) < TOL, errs


def test_single_row_and_wider_padding():
    errs = compare([[5, 6, 7, 8]], "left", width=7)
    assert max(errs) < TOL, errs


def test_token_budget_splits_forwards_same_result():
    # 15 distinct tokens; a budget of 7 forces several forwards, the 7-token row alone
    errs = compare(ROWS, "right", keep=5, max_tokens=7)
    assert max(errs) < TOL, errs
    batch = FlatBatch.build(*padded(ROWS, "right"), logits_to_keep=5)
    assert batch.tree.num_tokens == 15 and len(batch.parts(7)) > 1
    assert len(batch.parts(3)) > 1  # below the longest row (7): that row still runs whole


def test_layout_hand_example():
    """The module docstring's example: what is scored and where it lands."""
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    batch = FlatBatch.build(ids, mask, logits_to_keep=2)
    assert batch.tree.tokens.tolist() == [5, 6, 7, 8, 9]
    assert batch.shape == (2, 2)
    assert batch.out_pos.tolist() == [0, 2, 3]  # (0, 0) -> 7, (1, 0) -> 8, (1, 1) -> 9; (0, 1) is pad
    (part,) = batch.parts()
    assert part.needed.tolist() == [False, False, True, True, True]
    assert part.dfs.tolist() == [2, 3, 4]
    vals = torch.arange(5, dtype=torch.float64)
    assert batch.scatter([part], [vals]).tolist() == [[2.0, 0.0], [3.0, 4.0]]


def test_nothing_scored_is_a_differentiable_zero():
    """All completions masked (e.g. TRL's mask_truncated_completions): zeros, backward still runs."""
    model = tiny_model("qwen3")
    ids, mask = padded([[3, 4, 5, 6], [3, 4, 7, 8]], "left")
    mask[:, 2:] = 0  # only the 2-token "prompts" are real; the last 2 columns are scored
    lp, ent = flat_logprobs(model, ids, mask, logits_to_keep=2, return_entropy=True, backend="dense")
    assert lp.shape == (2, 2) and not lp.any() and not ent.any()
    (lp.sum() + ent.sum()).backward()
    empty = flat_logprobs(model, ids, torch.zeros_like(mask), logits_to_keep=2)
    assert empty.shape == (2, 2) and not empty.any()


def test_errors_name_the_row_and_the_fix():
    model = tiny_model("qwen3")
    ids = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6]])
    with pytest.raises(ValueError, match=r"attention_mask row 1: .*contiguous.*\[1, 0, 1, 1\]"):
        flat_logprobs(model, ids, torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]]))
    with pytest.raises(ValueError, match="logits_to_keep"):
        flat_logprobs(model, ids, logits_to_keep=5)
    with pytest.raises(ValueError, match="not both"):
        flat_logprobs(model, ids, logits_to_keep=1, score_mask=torch.ones_like(ids))
    with pytest.raises(ValueError, match="temperature"):
        flat_logprobs(model, ids, temperature=0.0)
    with pytest.raises(ValueError, match=r"attention_mask: expected shape"):
        flat_logprobs(model, ids, torch.ones(2, 3))


def test_score_mask_layout():
    """A ``[B, L]`` score mask returns ``[B, L]`` with only the requested columns set."""
    ids, mask = padded(ROWS, "right")
    sm = torch.zeros_like(ids, dtype=torch.bool)
    sm[0, 3] = sm[4, 1:4] = True
    with float64_casts():
        model = tiny_model("qwen3")
        lp = flat_logprobs(model, ids, mask, score_mask=sm, backend="dense")
        ref, _ = reference(reference_copy(model), ids, mask, sm)
    assert lp.shape == ids.shape and ((lp != 0) == sm).all()
    assert rel_err(lp, ref) < TOL


@st.composite
def padded_batches(draw):
    """Groups of rows sharing random prefixes, as trainers produce them."""
    prefix = draw(st.lists(st.integers(1, 20), min_size=1, max_size=5))
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        cut = draw(st.integers(1, len(prefix)))
        rows.append(prefix[:cut] + draw(st.lists(st.integers(1, 20), min_size=0, max_size=4)))
    side = draw(st.sampled_from(["left", "right"]))
    keep = draw(st.one_of(st.none(), st.integers(0, max(map(len, rows)))))
    return rows, side, keep


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=padded_batches())
def test_float64_random_batches(case):
    rows, side, keep = case
    errs = compare(rows, side, keep=keep)
    assert max(errs) < TOL, (errs, rows, side, keep)


def test_left_padded_forward_agrees():
    """What TRL runs (one padded forward, positions counting the padding) agrees with the tree up to
    float64 rounding: RoPE sees only relative offsets."""
    ids, mask = padded(ROWS, "left")
    with float64_casts():
        model = tiny_model("qwen3")
        ref = reference_copy(model)
        lp = flat_logprobs(model, ids, mask, logits_to_keep=3, backend="dense")
        logits = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -4:-1]
        want = torch.log_softmax(logits, -1).gather(2, ids[:, -3:, None])[..., 0]
    assert rel_err(lp, want) < TOL
    assert np.isfinite(lp.detach().numpy()).all()
