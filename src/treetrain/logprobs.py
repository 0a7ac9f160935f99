"""Exact per-path log-probs from one tree forward.

Every distinct (context, target) pair of the tree is scored once: the token at DFS index ``t`` is
predicted from the hidden state at ``prev[t]``. The scores are then *expanded* to the per-path
layout with an index gather, so any per-path loss runs unchanged and autograd sums each shared
token's gradient over the paths through it.

The LM head never materializes ``[T, vocab]`` in one piece: rows go through it in chunks inside one
autograd function. Backward needs each chunk's logits again: they are kept from forward while all of
them fit :data:`LOGITS_KEEP_BYTES` (what an unchunked head holds, without its full-size temporaries),
and recomputed beyond it, one extra head matmul for bounded memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from treetrain.models.head import LMHead, lm_head
from treetrain.models.hf import tree_forward
from treetrain.models.rope import split_regimes
from treetrain.trees.packing import PackedTree, pack
from treetrain.trees.tree import TrajectoryTree

__all__ = ["expand_to_paths", "head_logprobs", "path_logprobs", "target_logprobs", "tree_logprobs"]

DEFAULT_CHUNK: int | None = None  # None: rows for about 64 MiB of logits (auto_chunk)
# Logits kept from forward for backward (all chunks or none): 1 GiB is 4,096 rows at vocab 65k in
# float32. A plain HF step holds [rows, vocab] logits plus their log-softmax at any size.
LOGITS_KEEP_BYTES = 2**30


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Log-softmax precision: float32 for half types (as HF losses upcast logits), else the dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _TargetLogprobs(torch.autograd.Function):
    """``logp[n] = log_softmax(h[n] @ W.T + b)[target[n]]`` (and the entropy), chunked over rows.

    hidden ``[N, H]``, weight ``[V, H]``, bias ``[V]`` or None, targets ``[N]`` -> ``[N]``, ``[N]``
    (the entropy is empty unless ``entropy`` is set). Forward runs ``[chunk, V]`` logits at a
    time. If all ``N x V`` logits fit ``keep_bytes`` they are kept for backward (no recomputed head
    matmul: an unchunked head's cost, and the logits an unchunked head holds); otherwise only the
    inputs are saved and backward recomputes each chunk's logits (one more head matmul, at most
    ``[chunk, V]`` logits at a time). ``softcap`` (Gemma 2's ``final_logit_softcapping``): the logits
    are ``post * softcap * tanh(z / softcap)`` (always recomputed: backward needs the tanh); without a
    cap callers fold any scale into ``hidden`` and ``bias`` instead (``post`` must then be 1).

    Example: N = 4,096 targets, V = 32,000, float32, chunk 524: 8 chunks, 524 MB of logits, kept
    under the default 1 GiB; at N = 16,384 (2.1 GB) backward recomputes them chunk by chunk.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        targets,
        chunk: int,
        entropy: bool,
        softcap: float | None = None,
        keep_bytes: int | None = None,
        post: float = 1.0,
    ):
        assert softcap is not None or post == 1.0, "without a cap, fold the scale into hidden and bias"
        acc = _acc_dtype(hidden.dtype)
        N = hidden.shape[0]
        budget = LOGITS_KEEP_BYTES if keep_bytes is None else keep_bytes
        keep = softcap is None and N * weight.shape[0] * torch.finfo(acc).bits // 8 <= budget
        logp = hidden.new_empty(N, dtype=acc)
        ent = hidden.new_empty(N if entropy else 0, dtype=acc)
        kept = []
        for s in range(0, N, chunk):
            z = nn.functional.linear(hidden[s : s + chunk], weight, bias).to(acc)
            if softcap is not None:
                z = torch.tanh(z / softcap).mul_(softcap * post)
            lse = torch.logsumexp(z, dim=-1)
            logp[s : s + chunk] = z.gather(1, targets[s : s + chunk, None])[:, 0] - lse
            if entropy:  # H = lse' + sum_v p_v (m - z_v) from logits shifted by their max m: two sums
                # of non-negative terms (lse' = lse - m in [0, log V]), so nothing cancels; in float32
                # lse - E_p[z] cancels when the logits are large (SmolLM2-135M: lse ~34, H ~0.3: 3e-3
                # off per token), and -sum p log p sums terms of both signs' rounding (4 ulp on tiny
                # models). Summed by .sum (pairwise), not einsum's dot product (3e-4 off there).
                m = z.amax(-1, keepdim=True)
                zs = z - m  # <= 0
                lse_s = torch.logsumexp(zs, dim=-1, keepdim=True)  # not lse - m: lse's own rounding
                p = (zs - lse_s).exp_()
                ent[s : s + chunk] = lse_s[:, 0] - p.mul_(zs).sum(-1)
                del zs, p
            if keep:
                kept.append(z)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk, ctx.entropy, ctx.softcap, ctx.post = chunk, entropy, softcap, post
        ctx.logits = kept or None  # released chunk by chunk in the first backward
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets = ctx.saved_tensors
        acc = _acc_dtype(hidden.dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with_ent = ctx.entropy and g_ent is not None and bool(g_ent.any())
        g_h = torch.empty_like(hidden) if need_h else None
        g_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        g_b = torch.zeros_like(bias, dtype=acc) if (need_b and bias is not None) else None
        if g_logp is None:
            g_logp = hidden.new_zeros(hidden.shape[0], dtype=acc)
        kept, ctx.logits = ctx.logits, None  # a second backward (retain_graph) recomputes
        for i, s in enumerate(range(0, hidden.shape[0], ctx.chunk)):
            rows = slice(s, s + ctx.chunk)
            h, gl = hidden[rows], g_logp[rows, None]
            if kept is not None:  # this chunk's logits from forward, freed once used
                z, kept[i] = kept[i], None
            else:
                z = nn.functional.linear(h, weight, bias).to(acc)
            if ctx.softcap is not None:  # d capped / dz = 1 - tanh^2, applied to g_z below
                tanh = torch.tanh(z / ctx.softcap)
                z = tanh * (ctx.softcap * ctx.post)
            p = torch.softmax(z, dim=-1)
            if with_ent:  # d entropy / dz = -p * (z - E_p[z]) = -p * (log p + H), formed in z's buffer
                # (the second form: no cancellation between large logits and their mean, as in forward)
                logq = z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))
                ent = -(p * logq).sum(-1, keepdim=True)
                g_z = logq.add_(ent).mul_(p).mul_(-g_ent[rows, None]).sub_(p.mul_(gl))
            else:  # d logp / dz = onehot - p, formed in p's buffer
                del z
                g_z = p.mul_(-gl)
            g_z.scatter_add_(1, targets[rows, None], gl)
            if ctx.softcap is not None:
                g_z.mul_((1 - tanh * tanh).mul_(ctx.post))
            g_z = g_z.to(hidden.dtype)
            if need_h:
                g_h[rows] = g_z @ weight
            if need_w and acc == hidden.dtype:
                g_w.addmm_(g_z.T, h)
            elif need_w:
                g_w += (g_z.T @ h).to(acc)
            if g_b is not None:
                g_b += g_z.sum(0).to(acc)
        g_w = g_w.to(weight.dtype) if g_w is not None else None
        g_b = g_b.to(bias.dtype) if g_b is not None else None
        return g_h, g_w, g_b, None, None, None, None, None, None


