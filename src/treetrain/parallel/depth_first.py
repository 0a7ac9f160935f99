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

Recurrent layers the same way: a node is a segment of the tree (:mod:`treetrain.models.segment`)
that starts from its parent's final state per recurrent layer and reads its conv windows' first
inputs from its ancestors' last ones; it leaves its own (as leaves, beside its K/V) to its
children, and the gradients they accumulate there flow back through its compute with the K/V's.
In the example, ``CD``, ``EF`` and ``GH`` start from the states ``AB`` left on the stack.

The loss must be a sum of per-token terms, ``token_loss(logp [n], targets [n]) -> scalar`` over
the targets each node predicts (a weighted SFT / policy-gradient loss).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from treetrain.attention.mask import TreeMask
from treetrain.models.pathconv import conv_window_index
from treetrain.models.segment import HaloWindow, build_segment_levels, segment_view
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
    on = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x renamed it
    if on if on is not None else getattr(model, "is_gradient_checkpointing", False):
        raise ValueError(
            "depth-first execution does not take activation checkpointing: a node's layers record what "
            "its children read in call order, and a replay would record it twice; turn checkpointing "
            "off (depth-first already keeps only the root-to-node stack)"
        )


@dataclass
class _Carry:
    """What a node leaves its descendants (as leaves, detached from its graph) or holds for them (in
    its graph): per attention layer its ``(k, v)`` ``[Hkv, n, D]``; per recurrent scan (numbered in
    call order) its final state; per conv its last ``width - 1`` inputs; its length."""

    tokens: int
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    states: dict[int, torch.Tensor | tuple[torch.Tensor, ...]] = field(default_factory=dict)
    convs: dict[int, torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        flat = [t for pair in self.kv for t in pair]
        for st in self.states.values():
            flat += list(st) if isinstance(st, tuple) else [st]
        return flat + list(self.convs.values())

    def leaves(self) -> _Carry:
        def leaf(t):
            return t.detach().requires_grad_()

        def state(s):
            return tuple(map(leaf, s)) if isinstance(s, tuple) else leaf(s)

        states = {op: state(s) for op, s in self.states.items()}
        convs = {op: leaf(x) for op, x in self.convs.items()}
        return _Carry(self.tokens, [(leaf(k), leaf(v)) for k, v in self.kv], states, convs)


class _Stack:
    """What one node's forward reads from its root-to-node stack and records for its children.

    past: the ancestors' carries (root first, leaves); own: this node's (in its graph). For the
    ``depth_first`` attention backend (``mask.cache["stack"]``) and, as the segment of
    :mod:`treetrain.models.segment` (``mask.cache["segment"]``), for recurrent layers: the node
    starts from its parent's final states and reads its conv halo from its ancestors' last inputs.
    """

    def __init__(self, past: list[_Carry], packed: PackedTree, start: int, end: int, has_children: bool):
        self.past, self.own, self.has_children = past, _Carry(end - start), has_children
        self.view = segment_view(packed.input_ids[start:end], packed.position_ids[start:end])
        self._scans, self._convs = itertools.count(), itertools.count()

    def levels(self, device):
        one = lambda v: np.array([v], dtype=np.int64)  # noqa: E731
        send = one(0) if self.has_children else np.zeros(0, dtype=np.int64)
        parent = bool(self.past)
        return build_segment_levels(
            one(0), one(self.own.tokens), one(-1), one(0 if parent else -1), send, int(parent), self, device
        )

    def window(self, width: int, device):
        h = min(width - 1, sum(c.tokens for c in self.past))  # the path's tokens before the node
        index = conv_window_index(torch.arange(-1, h + self.own.tokens - 1, device=device), width)[h:]

        def exchange(x: torch.Tensor) -> torch.Tensor:
            op = next(self._convs)
            if self.has_children:
                self.own.convs[op] = x[max(x.shape[0] - (width - 1), 0) :].clone()
            return torch.cat([c.convs[op] for c in self.past])[-h:] if h else x[:0]

        return HaloWindow(index=index, num_halo=h, exchange=exchange)

    def begin(self) -> int:
        return next(self._scans)

    def receive(self, op: int, anchor: torch.Tensor):
        return self.past[-1].states[op]

    def send(self, op: int, out: torch.Tensor, states) -> torch.Tensor:
        self.own.states[op] = states
        return out


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
    layer = len(stack.own.kv)
    stack.own.kv.append((k, v))
    past = [a.kv[layer][0] for a in stack.past] + [a.kv[layer][1] for a in stack.past]
    return _StackAttention.apply(q, k, v, scale, *past)


def depth_first_backward(
    model: nn.Module,
    batch: PackedTree | TrajectoryTree,
    token_loss: TokenLoss,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accumulate into ``.grad`` the gradient of ``sum(token_loss(...))`` over every node, depth-first.

    Returns ``(loss, logp)``: the total loss (0-d, detached) and every target's log-prob ``[T]`` in
    DFS order (0 for a root's first token), equal to ``tree_logprobs`` of the packed run. A model
    whose rope depends on the forward's length needs a tree split by regime
    (``treetrain.models.rope.split_regimes``; the DFS order is then the split tree's): each node's
    tokens keep their paths' rotary tables. An unsplit tree with paths of several regimes raises.
    """
    from treetrain.logprobs import target_logprobs
    from treetrain.models.head import lm_head
    from treetrain.models.hf import prepare_model, rope_lengths, run_decoder

    prepare_model(model)
    _check(model)
    packed = batch if isinstance(batch, PackedTree) else pack(batch)
    if packed.image_index is not None:
        raise ValueError(
            "depth-first training with images in the trees is not built (a node's image features would be "
            "encoded per node visit); train vision-language trees with the packed tree forward"
        )
    device = model.get_input_embeddings().weight.device
    packed = packed.to(device)
    rope = rope_lengths(model, packed)  # a node's tokens keep their paths' rotary tables (models.rope)
    head = lm_head(model)
    kids = node_children(packed.node_parent.cpu())
    starts, ends = packed.node_start.tolist(), packed.node_end.tolist()
    dtype = head.weight.dtype
    all_logp = torch.zeros(packed.num_tokens, dtype=torch.float32 if dtype != torch.float64 else dtype)
    total = torch.zeros((), dtype=torch.float64)

    def run(node: int, stack: list) -> None:
        nonlocal total
        s, e = starts[node], ends[node]
        ctx = _Stack(stack, packed, s, e, has_children=bool(kids[node]))
        mask = TreeMask(
            packed.subtree_end[s:e],
            backend="depth_first",
            cache={"stack": ctx, "segment": ctx},
            position_ids=packed.position_ids[s:e],  # a sliding window is refused by name if it binds
        )
        # packed_tree: recurrent layers run on the node (models.segment)
        hidden = run_decoder(model, packed, mask, s, e, rope, packed_tree=ctx.view)  # [n, H]
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
        leaves = own.leaves()
        del ctx
        for child in kids[node]:
            run(child, [*stack, leaves])
        outputs, grads = [loss], [torch.ones_like(loss)]
        for t, leaf in zip(own.tensors(), leaves.tensors()):
            if leaf.grad is not None and t.requires_grad:
                outputs.append(t)
                grads.append(leaf.grad)
        if outputs[0].requires_grad or len(outputs) > 1:
            torch.autograd.backward(outputs, grads)
        total += float(loss.detach())

    for root in kids[-1]:
        run(root, [])
    return total, all_logp
