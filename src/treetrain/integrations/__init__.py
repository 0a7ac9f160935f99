"""Integrations: tree scoring inside other trainers.

:mod:`.flat` (a padded batch of rows -> one tree forward -> per-token log-probs in the caller's
layout), :mod:`.flat_images` (a processor's batched image inputs split per image per row),
:mod:`.wrapped` (the same through a model's accelerate/DDP/PEFT wrappers), :mod:`.trl`
(``TreeGRPOTrainer``, ``TreeRLOOTrainer``, ``TreeDPOTrainer``, ``TreeRewardTrainer``, all imported from
``treetrain.integrations.trl``): TRL's trainers with tree forwards, need ``pip install treetrain[trl]``;
:mod:`.verl` (``strategy=treetrain``: verl's FSDP2 engine with tree micro-batches, with
:mod:`.verl_rows` and :mod:`.verl_cpu`), needs ``pip install treetrain[verl]``.

May import: everything up to train (trees .. train).
"""
