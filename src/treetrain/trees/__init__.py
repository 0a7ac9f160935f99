"""Trees: the prefix tree of token paths, its DFS packing, budgeted partitioning and FLOP counts.

Holds :class:`~treetrain.trees.tree.TrajectoryTree` (build, serialize), :mod:`.packing` (the
``PackedTree`` tensors a forward reads), :mod:`.partition` / :mod:`.partition_methods` /
:mod:`.binpack` (split a tree under a token budget, pack parts into micro-batches) and
:mod:`.flops` (what each mode computes).

May import: nothing else from treetrain (numpy and torch only).
"""
