"""Run ``treetrain.train.loop.train`` for every config of a JSON list (``argv[1]``) in one process,
one after the other; under ``torchrun`` every rank does, in one process group. One launch then pays
the start-up (torch, transformers, the process group) once for several runs
(tests/test_train_objectives_distributed.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from treetrain.parallel import fsdp
from treetrain.train.loop import train


def main() -> int:
    try:
        for cfg in json.loads(Path(sys.argv[1]).read_text()):
            train(cfg, quiet=True)
    finally:
        fsdp.destroy()
    return 0


if __name__ == "__main__":
    from treetrain.parallel.fsdp import exit_rank

    exit_rank(main())  # no interpreter teardown (see exit_rank)
