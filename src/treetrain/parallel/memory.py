"""Peak activation memory on any device: bytes of the tensors autograd saves for backward.

On CPU there is no allocator peak counter; what grows with a tree's size is what autograd keeps
for backward, which ``torch.autograd.graph.saved_tensors_hooks`` sees exactly. Tensors are
counted once per storage while any saved reference to them is alive; parameters are not counted.

>>> with SavedTensorMeter() as meter:
...     loss = model(x).sum()
>>> meter.peak  # bytes
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SavedTensorMeter"]


class _Saved:
    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedTensorMeter, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        self.meter, self.tensor, self.key = meter, tensor, (storage.data_ptr(), storage.nbytes())
        meter._add(self.key)

    def __del__(self):
        self.meter._remove(self.key)


class SavedTensorMeter:
    """Context manager: ``current`` and ``peak`` bytes of saved activations (deduplicated)."""

    def __init__(self) -> None:
        self.refs: dict[tuple[int, int], int] = {}
        self.current = 0
        self.peak = 0

    def _add(self, key: tuple[int, int]) -> None:
        if self.refs.get(key, 0) == 0:
            self.current += key[1]
            self.peak = max(self.peak, self.current)
        self.refs[key] = self.refs.get(key, 0) + 1

    def _remove(self, key: tuple[int, int]) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.current -= key[1]

    def _pack(self, t: torch.Tensor):
        return t if isinstance(t, nn.Parameter) else _Saved(self, t)

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Saved) else x

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
