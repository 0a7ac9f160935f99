"""Training: the loop behind ``treetrain train`` and the pieces it composes.

Config (:mod:`.config`), model building (:mod:`.build`), batches (:mod:`.batches`), packing
strategies tree | sequence (:mod:`.strategies`), one optimizer step (:mod:`.step`), checkpoints and
run directories, signals, trackers and outputs; :mod:`.loop` holds the loop and its command line.

May import: trees, data, attention, models, logprobs, objectives, parallel.
"""
