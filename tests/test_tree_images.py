"""Images in the trie: a placeholder's identity is its image's content and its row, with the tensors
spelled out; the per-image bookkeeping survives subsets, splits and packing; bad input is named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treetrain.trees.images import ImageInput
from treetrain.trees.packing import pack
from treetrain.trees.tree import TrajectoryTree

P = 9  # the placeholder id


def img(value: float, rows: int = 2, token: int = P) -> ImageInput:
    return ImageInput({"pixel_values": torch.full((1, 3), value)}, num_tokens=rows, token_id=token)


def test_different_pixels_part_at_the_image_same_pixels_share_it():
    """Paths ``1 P P 2``, ``1 P P 3``, ``1 P P 4`` with images a, b (other pixels), a again (a copy):
    DFS ``1 | P P 2 4 (image a) | P P 3 (image b)``."""
    a, b, a_again = img(1.0), img(2.0), img(1.0)
    tree = TrajectoryTree.from_paths([[1, P, P, 2], [1, P, P, 3], [1, P, P, 4]], images=[[a], [b], [a_again]])
    assert tree.tokens.tolist() == [1, P, P, 2, 4, P, P, 3]
    assert tree.image_table.image.tolist() == [-1, 0, 0, -1, -1, 1, 1, -1]
    assert tree.image_table.row.tolist() == [-1, 0, 1, -1, -1, 0, 1, -1]
    assert [im.key for im in tree.image_table.images] == [a.key, b.key]
    assert tree.positions.tolist() == [0, 1, 2, 3, 3, 1, 2, 3]
    assert tree.path(1).tolist() == [1, P, P, 3]


def test_same_image_in_two_branches_is_two_nodes_one_image():
    """An image after the branch point in both branches: its tokens twice (different prefixes), one
    entry in the image table, so one encode."""
    a = img(1.0)
    tree = TrajectoryTree.from_paths([[1, 2, P, P, 5], [1, 3, P, P, 6]], images=[[a], [a]])
    assert tree.num_tokens == 9  # 1 | 2 P P 5 | 3 P P 6
    assert len(tree.image_table.images) == 1
    assert tree.image_table.image.tolist() == [-1, -1, 0, 0, -1, -1, 0, 0, -1]


def test_images_survive_subset_split_and_pack():
    a, b = img(1.0), img(2.0, rows=3)
    paths = [[1, P, P, 2, P, P, P, 7], [1, P, P, 3], [5, P, P, P]]
    tree = TrajectoryTree.from_paths(paths, images=[[a, b], [a], [b]])
    sub = tree.subset([1, 2])
    assert [p.tolist() for p in sub.paths()] == [paths[1], paths[2]]
    assert [im.key for im in sub.image_table.images] == [a.key, b.key]
    split = tree.split_by([0, 1, 0])  # path 1 alone: the prefix 1 P P twice
    assert split.num_tokens == tree.num_tokens + 3
    packed = pack([tree, sub])
    assert len(packed.images) == 4  # each tree's own: a part encodes the images it holds
    shifted = np.where(sub.image_table.image >= 0, sub.image_table.image + 2, -1)
    want = np.concatenate([tree.image_table.image, shifted])
    assert packed.image_index.tolist() == want.tolist()
    assert packed.path_images(4)[0].key == b.key  # path 4 of the forest: sub's second path


def test_bad_images_are_named():
    with pytest.raises(ValueError, match=r"path 0: 1 image placeholder tokens \(ids \[9\]\) but its 1 image"):
        TrajectoryTree.from_paths([[1, P, 2]], images=[[img(1.0)]])
    with pytest.raises(ValueError, match=r"images\[1\]\[0\]: expected an ImageInput"):
        TrajectoryTree.from_paths([[1, P, P], [1, 2]], images=[[img(1.0)], ["x.png"]])
    with pytest.raises(ValueError, match="one list of images per path"):
        TrajectoryTree.from_paths([[1, P, P]], images=[[img(1.0)], []])
    with pytest.raises(ValueError, match="num_tokens"):
        img(1.0, rows=0)
    # two images of different placeholder ids in the wrong order
    with pytest.raises(ValueError, match="path 0, image 0 .* must be token 9"):
        TrajectoryTree.from_paths([[1, 8, 8, P, P]], images=[[img(1.0), img(2.0, token=8)]])


def test_hash_is_content_not_identity():
    a = img(1.0)
    assert img(1.0).key == a.key and img(1.0, rows=3).key != a.key and img(1.0, token=8).key != a.key
    assert ImageInput({"pixel_values": torch.ones(1, 3, dtype=torch.float64)}, 2, P).key != a.key


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_image_trees_keep_every_path(data):
    """Random paths over 3 images (two of them identical in pixels): every path reads back its
    tokens, every placeholder row points into its own image, and tokens equal iff keys equal."""
    pool = [img(1.0), img(2.0), img(1.0)]
    paths, images = [], []
    for _ in range(data.draw(st.integers(1, 6))):
        path, ims = [1], []
        for _ in range(data.draw(st.integers(0, 3))):
            path += data.draw(st.lists(st.integers(2, 5), min_size=1, max_size=2))
            if data.draw(st.booleans()):
                im = pool[data.draw(st.integers(0, 2))]
                ims.append(im)
                path += [P] * im.num_tokens
        paths.append(path)
        images.append(ims)
    tree = TrajectoryTree.from_paths(paths, images=images)
    for i, p in enumerate(paths):
        assert tree.path(i).tolist() == p
        at = tree.path_index[i]
        if tree.image_table is not None:
            got = [tree.image_table.images[g].key for g in tree.image_table.image[at] if g >= 0]
            want = [im.key for im in images[i] for _ in range(im.num_tokens)]
            assert got == want


def test_merged_preference_pairs_keep_their_images():
    """Two DPO pairs, prompt ``1 P P`` with other pixels (a, b): merged into one step's tree they part at
    the image (``1 | P P 2 3 | P P 4 5``), each path with its own image."""
    from treetrain.objectives.preference.pairs import merge_pairs

    a, b = img(1.0), img(2.0)
    pair = lambda im, c, r: TrajectoryTree.from_paths(  # noqa: E731
        [[1, P, P, c], [1, P, P, r]], images=[[im], [im]], loss_masks=[[0, 0, 0, 1]] * 2, margins=[0.0, 0.0]
    )
    merged = merge_pairs([pair(a, 2, 3), pair(b, 4, 5)])
    assert merged.tokens.tolist() == [1, P, P, 2, 3, P, P, 4, 5]
    assert [merged.fields["images"][p][0].key for p in range(4)] == [a.key, a.key, b.key, b.key]
    assert [im.key for im in merged.image_table.images] == [a.key, b.key]
