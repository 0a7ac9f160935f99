"""Preemption: SIGTERM / SIGINT stop training at the end of the current step.

A cluster preempts a job with SIGTERM (then SIGKILL after a grace period); a user presses Ctrl-C
(SIGINT). :class:`StopOnSignal` turns the first such signal into a flag that the training loop
reads after each optimizer step: the step finishes, a checkpoint of the step reached is written
and the run exits with ``128 + signal`` (143 for SIGTERM, 130 for SIGINT). A second signal exits at
once (``os._exit``): checkpoints are written atomically, so at worst a ``step_N.tmp`` is left.

Under ``torchrun`` the ranks may see the signal at different steps (torchrun forwards it to each
worker in turn), so :meth:`StopOnSignal.should_stop` is a collective: the ranks agree (all-reduce
max of the flag) and stop after the same step, which the checkpoint's collectives need.

Example::

    >>> with StopOnSignal() as stop:
    ...     for step in range(1, steps + 1):
    ...         train_step(...)
    ...         if stop.should_stop():
    ...             save_checkpoint(...)
    ...             raise Preempted(stop.signum, step)
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

__all__ = ["Preempted", "StopOnSignal", "exit_code"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by ``signum``: ``128 + signum``."""
    return 128 + int(signum)


class Preempted(Exception):
    """Training stopped on a signal after finishing step ``step`` (checkpoint: ``checkpoint``)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None = None):
        self.signum, self.step, self.checkpoint = int(signum), step, checkpoint
        name = signal.Signals(signum).name
        where = f"checkpoint {checkpoint} written" if checkpoint else "no checkpoint written"
        super().__init__(f"stopped by {name} after step {step}; {where} (continue with --resume)")

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


class StopOnSignal:
    """Context manager: while active, the first SIGTERM/SIGINT only sets :attr:`signum`; a second one
    prints a line and exits the process at once with ``128 + signal``. The previous handlers come
    back on exit. Outside the main thread (where Python cannot install handlers) it does nothing.
    """

    def __init__(self, signals: tuple[int, ...] = SIGNALS, announce: bool = True):
        self.signals, self.announce = signals, announce
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            print(f"\ntreetrain: second signal ({name}): exiting now", file=sys.stderr, flush=True)
            os._exit(exit_code(signum))
        self.signum = signum
        if self.announce:
            print(
                f"\ntreetrain: {name} received: finishing the current step, then saving a checkpoint "
                "(send it again to exit at once)",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def should_stop(self) -> bool:
        """Whether any rank got a signal; the same answer on every rank (collective under torchrun)."""
        from treetrain.parallel import fsdp as distributed

        mine = float(self.signum or 0)
        if distributed.init_distributed().distributed:
            import torch
            import torch.distributed as dist

            flag = torch.tensor([mine], dtype=torch.float64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mine = float(flag.item())
            if self.signum is None and mine:
                self.signum = int(mine)  # another rank's signal: stop with it
        return bool(mine)
