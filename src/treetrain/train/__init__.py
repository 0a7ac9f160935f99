"""Training: the loop behind ``treetrain train`` and the pieces it composes.

Config (:mod:`.config`), model building (:mod:`.build`), what the loop lends an objective for its
extra models (:mod:`.kit`), batches (:mod:`.batches`), packing strategies tree | sequence
(:mod:`.strategies`, for the benchmarks), one optimizer step (:mod:`.step`), held-out evaluation
(:mod:`.evaluate`), checkpoints and run directories, signals, trackers, what a run prints
(:mod:`.console`) and writes (:mod:`.outputs`); :mod:`.loop` holds the loop and its command line. The
objective (:mod:`treetrain.objectives.interface`) decides the rest; the loop has no branch on it.

May import: trees, data, attention, models, logprobs, objectives, parallel.
"""
