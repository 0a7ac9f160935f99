"""Library loggers at a level a user can read: ``torch.distributed.checkpoint`` logs every save and
load at DEBUG through loggers it sets to DEBUG itself (``c10d-NullHandler-dcp_logger``); ``treetrain``
raises them to WARNING unless ``--verbose``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["library_progress_bars", "quiet_library_loggers"]


def quiet_library_loggers(level: int = logging.WARNING) -> None:
    """Set torch.distributed's own loggers (created at import, at DEBUG) to ``level``."""
    import torch.distributed.c10d_logger  # noqa: F401 - creates the c10d loggers
    import torch.distributed.checkpoint.logger  # noqa: F401 - creates the DCP logger

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("c10d-"):
            logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def library_progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' own progress bars ("Loading weights", "Writing model shards" in
    ``save_pretrained``) on or off for a block, as ``--progress`` / ``--no-progress`` asks; restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
