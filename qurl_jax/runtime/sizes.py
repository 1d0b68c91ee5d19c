"""Bytes of pytrees of arrays or `jax.ShapeDtypeStruct`s: what a checkpoint writes, what a plan
or a benchmark charges per device. One definition for the trainer, the planners and the benches.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def tree_bytes(tree: Any) -> int:
    """Bytes of every leaf of `tree` at its global shape (a quantized tensor's codes and scales
    both count)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def tree_bytes_per_device(tree: Any) -> int:
    """Bytes of the first device's shards of `tree`'s leaves (a leaf with no sharding counts
    whole)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
        total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    return total
