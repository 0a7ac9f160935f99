"""Bin packing for partitioning: items ``(size, payload)`` into bins of a capacity.

Best-fit decreasing (``O(k log k)``), a balanced variant, an exact minimum-bin-slack search for a
handful of items, and the trivial packers; :mod:`treetrain.trees.partition` uses them per node of
its DP and to pack parts into micro-batches.
"""

from __future__ import annotations

import bisect
import heapq
import operator
from collections.abc import Callable

import numpy as np

_MBS_MAX_ITEMS = 12  # minimum-bin-slack search is exponential: only for a handful of items
_MBS_STEPS = 512  # search nodes per bin


# A bin (a candidate part) is (total, content): total = its distinct tokens, root to leaves, which
# stays fixed as the bin is handed up; content = a leaf node id, or a tuple of the bins merged into
# it. Bins merged at a node of depth d share those d tokens: total = t1 + t2 - d. Packers see
# items (size, bin) with size = total - d (tokens below the node) and cap = capacity - d.
# A state is (score, tiebreak, bins): score = sum of totals (the cost if nothing above merges);
# tiebreak = -sum of squared totals (prefer uneven bins: an emptier one merges more easily above).
_Bin = tuple
_Item = tuple
_State = tuple
_Packer = Callable[[list, int], list]
_size = operator.itemgetter(0)


def _best_fit_decreasing(items: list[_Item], cap: int) -> list[list[_Item]]:
    """Largest item first, into the open bin with the least room that still fits. ``O(k log k)``
    comparisons (plus list shifts). Sizes ``[5, 4, 3, 2]``, cap 7 -> ``[[5, 2], [4, 3]]``.
    """
    rooms: list[int] = []  # ascending, parallel to groups
    groups: list[list[_Item]] = []
    for item in sorted(items, key=_size, reverse=True):
        i = bisect.bisect_left(rooms, item[0])
        if i < len(rooms):
            r, g = rooms.pop(i) - item[0], groups.pop(i)
            g.append(item)
        else:
            r, g = cap - item[0], [item]
        j = bisect.bisect_left(rooms, r)
        rooms.insert(j, r)
        groups.insert(j, g)
    return groups


def _balanced(items: list[_Item], cap: int) -> list[list[_Item]]:
    """As many bins as best fit uses, then largest item first into the least loaded bin (a new
    bin if even that one is too full): the same merges with even loads, so a small piece stays
    free to merge above. ``O(k log k)``. Sizes ``[26, 14, 13]``, cap 47: best fit
    ``[[26, 14], [13]]``, balanced ``[[26], [14, 13]]``.
    """
    k = len(_best_fit_decreasing(items, cap))
    heap = [(0, g) for g in range(k)]  # (load, group index)
    groups: list[list[_Item]] = [[] for _ in range(k)]
    for item in sorted(items, key=_size, reverse=True):
        if heap[0][0] + item[0] <= cap:
            load, g = heapq.heappop(heap)
        else:
            load, g = 0, len(groups)
            groups.append([])
        groups[g].append(item)
        heapq.heappush(heap, (load + item[0], g))
    return [g for g in groups if g]


def _min_bin_slack(items: list[_Item], cap: int) -> list[list[_Item]]:
    """Fill one bin at a time with the largest item plus the subset of the rest that leaves the
    least room (bounded search). Beats best fit on its classic traps: sizes
    ``[28, 25, 25, 14, 13, 10]``, cap 61 -> ``[[28, 14, 13], [25, 25, 10]]`` (best fit: 3 bins).
    """
    left = sorted(items, key=_size, reverse=True)
    groups = []
    while left:
        sizes = [it[0] for it in left]
        suffix = [*np.cumsum(sizes[::-1])[::-1].tolist(), 0]  # suffix[j] = sum(sizes[j:])
        best_room, best_pick, steps = cap - sizes[0], [], 0
        stack = [(1, cap - sizes[0], [])]  # (next index, room, picked)
        while stack and best_room and steps < _MBS_STEPS:
            j, r, picked = stack.pop()
            steps += 1
            if r < best_room:
                best_room, best_pick = r, picked
            if j == len(left) or r - suffix[j] >= best_room:  # the rest cannot beat the best
                continue
            stack.append((j + 1, r, picked))
            if sizes[j] <= r:
                stack.append((j + 1, r - sizes[j], [*picked, j]))
        take = {0, *best_pick}
        groups.append([left[i] for i in sorted(take)])
        left = [it for i, it in enumerate(left) if i not in take]
    return groups


def _separate(items: list[_Item], cap: int) -> list[list[_Item]]:
    return [[it] for it in items]


def _one_bin(items: list[_Item], cap: int) -> list[list[_Item]]:
    return [items]
