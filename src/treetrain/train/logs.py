"""Library loggers at a level a user can read: ``torch.distributed.checkpoint`` logs every save and
load at DEBUG through loggers it sets to DEBUG itself (``c10d-NullHandler-dcp_logger``); ``treetrain``
raises them to WARNING unless ``--verbose``."""

from __future__ import annotations

import logging

__all__ = ["quiet_library_loggers"]


def quiet_library_loggers(level: int = logging.WARNING) -> None:
    """Set torch.distributed's own loggers (created at import, at DEBUG) to ``level``."""
    import torch.distributed.c10d_logger  # noqa: F401 - creates the c10d loggers
    import torch.distributed.checkpoint.logger  # noqa: F401 - creates the DCP logger

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("c10d-"):
            logging.getLogger(name).setLevel(level)
