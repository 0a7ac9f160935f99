"""TRL's trainers with tree forwards: the one place to import them from (``pip install
"treetrain[trl]"``)::

    from treetrain.integrations.trl import TreeDPOTrainer, TreeGRPOTrainer, TreeRewardTrainer, TreeRLOOTrainer

:mod:`.online` (``TreeGRPOTrainer``, ``TreeRLOOTrainer``: TRL's online trainers, every scoring forward
a prefix tree), :mod:`.preference` (``TreeDPOTrainer``, ``TreeRewardTrainer``: each preference pair
one tree), :mod:`.shared` (the TRL version check, refusals, the MoE aux loss). This ``__init__`` is
the documented import place of the four trainers and ``TESTED_TRL``: it imports them from the
modules that define them (the one exception to the no-re-export rule besides ``treetrain``'s public
API, stated in ``tests/test_layout.py``).

May import: everything up to train (trees .. train), and the other integrations modules.
"""

from treetrain.integrations.trl.online import TreeGRPOTrainer, TreeRLOOTrainer
from treetrain.integrations.trl.preference import TreeDPOTrainer, TreeRewardTrainer
from treetrain.integrations.trl.shared import TESTED_TRL

__all__ = ["TESTED_TRL", "TreeDPOTrainer", "TreeGRPOTrainer", "TreeRLOOTrainer", "TreeRewardTrainer"]
