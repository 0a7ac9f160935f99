"""The policy objectives, ``--objective sft | reinforce | grpo | ppo | gspo``, one file per part:

- :mod:`.config`: what an objective is (:class:`~treetrain.objectives.policy.config.Objective`: clip
  range, KL and entropy terms, aggregation) and what it needs from the data;
- :mod:`.aggregation`: the batch's per-path view (``PathMeta``) and how per-token losses aggregate
  over it (the step's normalizer ``N``, the coefficients ``c[p, j]``);
- :mod:`.loss`: the per-token losses and one micro-batch's loss (``compute_loss``);
- :mod:`.training`: the objective as the training loop composes it (``PolicyObjective``).

May import: trees, data, attention, models, logprobs and the modules of ``treetrain.objectives``.
"""
