"""Integrations: tree scoring inside other trainers.

:mod:`.flat` (a padded batch of rows -> one tree forward -> per-token log-probs in the caller's
layout), :mod:`.wrapped` (the same through a model's accelerate/DDP/PEFT wrappers), :mod:`.trl`
(``TreeGRPOTrainer``, ``TreeRLOOTrainer``) and :mod:`.trl_preference` (``TreeDPOTrainer``,
``TreeRewardTrainer``): TRL's trainers with tree forwards, need ``pip install treetrain[trl]``.

May import: everything up to train (trees .. train).
"""