def auto_chunk(vocab: int, budget_bytes: int = 64 * 2**20) -> int:
    """Rows per head chunk so one ``[chunk, vocab]`` float32 block is about ``budget_bytes``."""
    return int(min(4096, max(128, budget_bytes // (4 * vocab))))


def target_logprobs(
    hidden: torch.Tensor,
    head: LMHead | nn.Linear,
    targets: torch.Tensor,
    chunk: int | None = DEFAULT_CHUNK,
    entropy: bool = True,
    keep_bytes: int | None = None,
    post: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets [N]`` under ``head`` at ``hidden [N, H]`` and the entropy, each ``[N]``.

    ``head``: the model's exact head (:func:`treetrain.models.head.lm_head`: projection, scales,
    cap), or a bare ``nn.Linear``. ``post`` multiplies the final logits (TRL's ``1 / temperature``).
    The ``N x vocab`` logits are kept for backward when they fit ``keep_bytes`` (default
    :data:`LOGITS_KEEP_BYTES`, 1 GiB); beyond that, peak extra memory is a few ``chunk x vocab``
    blocks (default chunk: about 64 MiB of float32 logits) and backward recomputes them. With
    ``entropy=False`` the entropy is an empty tensor and costs nothing.
    """
    if isinstance(head, nn.Linear):
        head = LMHead(head.weight, head.bias)
    if not isinstance(head, LMHead):
        raise ValueError(f"output head must be an nn.Linear, got {type(head).__name__}")
    chunk = chunk or auto_chunk(head.vocab)
    # scales before the cap fold into the rows and the bias (linear): h W^T s + b s = (s h) W^T + s b
    pre = head.logit_scale * (post if head.softcap is None else 1.0)
    rows = hidden * (head.hidden_scale * pre) if head.hidden_scale * pre != 1.0 else hidden
    bias = head.bias * pre if head.bias is not None and pre != 1.0 else head.bias
    post = 1.0 if head.softcap is None else post
    w = head.weight
    return _TargetLogprobs.apply(rows, w, bias, targets, chunk, entropy, head.softcap, keep_bytes, post)


def head_logprobs(
    model: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk: int | None = DEFAULT_CHUNK,
    entropy: bool = True,
    keep_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`target_logprobs` under ``model``'s exact head (:func:`treetrain.models.head.lm_head`)."""
    return target_logprobs(hidden, lm_head(model), targets, chunk, entropy, keep_bytes)


# Scorers that replace the single-device tree forward while a scope is open, innermost last:
# ``fn(model, packed, chunk, entropy, needed) -> (logp [T], entropy [T])``. Pushed by
# ``treetrain.parallel.cp.context_parallel`` (lower layers never import the parallel package).
_SCORERS: list = []


@contextlib.contextmanager
def scoring_override(fn) -> Iterator[None]:
    """Inside, :func:`tree_logprobs` (and everything built on it) scores with ``fn`` instead."""
    _SCORERS.append(fn)
    try:
        yield
    finally:
        _SCORERS.pop()


def tree_logprobs(
    model: nn.Module,
    packed: PackedTree,
    backend: str | None = None,
    chunk: int | None = DEFAULT_CHUNK,
    entropy: bool = True,
    needed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One log-prob (and entropy) per distinct tree token: ``[T]`` each, in DFS order.

    Entries with no context (a root's first token) are 0. With ``entropy=False`` the entropies
    are not computed (zeros are returned). ``needed [T]`` (bool) limits the LM head to those
    targets (e.g. tokens some path trains on); the others are 0 and carry no gradient.
    """
    if _SCORERS:  # e.g. inside parallel.cp.context_parallel: this rank's chunk only
        return _SCORERS[-1](model, packed, chunk, entropy, needed)
    hidden = tree_forward(model, packed, backend)
    packed = packed.to(hidden.device)
    has_prev = packed.prev >= 0
    if needed is not None:
        has_prev &= needed.to(has_prev.device)
    targets = torch.nonzero(has_prev)[:, 0]
    rows = hidden.index_select(0, packed.prev[targets])
    logp, ent = head_logprobs(model, rows, packed.input_ids[targets], chunk, entropy)
    T = packed.num_tokens
    full_logp = logp.new_zeros(T).index_copy(0, targets, logp)
    full_ent = logp.new_zeros(T)
    return full_logp, (full_ent.index_copy(0, targets, ent) if entropy else full_ent)


def expand_to_paths(per_token: torch.Tensor, packed: PackedTree) -> list[torch.Tensor]:
    """Per-DFS-token values ``[T]`` -> one ``[len(p) - 1]`` tensor per path (the gather)."""
    flat = per_token.index_select(0, packed.target_index().to(per_token.device))
    return list(flat.split((packed.path_lengths - 1).tolist()))


def _as_packed(batch, config=None, images=None) -> PackedTree:
    """``batch`` packed, its trees split by the rope regimes of ``config`` (a model's config;
    :func:`treetrain.models.rope.split_regimes`; None: not split). ``images``: per path, its images
    (token paths only: trees carry their own)."""
    trees_given = isinstance(batch, (PackedTree, TrajectoryTree)) or (
        isinstance(batch, Sequence) and any(isinstance(t, TrajectoryTree) for t in batch)
    )
    if images is not None and trees_given:
        raise ValueError(
            "images=: pass them with token paths; a TrajectoryTree carries its own "
            "(TrajectoryTree.from_paths(paths, images=...))"
        )
    if isinstance(batch, PackedTree):
        trees = list(batch.trees)
    elif isinstance(batch, TrajectoryTree):
        trees = [batch]
    elif isinstance(batch, Sequence) and batch and all(isinstance(t, TrajectoryTree) for t in batch):
        trees = list(batch)
    elif isinstance(batch, Sequence):
        trees = [TrajectoryTree.from_paths(batch, images=images)]
    else:
        raise ValueError(
            "batch: expected a PackedTree, a TrajectoryTree, a list of them, or token paths; "
            f"got {type(batch)}"
        )
    split = trees if config is None else [split_regimes(config, t) for t in trees]
    same = all(a.num_tokens == b.num_tokens for a, b in zip(split, trees))
    return batch if isinstance(batch, PackedTree) and same else pack(split)


def _check_vocab(model: nn.Module, ids: torch.Tensor) -> None:
    """Token ids must index the model's embedding: a clear ValueError, not an IndexError inside it."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is None or ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"token id {bad} is outside the model's vocabulary (vocab_size={vocab}); "
            "tokenize with the model's own tokenizer"
        )


def path_logprobs(
    model: nn.Module,
    batch,
    *,
    backend: str | None = None,
    chunk: int | None = DEFAULT_CHUNK,
    return_entropy: bool = False,
    images=None,
):
    """Per-path log-probs from ONE forward over the packed tree, in input path order.

    ``batch``: token paths (``list[list[int]]``), a ``TrajectoryTree``, a list of trees, or a
    ``PackedTree``. Returns ``list[Tensor [len(p) - 1]]``: entry ``j`` of path ``p`` is
    ``log P(p[j+1] | p[:j+1])``; with ``return_entropy``, also the entropies in the same layout.
    ``images`` (vision-language models, with token paths): per path, its images
    (:class:`~treetrain.ImageInput`, :func:`~treetrain.row_images`) in the order of their
    placeholder tokens; each distinct image is encoded once.

    >>> lps = path_logprobs(model, [[1, 2, 3], [1, 2, 4]])  # the shared [1, 2] runs once
    >>> [lp.shape for lp in lps]
    [torch.Size([2]), torch.Size([2])]
    """
    packed = _as_packed(batch, model.config, images)  # paths of two rope regimes share no token
    _check_vocab(model, packed.input_ids)
    logp, ent = tree_logprobs(model, packed, backend, chunk, entropy=return_entropy)
    out = expand_to_paths(logp, packed)
    return (out, expand_to_paths(ent, packed)) if return_entropy else out
