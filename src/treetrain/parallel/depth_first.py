"""Bounded-memory depth-first execution of a tree on one device (AReaL-DTA's idea, exact gradients).

The tree is walked node by node in DFS order. Each node runs the unmodified decoder on its own
tokens; its attention (backend ``depth_first``) reads the keys/values of its root-to-node stack;
its own K/V are then detached into leaf tensors that its children read. The attention saves only
references to the stack's leaves and recomputes their concatenation in backward, so a node holds
its own activations, never a copy of its ancestors' K/V. When a node's subtree is done, the
gradients its children accumulated into those leaves are back-propagated through the node's
compute together with its own loss, which also accumulates into its ancestors' leaves. So:

- every distinct token is computed once (as in the packed run) and gets exactly the packed run's
  gradient (the same sums, in another order);
- only the graphs and K/V of the current root-to-node stack are alive: peak memory follows the
  deepest path, not the width of the tree.

Example, paths ``[A B C D]``, ``[A B E F]``, ``[A G H]`` (nodes ``AB``, ``CD``, ``EF``, ``GH``)::

    forward AB -> forward CD (past AB), backward CD -> forward EF (past AB), backward EF
               -> forward GH (past AB), backward GH -> backward AB (its loss + the K/V grads)

The loss must be a sum of per-token terms, ``token_loss(logp [n], targets [n]) -> scalar`` over
the targets each node predicts (a weighted SFT / policy-gradient loss). Attention-only models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from treetrain.attention.mask import TreeMask
from treetrain.trees.packing import PackedTree, pack
from treetrain.trees.tree import TrajectoryTree

__all__ = ["depth_first_backward", "node_children", "stack_attention", "weighted_token_loss"]

TokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def node_children(node_parent: torch.Tensor) -> list[list[int]]:
    """Children of every node, in DFS order; roots are the children of ``-1`` (last entry).

    >>> node_children(torch.tensor([-1, 0, 0, -1]))
    [[1, 2], [], [], [], [0, 3]]
    """
    kids: list[list[int]] = [[] for _ in range(node_parent.numel() + 1)]
    for n, p in enumerate(node_parent.tolist()):
        kids[p].append(n)  # p == -1 appends to the last list
    return kids


def weighted_token_loss(weights: torch.Tensor) -> TokenLoss:
    """``-sum(weights[t] * logp[t])`` over the targets ``t`` of a node: ``weights [T]`` per DFS token."""

    def loss(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return -(weights.to(logp.device, logp.dtype)[targets] * logp).sum()

    return loss


def _check(model: nn.Module) -> None:
    from treetrain.models.recurrent import route

    layer = next((type(m).__name__ for m in model.modules() if route(m) is not None), None)
    if layer is not None:
        raise ValueError(
            "depth-first execution supports attention-only models for now: this model has recurrent "
            f"layers ({layer}); train it packed or partitioned"
        )


@dataclass
class _Stack:
    """What the ``depth_first`` backend reads and writes during one node's forward.

    past: per ancestor (root first), per attention layer, its ``(k, v)`` leaves ``[Hkv, n_a, D]``.
    own: filled by the forward, per attention layer, this node's ``(k, v)`` (in the graph).
    """

    past: list[list[tuple[torch.Tensor, torch.Tensor]]]
    own: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _attend(q, k, v, past: tuple[torch.Tensor, ...], scale: float) -> torch.Tensor:
    """``q [Hq, n, D]`` against ``past`` keys (``past[:m]``), values (``past[m:]``) and its own causal
    ``k, v [Hkv, n, D]``."""
    m = len(past) // 2
    keys = torch.cat([*past[:m], k], dim=1)
    values = torch.cat([*past[m:], v], dim=1)
    n, P = q.shape[1], keys.shape[1] - k.shape[1]
    idx = torch.arange(n, device=q.device)
    allowed = torch.ones(n, P + n, dtype=torch.bool, device=q.device)
    allowed[:, P:] = idx[None, :] <= idx[:, None]
    rep = q.shape[0] // k.shape[0]
    if rep > 1:
        keys, values = keys.repeat_interleave(rep, dim=0), values.repeat_interleave(rep, dim=0)
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=allowed, scale=scale)
    return out[0]


class _StackAttention(torch.autograd.Function):
    """:func:`_attend` saving only its inputs (the stack's leaves are references, not copies) and
    recomputing the concatenation and attention in backward."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, *past):
        ctx.save_for_backward(q, k, v, *past)
        ctx.scale = scale
        return _attend(q, k, v, past, scale)

    @staticmethod
    def backward(ctx, g):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = _attend(inputs[0], inputs[1], inputs[2], tuple(inputs[3:]), ctx.scale)
            need = [t for t in inputs if t.requires_grad]
            got = iter(torch.autograd.grad(out, need, g))
        grads = [next(got) if t.requires_grad else None for t in inputs]
        return grads[0], grads[1], grads[2], None, *grads[3:]


def stack_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TreeMask, scale: float
) -> torch.Tensor:
    """The ``depth_first`` backend: one node's queries ``[Hq, n, D]`` against its stack's K/V and its
    own ``k, v [Hkv, n, D]`` (causal); records ``(k, v)`` for the node's children."""
    if "stack" not in mask.cache:
        raise ValueError("attention backend 'depth_first' runs inside parallel.depth_first only")
    stack: _Stack = mask.cache["stack"]
    layer = len(stack.own)
    stack.own.append((k, v))
    past = [a[layer][0] for a in stack.past] + [a[layer][1] for a in stack.past]
    return _StackAttention.apply(q, k, v, scale, *past)


