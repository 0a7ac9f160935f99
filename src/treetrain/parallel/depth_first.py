"""Bounded-memory depth-first execution of a tree on one device (AReaL-DTA's idea, exact gradients).

The tree is walked node by node in DFS order. Each node runs the unmodified decoder on its own
tokens with the keys/values of its root-to-node stack as ``past_key_values``; its own K/V are
then detached into leaf tensors that its children read. When a node's subtree is done, the
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

import torch
from torch import nn

from ..packing import PackedTree, pack
from ..tree import TrajectoryTree

__all__ = ["depth_first_backward", "node_children", "weighted_token_loss"]

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
    from ..models.recurrent import _layout

    if any(_layout(m) is not None for m in model.modules()):
        raise ValueError(
            "depth-first execution supports attention-only models for now: this model has recurrent "
            "(Gated DeltaNet) layers; train it packed or partitioned"
        )


def _cache(model: nn.Module, stack: list[list[tuple[torch.Tensor, torch.Tensor]]]):
    """A ``DynamicCache`` holding the stack's K/V (per layer, ancestors concatenated in order)."""
    from transformers import DynamicCache

    if not stack:
        return DynamicCache(config=model.config), 0
    layers = [
        (torch.cat([s[i][0] for s in stack], dim=2), torch.cat([s[i][1] for s in stack], dim=2))
        for i in range(len(stack[0]))
    ]
    return DynamicCache(ddp_cache_data=layers, config=model.config), layers[0][0].shape[2]


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
    from ..logprobs import target_logprobs
    from ..models import prepare_model

    prepare_model(model)
    _check(model)
    packed = batch if isinstance(batch, PackedTree) else pack(batch)
    device = model.get_input_embeddings().weight.device
    packed = packed.to(device)
    head = model.get_output_embeddings()
    decoder = getattr(model, "treetrain_decoder", None) or model.base_model
    kids = node_children(packed.node_parent.cpu())
    starts, ends = packed.node_start.tolist(), packed.node_end.tolist()
    dtype = head.weight.dtype
    all_logp = torch.zeros(packed.num_tokens, dtype=torch.float32 if dtype != torch.float64 else dtype)
    total = torch.zeros((), dtype=torch.float64)

    def run(node: int, stack: list) -> None:
        nonlocal total
        s, e = starts[node], ends[node]
        cache, past = _cache(model, stack)
        out = decoder(
            input_ids=packed.input_ids[None, s:e],
            position_ids=packed.position_ids[None, s:e],
            past_key_values=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state[0]  # [n, H]
        own = [(layer.keys[:, :, past:], layer.values[:, :, past:]) for layer in cache.layers]
        # rows of this node predict its next tokens and its children's first tokens
        targets = [*range(s + 1, e), *(starts[c] for c in kids[node])]
        targets = torch.tensor(targets, dtype=torch.long, device=device)
        rows = packed.prev[targets] - s
        loss = packed.input_ids.new_zeros((), dtype=hidden.dtype)
        if targets.numel():
            logp, _ = target_logprobs(hidden[rows], head, packed.input_ids[targets], chunk, entropy=False)
            all_logp[targets.cpu()] = logp.detach().to(all_logp.dtype).cpu()
            loss = token_loss(logp, targets)
        leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in own]
        del out, cache
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
