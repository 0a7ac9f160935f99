"""Attention sinks: one learned logit per head (GPT-OSS), or per head and query (Inkling2, computed
from the query's hidden state), that joins the row's softmax with a zero value, as an extra key
every query sees.

With ``lse`` the log-sum-exp of a row's scores over its visible keys and ``s`` the head's sink::

    out_sink = sum_k exp(score_k - lse') v_k = out * exp(lse - lse'),   lse' = logaddexp(lse, s)

so any backend that returns ``out`` and ``lse`` adds sinks after the fact. Its backward is the plain
flash backward run with ``out_sink`` and ``lse'`` (the probabilities ``exp(score - lse')`` are the
ones with the sink), plus the sink's own gradient, the softmax gradient of a zero-value key::

    d s = -sum_rows exp(s - lse') * D,   D = rowsum(d out * out_sink)

Example: one row, scores ``[0, 0]`` over values ``[1, 3]``, sink ``0``: ``lse = log 2``,
``lse' = log 3``, ``out = 2 * 2/3 = 4/3`` (HF's eager: softmax ``[1/3, 1/3, 1/3]`` over
``[1, 3, 0]``).
"""

from __future__ import annotations

import torch

__all__ = ["add_sinks", "sink_grad", "check_sinks"]


def check_sinks(name: str, sinks: torch.Tensor, heads: int, tokens: int | None = None) -> None:
    """``sinks`` must be ``[Hq]`` (per head) or ``[Hq, T]`` (per head and query)."""
    if sinks.shape != (heads,) and (tokens is None or sinks.shape != (heads, tokens)):
        per_query = "" if tokens is None else f" or [Hq, T] = [{heads}, {tokens}]"
        raise ValueError(f"{name}: sinks must be [Hq] = [{heads}]{per_query}, got {tuple(sinks.shape)}")


def _rows(sinks: torch.Tensor) -> torch.Tensor:
    """``[H]`` or ``[H, T]`` -> broadcastable against ``[H, T]``."""
    return sinks[:, None] if sinks.dim() == 1 else sinks


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [H, T, D]``, ``lse [H, T]`` (natural log), ``sinks [H]`` or ``[H, T]`` -> ``(out_sink, lse')``.

    ``out_sink`` has ``out``'s dtype; ``lse'`` has ``lse``'s.
    """
    new_lse = torch.logaddexp(lse, _rows(sinks).to(lse.dtype))
    return (out * torch.exp(lse - new_lse)[..., None].to(out.dtype)).to(out.dtype), new_lse


def sink_grad(
    do: torch.Tensor, out_sink: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """Gradient of the sinks (``[H]`` or ``[H, T]``, as given): ``do, out_sink [H, T, D]``,
    ``lse [H, T]`` (with the sink)."""
    acc = lse.dtype
    delta = (do.to(acc) * out_sink.to(acc)).sum(-1)  # [H, T]
    per_row = -(torch.exp(_rows(sinks).to(acc) - lse) * delta)
    return (per_row.sum(-1) if sinks.dim() == 1 else per_row).to(sinks.dtype)