def depth_first_backward(
    model: nn.Module,
    batch: PackedTree | TrajectoryTree,
    token_loss: TokenLoss,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate into ``.grad`` the gradient of ``sum(token_loss(...))`` over every node, depth-first.

    Returns ``(loss, logp)``: the total loss (0-d, detached) and every target's log-prob ``[T]`` in
    DFS order (0 for a root's first token), equal to ``tree_logprobs`` of the packed run.
    """
    from treetrain.logprobs import target_logprobs
    from treetrain.models.head import lm_head
    from treetrain.models.hf import prepare_model

    prepare_model(model)
    _check(model)
    packed = batch if isinstance(batch, PackedTree) else pack(batch)
    device = model.get_input_embeddings().weight.device
    packed = packed.to(device)
    head = lm_head(model)
    decoder = getattr(model, "treetrain_decoder", None) or model.base_model
    kids = node_children(packed.node_parent.cpu())
    starts, ends = packed.node_start.tolist(), packed.node_end.tolist()
    dtype = head.weight.dtype
    all_logp = torch.zeros(packed.num_tokens, dtype=torch.float32 if dtype != torch.float64 else dtype)
    total = torch.zeros((), dtype=torch.float64)

    def run(node: int, stack: list) -> None:
        nonlocal total
        s, e = starts[node], ends[node]
        ctx = _Stack(past=stack)
        out = decoder(
            input_ids=packed.input_ids[None, s:e],
            position_ids=packed.position_ids[None, s:e],
            attention_mask=packed.subtree_end[s:e].view(1, 1, 1, e - s),  # unused: passed through
            tree_mask=TreeMask(packed.subtree_end[s:e], backend="depth_first", cache={"stack": ctx}),
            use_cache=False,
        )
        hidden = out.last_hidden_state[0]  # [n, H]
        own = ctx.own
        # rows of this node predict its next tokens and its children's first tokens
        targets = [*range(s + 1, e), *(starts[c] for c in kids[node])]
        targets = torch.tensor(targets, dtype=torch.long, device=device)
        rows = packed.prev[targets] - s
        loss = packed.input_ids.new_zeros((), dtype=hidden.dtype)
        if targets.numel():
            # every node on the stack holds its graph: keep at most one chunk's logits (~64 MiB) each
            logp, _ = target_logprobs(
                hidden[rows], head, packed.input_ids[targets], chunk, entropy=False, keep_bytes=64 * 2**20
            )
            all_logp[targets.cpu()] = logp.detach().to(all_logp.dtype).cpu()
            loss = token_loss(logp, targets)
        leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in own]
        del out, ctx
        for child in kids[node]:
            run(child, [*stack, leaves])
        outputs, grads = [loss], [torch.ones_like(loss)]
        for (k, v), (lk, lv) in zip(own, leaves):
            for t, leaf in ((k, lk), (v, lv)):
                if leaf.grad is not None:
                    outputs.append(t)
                    grads.append(leaf.grad)
        if outputs[0].requires_grad or len(outputs) > 1:
            torch.autograd.backward(outputs, grads)
        total += float(loss.detach())

    for root in kids[-1]:
        run(root, [])
    return total, all_logp
