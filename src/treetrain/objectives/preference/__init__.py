"""The preference objectives, ``--objective dpo | reward``, one file per part:

- :mod:`.pairs`: which paths of a micro-batch form (chosen, rejected) pairs, the step's normalizer
  (its number of pairs) and micro-batches that never split a pair;
- :mod:`.loss`: what the objective is (``PreferenceObjective``: DPO's loss types, the reward
  model's Bradley-Terry) and one micro-batch's loss (``compute_preference_loss``);
- :mod:`.training`: the objective as the training loop composes it (``PreferenceTraining``).

May import: trees, data, attention, models, logprobs and the modules of ``treetrain.objectives``.
"""
