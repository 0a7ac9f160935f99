"""treetrain: train LLMs on tree-structured agent trajectories.

The public API, listed once here and loaded lazily (``import treetrain`` imports neither torch nor
transformers; a name's module is imported on first use)::

    import treetrain
    model = treetrain.tiny_model()                   # or any Hugging Face ...ForCausalLM
    tree = treetrain.TrajectoryTree.from_paths([[1, 2, 3, 4], [1, 2, 5]])
    logp = treetrain.path_logprobs(model, tree)      # one forward over the 5 distinct tokens

The package is laid out along the data flow; a subpackage imports only those before it:
``trees`` < ``data`` < ``attention`` < ``models`` < ``logprobs`` < ``objectives`` < ``parallel`` <
``train`` < ``integrations`` < ``bench`` < ``cli``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_API = {
    # trees: build, pack, split
    "TrajectoryTree": "treetrain.trees.tree",
    "ImageInput": "treetrain.trees.images",
    "PackedTree": "treetrain.trees.packing",
    "pack": "treetrain.trees.packing",
    "partition": "treetrain.trees.partition",
    "pack_microbatches": "treetrain.trees.partition",
    # data
    "iter_trees": "treetrain.data.reader",
    "validate_file": "treetrain.data.reader",
    "sample_path": "treetrain.data.reader",
    "DataError": "treetrain.data.fields",
    "parse_record": "treetrain.data.records",
    # the tree forward
    "path_logprobs": "treetrain.logprobs",
    "tree_logprobs": "treetrain.logprobs",
    "expand_to_paths": "treetrain.logprobs",
    # models known by name (a real pretrained model from the package index)
    "pretrained_dir": "treetrain.models.pretrained",
    # objectives
    "Objective": "treetrain.objectives.policy.config",
    "compute_loss": "treetrain.objectives.policy.loss",
    "loss_normalizer": "treetrain.objectives.policy.aggregation",
    "reference_logprobs": "treetrain.objectives.policy.loss",
    "group_advantages": "treetrain.objectives.advantages",
    # integrations and training
    "flat_logprobs": "treetrain.integrations.flat",
    "row_images": "treetrain.integrations.flat_images",
    "TrainConfig": "treetrain.train.config",
    "tiny_model": "treetrain.train.build",
}

__all__ = [
    "DataError",
    "ImageInput",
    "Objective",
    "PackedTree",
    "TrainConfig",
    "TrajectoryTree",
    "compute_loss",
    "expand_to_paths",
    "flat_logprobs",
    "group_advantages",
    "iter_trees",
    "loss_normalizer",
    "pack",
    "pack_microbatches",
    "parse_record",
    "partition",
    "path_logprobs",
    "pretrained_dir",
    "reference_logprobs",
    "row_images",
    "sample_path",
    "tiny_model",
    "tree_logprobs",
    "validate_file",
    "__version__",
]

if TYPE_CHECKING:
    from treetrain.data.fields import DataError
    from treetrain.data.reader import iter_trees, sample_path, validate_file
    from treetrain.data.records import parse_record
    from treetrain.integrations.flat import flat_logprobs
    from treetrain.integrations.flat_images import row_images
    from treetrain.logprobs import expand_to_paths, path_logprobs, tree_logprobs
    from treetrain.models.pretrained import pretrained_dir
    from treetrain.objectives.advantages import group_advantages
    from treetrain.objectives.policy.aggregation import loss_normalizer
    from treetrain.objectives.policy.config import Objective
    from treetrain.objectives.policy.loss import compute_loss, reference_logprobs
    from treetrain.train.build import tiny_model
    from treetrain.train.config import TrainConfig
    from treetrain.trees.images import ImageInput
    from treetrain.trees.packing import PackedTree, pack
    from treetrain.trees.partition import pack_microbatches, partition
    from treetrain.trees.tree import TrajectoryTree


def __getattr__(name: str) -> Any:
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'treetrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
