"""Each layer's attention mask as the Hugging Face model decides it, read through its mask interface.

A model decides per layer whether its attention is full or a sliding window, and how wide, from its
config (``sliding_window``, ``use_sliding_window``, ``max_window_layers``, ``layer_types``) and its
own code. The keyword ``sliding_window=`` of the attention call is not that decision: Qwen2-MoE and
PhiMoE apply their window only in the mask and never pass it; OLMoE passes a ``sliding_window`` that
its mask ignores (HF's eager and SDPA attention read the mask only; flash-attention alone reads the
keyword). What HF's eager and SDPA attention compute is fixed by the mask the model builds through
``transformers.masking_utils`` (``create_causal_mask``, ``create_sliding_window_causal_mask``, ...),
which calls the mask function registered for the attention implementation.

So a tree forward passes, as ``attention_mask``, an all-ones ``[1, n]`` padding mask, and while it
runs (:func:`padding_mask`) every mask the model asks for is the tree's: the model builds each
through :func:`mask_interface` (registered as the ``treetrain`` mask function), which checks the
mask function HF composed against what the tree can compute (causal, or causal with the window
``local_size``) on a few probe rows, and returns a marked 4D tensor carrying the window. That
tensor reaches each layer's attention call, which reads the window with :func:`layer_window`.

Example: Qwen2-MoE with ``use_sliding_window=True, sliding_window=3`` and layer types
``[sliding_attention, full_attention]``: the model calls ``create_sliding_window_causal_mask`` (window
3) and ``create_causal_mask``; layer 0 gets the mask with window 3, layer 1 the full causal one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from treetrain.attention.mask import TreeMask

__all__ = ["layer_bidirectional", "layer_window", "mask_interface", "padding_mask"]

_TREE = "_treetrain_tree"  # on a layer mask: the forward's TreeMask
_WINDOW = "_treetrain_window"  # on a layer mask: its sliding window (None: full causal)
_BIDIR = "_treetrain_bidirectional"  # on a layer mask: image blocks see themselves both ways


# the TreeMask of each tree forward in progress, innermost last: every mask the model builds while
# one is open belongs to it
_OPEN: list[TreeMask] = []


@contextlib.contextmanager
def padding_mask(mask: TreeMask, n: int, device) -> Iterator[torch.Tensor]:
    """The ``[1, n]`` all-ones ``attention_mask`` of a tree forward over ``n`` tokens (no padding).

    While the context is open, :func:`mask_interface` builds every mask for ``mask``'s forward.
    """
    _OPEN.append(mask)
    try:
        yield torch.ones(1, n, dtype=torch.bool, device=device)
    finally:
        _OPEN.pop()


def layer_window(attention_mask, mask: TreeMask, where: str = "") -> int | None:
    """The window of the mask HF gave a layer (None: full causal attention).

    Raises ``ValueError`` when the layer got any other mask than one :func:`mask_interface` built for
    this forward: the model made its own mask, which the tree mask cannot reproduce.
    """
    attention_mask = _marked(attention_mask)
    if not _same_tree(getattr(attention_mask, _TREE, None), mask):
        got = "no mask" if attention_mask is None else f"a {type(attention_mask).__name__}"
        raise ValueError(
            f"{where or 'an attention layer'} received {got} that transformers' mask functions did not "
            "build for the tree forward: the model builds its own attention mask, which tree attention "
            "cannot reproduce; this model is not supported (docs/architectures.md)"
        )
    return getattr(attention_mask, _WINDOW)


def layer_bidirectional(attention_mask) -> bool:
    """Whether the layer's mask (one :func:`mask_interface` built) lets each image block attend to
    itself bidirectionally (Gemma 3/4's ``block_sequence_ids``)."""
    return bool(getattr(_marked(attention_mask), _BIDIR, False))


def _marked(attention_mask):
    """What carries the marks of ``attention_mask``: itself, or for a whole view of a layer mask, the
    layer mask's storage. Gemma 4 slices its masks to the queries it keeps before its KV-shared layers
    (all of them, in a tree forward): a new tensor object, the same ``[1, 1, 1, T]`` view."""
    base = getattr(attention_mask, "_base", None)
    if getattr(attention_mask, _TREE, None) is not None or getattr(base, _TREE, None) is None:
        return attention_mask
    return base if attention_mask.shape == (1, 1, 1, base.numel()) else attention_mask


def _same_tree(a: TreeMask | None, b: TreeMask) -> bool:
    """Whether ``a`` is the forward's tree ``b``, or a copy of it: FSDP rebuilds the dataclasses among a
    module's inputs on their way in (``_recursive_to``), so the attention call may hold a copy."""
    if a is None or a is b:
        return a is b
    return a.subtree_end.data_ptr() == b.subtree_end.data_ptr() and a.subtree_end.shape == b.subtree_end.shape


def _layer_mask(tree: TreeMask, window: int | None, bidir: bool = False) -> torch.Tensor:
    """``[1, 1, 1, T]``, contents unused: the marks are what counts, on the mask and on its own storage
    (a view the model takes of the whole mask keeps them: :func:`_marked`)."""
    base = tree.subtree_end.clone()
    m = base.view(1, 1, 1, -1)
    for t in (base, m):
        setattr(t, _TREE, tree)
        setattr(t, _WINDOW, window)
        setattr(t, _BIDIR, bidir)
    return m


def _probe(
    mask_function,
    window: int | None,
    runs: torch.Tensor | None = None,
    T: int = 0,
    bidir: bool = False,
    near: int | None = None,
) -> bool:
    """Whether ``mask_function(b, h, q, kv)`` is causal (with ``q - kv < window`` when set) on probe
    rows on both sides of the window, evaluated as HF's SDPA mask does (broadcast index tensors).

    With ``runs [B, 2]`` (the DFS runs of image tokens of a forward over ``T`` tokens) the probe rows
    include the runs' ends; with ``T`` the rows stay below it (the function may read per-token data,
    text-only forwards included); ``bidir``:
    whether it is that OR "both in one run" (HF's ``blockwise_overlay`` over the forward's tokens);
    ``near``: a window whose edges are probed too (HF's ``local_size`` when probing for no window)."""
    rows = {0, 1, 2, 5, 17}
    for w in {window, near} - {None}:
        rows |= {w - 1, w, w + 1, 2 * w + 1}
    run_id = None
    if runs is not None:
        for s, e in runs[:4].tolist():
            rows |= {s - 1, s, s + 1, e - 2, e - 1, e}
        run_id = torch.full((T,), -1, dtype=torch.long)
        for i, (s, e) in enumerate(runs.tolist()):
            run_id[s:e] = i
    if T:  # the function may read per-token data (block ids of the forward's tokens): rows below T
        rows = {r for r in rows if r < T}
    q = torch.tensor(sorted(r for r in rows if r >= 0))
    kv = torch.arange(int(q.max()) + 1)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    got = mask_function(zero, zero, q[None, None, :, None], kv[None, None, None, :])
    want = kv[None, :] <= q[:, None]
    if bidir:
        want |= (run_id[q][:, None] == run_id[kv][None, :]) & (run_id[q][:, None] >= 0)
    if window is not None:
        want &= q[:, None] - kv[None, :] < window
    got = torch.as_tensor(got).cpu()
    return got.dim() <= 4 and bool((got.expand(1, 1, *want.shape)[0, 0] == want).all())


def mask_interface(*args, **kwargs):
    """The ``treetrain`` mask function: for a tree forward, the marked layer mask (its window is
    HF's ``local_size``, checked against the mask function HF composed); otherwise transformers'
    SDPA mask (an ordinary call of a prepared model)."""
    tree = _OPEN[-1] if _OPEN else None
    if tree is None:
        from transformers.masking_utils import sdpa_mask

        return sdpa_mask(*args, **kwargs)
    window = kwargs.get("local_size")
    config = kwargs.get("config")
    what = getattr(config, "model_type", None) or "this model"
    if kwargs.get("q_offset") or kwargs.get("kv_offset"):
        raise ValueError(f"{what}: a tree forward takes no cache (mask offsets must be 0)")
    runs = tree.vision_runs if tree.vision_runs is not None and tree.vision_runs.numel() else None
    # a window HF applies as an and-mask (Gemma 3's sliding layers with image blocks) comes without
    # local_size: the config's sliding_window is then the one to check
    # local_size: a window HF composed, unless an or-mask over it restores plain causal (Unlimited OCR's
    # reference sliding layers see every "prefill" key: all of them without a cache)
    windows = [window, None] if window is not None else [None, getattr(config, "sliding_window", None)]
    shapes = [
        (w, b) for w in dict.fromkeys(windows) for b in ((False, True) if runs is not None else (False,))
    ]
    try:
        found = next(
            (s for s in shapes if _probe(kwargs["mask_function"], s[0], runs, tree.num_tokens, s[1], window)),
            None,
        )
    except Exception as e:  # a mask function that is not index-based: not one the tree can read
        raise ValueError(f"{what}: its attention mask function cannot be read by tree attention ({e})") from e
    exact = found is not None
    window, bidir = found or (window, False)
    if not exact:
        shape = "causal" if window is None else f"causal with a sliding window of {window}"
        raise ValueError(
            f"{what}: its attention mask is not {shape} (chunked, bidirectional or overlaid masks); "
            "tree attention cannot reproduce it, so the model is not supported (docs/architectures.md)"
        )
    return tree.cached(("hf_layer_mask", window, bidir), lambda: _layer_mask(tree, window, bidir))
