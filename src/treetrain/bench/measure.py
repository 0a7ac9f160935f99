"""Load-independent measurements of one step: the FLOPs it executes and the peak of its live tensors.

Neither depends on how busy the machine is, so both can be taken on a shared machine and checked
against a benchmark's FLOP bound and activation bound:

- :func:`count_flops`: the matmul and attention FLOPs ``fn()`` runs, counted op by op by
  ``torch.utils.flop_counter.FlopCounterMode`` (its formulas for ``mm``, ``addmm``, ``bmm``, ...),
  plus formulas for the CPU flash-attention kernel, which torch's registry lacks. Split into the LM
  head (a matmul with a ``vocab``-sized dimension), attention and the rest (``linear``), the three
  terms of :class:`treetrain.trees.flops.CostModel`; elementwise work is not counted, as in the model.
- :func:`peak_bytes`: the most bytes of tensors alive at once while ``fn()`` runs, above what was
  alive when it started (CPU: torch's allocation events under ``torch.profiler``, whatever the
  allocator keeps mapped; CUDA: the caching allocator's peak).

Example (a ``[4, 8] @ [8, 16]`` matmul: ``2 * 4 * 8 * 16`` FLOPs, a 256-byte float32 result)::

    >>> import torch
    >>> a, b = torch.randn(4, 8), torch.randn(8, 16)
    >>> count_flops(lambda: a @ b, vocab=16)["head"]
    1024
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm}

__all__ = ["count_flops", "peak_bytes"]


def _flash_pairs(q_shape, k_shape, is_causal: bool) -> int:
    """(query, key) pairs one CPU flash call computes: all ``L x S`` with a mask or none, the lower
    triangle under ``is_causal`` (square: ``L (L + 1) / 2``)."""
    L, S = q_shape[-2], k_shape[-2]
    return L * (L + 1) // 2 if is_causal and L == S else L * S


def _flash_forward(q_shape, k_shape, v_shape, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kw):
    """``QK^T`` and ``PV``: 2 FLOPs per multiply-add, per pair, head and dimension."""
    batch_heads = q_shape[0] * q_shape[1]
    return 2 * batch_heads * _flash_pairs(q_shape, k_shape, is_causal) * (q_shape[-1] + v_shape[-1])


def _flash_backward(
    g_shape,
    q_shape,
    k_shape,
    v_shape,
    o_shape,
    lse_shape,
    dropout_p=0.0,
    is_causal=False,
    *a,
    out_shape=None,
    **kw,
):
    """Twice the forward: ``dV = P^T dO``, ``dP = dO V^T``, ``dQ = dS K``, ``dK = dS^T Q`` (the
    scores' recomputation, a fifth matmul, is not counted: model FLOPs, as for the rest)."""
    return 2 * _flash_forward(q_shape, k_shape, v_shape, dropout_p, is_causal)


def count_flops(fn: Callable[[], object], vocab: int | None = None) -> dict[str, int]:
    """``{"total", "head", "attention", "linear"}`` FLOPs ``fn()`` executes (forward and any backward
    it runs). ``head``: matmuls with a dimension of ``vocab`` (None: none counted as head).
    ``"logit_elements"``: elements of ``[..., vocab]`` tensors written by other ops (elementwise
    passes over logits, not FLOPs in the model; divided by positions x vocab: passes per position)."""
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    aten = torch.ops.aten
    split = {"head": 0, "attention": 0}

    def matmul(op):
        formula = flop_registry[op]

        def counted(*args, out_val=None, **kwargs):
            flops = formula(*args, out_val=out_val, **kwargs)
            if vocab is not None and any(
                isinstance(t, torch.Tensor) and vocab in t.shape for t in (*args, out_val)
            ):
                split["head"] += flops
            return flops

        counted._get_raw = True
        return counted

    def attention(formula):
        def counted(*args, **kwargs):
            flops = formula(*args, **kwargs)
            split["attention"] += flops
            return flops

        return counted

    mapping = {op: matmul(op) for op in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm)}
    # in place (``acc.addmm_(a, b)``, TRL's chunked head accumulates its gradient GEMMs so): torch's
    # registry has no entry, so they would go uncounted
    mapping[aten.addmm_] = matmul(aten.addmm)
    mapping[aten.baddbmm_] = matmul(aten.baddbmm)
    mapping[aten._scaled_dot_product_flash_attention_for_cpu] = attention(_flash_forward)
    mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = attention(_flash_backward)
    for op in flop_registry:  # CUDA kernels: counted by torch's formulas, filed as attention
        if "attention" in str(op) and op not in mapping:
            mapping[op] = _raw_attention(flop_registry[op], split)
    logits = _LogitElements(vocab)
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter, logits:
        fn()
    total = counter.get_total_flops()
    out = {"total": total, **split, "linear": total - split["head"] - split["attention"]}
    return out | {"logit_elements": logits.elements}


class _LogitElements(TorchDispatchMode):
    """Elements of ``[..., vocab]`` tensors written by ops other than matmuls and views: the
    elementwise passes over logits (softmax, exp, masks, gathers' sources) that FLOPs do not price."""

    def __init__(self, vocab: int | None):
        super().__init__()
        self.vocab, self.elements = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.vocab is not None and not func.is_view and func._overloadpacket not in _MATMULS:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab:
                    self.elements += t.numel()
        return out


def _raw_attention(formula, split: dict) -> Callable:
    def counted(*args, **kwargs):
        flops = formula(*args, **kwargs)
        split["attention"] += flops
        return flops

    counted._get_raw = True
    return counted


def peak_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """The most bytes of tensors alive at once during ``fn()``, above those alive at its start.

    CPU: from the allocation and free events ``torch.profiler`` records (``profile_memory``), in
    order; what the allocator does with freed memory does not count. CUDA: the caching allocator's
    ``max_memory_allocated`` above the start."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak
