"""Tables keyed by a transformers class name, looked up through subclasses.

FSDP2 wraps a module's class in a ``FSDP<Name>`` subclass (and other wrappers subclass the same
way), so a wrapped layer is found by the first class of its MRO whose name the table holds. Example:
``class FSDPMambaMixer(MambaMixer)``: ``own_class(layer, {"MambaMixer": ...})`` is ``MambaMixer``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TypeVar

__all__ = ["class_entry", "own_class", "required_class"]

V = TypeVar("V")


def own_class(obj: object, names: Collection[str]) -> type | None:
    """The first class of ``type(obj).__mro__`` whose name is in ``names``, else None."""
    return next((c for c in type(obj).__mro__ if c.__name__ in names), None)


def class_entry(obj: object, table: Mapping[str, V]) -> V | None:
    """``table``'s entry for ``obj``'s class or the first base class it names, else None."""
    c = own_class(obj, table)
    return None if c is None else table[c.__name__]


def required_class(obj: object, names: Collection[str], what: str) -> type:
    """``own_class(obj, names)``, or a ``ValueError``: ``"Foo is not a {what}: A, B"``."""
    c = own_class(obj, names)
    if c is None:
        raise ValueError(f"{type(obj).__name__} is not a {what}: {', '.join(sorted(names))}")
    return c
