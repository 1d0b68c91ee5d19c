"""Per-RL-step requantization: learner parameters -> frozen low-precision rollout parameters.

QuRL quantizes the current full-precision policy once per step (theta_behav = Q(theta_old)), with
no calibration data; Jet-RL's block-scaled FP8 works the same way because a block's scale is a
deterministic function of its weights. `requantize` is that map: a jitted pure function that
replaces each selected linear kernel (and, with `Recipe.quantize_vocab`, the embedding and LM
head) by a `QuantizedTensor` (codes + f32 scales; the float kernel is not kept) and leaves every
other leaf as it is (or casts it to the compute dtype). On a sharded
input each output leaf is constrained to the input kernel's sharding (scales: the same mesh axes
on the dimensions they divide), so the codes never leave their device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from qurl_jax.quant._qtensor import QuantizedTensor, quantize_kernel
from qurl_jax.quant._recipes import (
    EMBEDDING,
    LM_HEAD,
    VOCAB_FORMAT,
    QuantFormat,
    Recipe,
    get_recipe,
    vocab_block,
)

Params = dict[str, Any]
Path = tuple[str, ...]


def kernel_block(recipe: Recipe, shape: tuple[int, ...]) -> tuple[int, int]:
    """The (rows, cols) scale block of a kernel [in, out] under `recipe`, shrunk to the shape."""
    rows, cols = shape
    if recipe.weight_block is None:
        return rows, 1  # per output channel
    return min(recipe.weight_block[0], rows), min(recipe.weight_block[1], cols)


def quantized_kernel_paths(params: Params, recipe: Recipe) -> list[Path]:
    """Paths (module names) of the kernels `recipe` quantizes, in flattening order.

    Raises ValueError naming a module of the recipe that the parameters do not contain.
    """
    flat = traverse_util.flatten_dict(params)
    wanted = set(recipe.quantized_modules)
    paths = [p for p in flat if len(p) >= 2 and p[-1] == "kernel" and p[-2] in wanted]
    found = {p[-2] for p in paths}
    missing = sorted(wanted - found)
    if missing:
        hint = (" (the LM head is tied to the embeddings, which quantize_lm_head never "
                "quantizes; quantize_vocab holds them as weight-only int8)") if (
            LM_HEAD in missing) else ""
        raise ValueError(
            f"recipe {recipe.name!r} quantizes {missing} but the parameters have no such "
            f"'<module>/kernel'{hint}"
        )
    return paths


def vocab_table_paths(params: Params) -> list[Path]:
    """Paths of the vocabulary tables: the token embedding [V, E] and an untied LM head [E, V]."""
    return [p for p in traverse_util.flatten_dict(params)
            if p[-2:] == EMBEDDING or p[-2:] == (LM_HEAD, "kernel")]


def quantized_leaves(params: Params, recipe: Recipe
                     ) -> list[tuple[Path, QuantFormat, tuple[int, int], QuantFormat | None]]:
    """(path, codes format, scale block, activation format) of every leaf `recipe` quantizes:
    its linear kernels (`quantized_kernel_paths`), then, with `recipe.quantize_vocab`, the
    vocabulary tables it does not already quantize (weight-only int8, one scale per entry)."""
    flat = traverse_util.flatten_dict(params)
    out = [(path, recipe.weight_format, kernel_block(recipe, flat[path].shape), recipe.act_format)
           for path in quantized_kernel_paths(params, recipe)]
    if recipe.quantizes_vocab:
        done = {path for path, *_ in out}
        out += [(path, VOCAB_FORMAT, vocab_block(path, flat[path].shape), None)
                for path in vocab_table_paths(params) if path not in done]
    return out


def quantize_params(params: Params, recipe: Recipe, sharded: frozenset[Path] = frozenset()
                    ) -> Iterator[tuple[Path, QuantizedTensor]]:
    """(path, QuantizedTensor) for every leaf `recipe` quantizes (`quantized_leaves`;
    traceable, not jitted); the kernels at `sharded` paths are split over devices
    (`quantize_kernel`'s `sharded`)."""
    flat = traverse_util.flatten_dict(params)
    for path, fmt, block, act_format in quantized_leaves(params, recipe):
        yield path, quantize_kernel(flat[path], fmt, block, act_format, sharded=path in sharded)


def _axis_size(mesh: Any, axes: Any) -> int:
    if axes is None:
        return 1
    return int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))


def _scale_sharding(kernel: NamedSharding, scale_shape: tuple[int, ...]) -> NamedSharding:
    """The kernel's mesh axes on each scale dimension they still divide, else replicated."""
    spec = tuple(kernel.spec) + (None,) * (len(scale_shape) - len(kernel.spec))
    kept = [ax if dim % _axis_size(kernel.mesh, ax) == 0 else None
            for ax, dim in zip(spec, scale_shape, strict=True)]
    return NamedSharding(kernel.mesh, PartitionSpec(*kept))


def _out_shardings(params: Params, recipe: Recipe) -> tuple[tuple[Path, Any, Any], ...] | None:
    """(path, codes sharding, scale sharding) per quantized leaf, or None for unsharded input."""
    flat = traverse_util.flatten_dict(params)
    out = []
    for path, _, block, _ in quantized_leaves(params, recipe):
        w = flat[path]
        sharding = getattr(w, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            return None
        scale_shape = tuple(math.ceil(d / b) for d, b in zip(w.shape, block, strict=True))
        out.append((path, sharding, _scale_sharding(sharding, scale_shape)))
    return tuple(out)


@functools.partial(jax.jit, static_argnames=("recipe", "compute_dtype", "shardings"))
def _requantize(params: Params, recipe: Recipe, compute_dtype: Any,
                shardings: tuple[tuple[Path, Any, Any], ...] | None) -> Params:
    flat = traverse_util.flatten_dict(params)
    if compute_dtype is not None:
        flat = {p: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
                for p, x in flat.items()}
    targets = {path: (codes, scale) for path, codes, scale in shardings or ()}
    split = frozenset(path for path, (codes, _) in targets.items()
                      if not codes.is_fully_replicated)
    for path, q in quantize_params(params, recipe, split):
        if path in targets:
            codes_sharding, scale_sharding = targets[path]
            q = q.replace(qvalue=jax.lax.with_sharding_constraint(q.qvalue, codes_sharding),
                          scale=jax.lax.with_sharding_constraint(q.scale, scale_sharding))
        flat[path] = q
    return traverse_util.unflatten_dict(flat)


def requantize(params: Params, recipe: str | Recipe, compute_dtype: Any = None) -> Params:
    """Frozen rollout parameters for `recipe` from the learner's float parameters.

    Args:
      params: the model's `params` pytree (float32 master weights, possibly sharded).
      recipe: a recipe name (`get_recipe`) or a `Recipe`.
      compute_dtype: if given, the remaining float leaves (norms, embeddings, LM head, biases) are
        cast to it; by default they are kept (the model casts them at use).

    Returns the same tree with each quantized `<module>/kernel` replaced by a `QuantizedTensor`
    (int8 / float8_e4m3fn codes of the kernel's shape and float32 block scales), and with
    `recipe.quantize_vocab` the embedding and LM head too (weight-only int8, a scale per
    entry). Run the model on it with `Transformer(config, dot_general=rollout_dot_general)`.
    """
    recipe = get_recipe(recipe)
    cd = None if compute_dtype is None else jnp.dtype(compute_dtype)
    return _requantize(params, recipe, cd, _out_shardings(params, recipe))


def requantize_program(params: Params, recipe: str | Recipe, compute_dtype: Any = None
                       ) -> Callable[[Params], Params]:
    """The jitted program `requantize` runs for parameters of `params`' structure and shardings
    (arrays, or `jax.ShapeDtypeStruct`s carrying shardings): its `.lower(params)` compiles what
    the trainer runs, codes kept on each kernel's sharding, without running it."""
    recipe = get_recipe(recipe)
    cd = None if compute_dtype is None else jnp.dtype(compute_dtype)
    shardings = _out_shardings(params, recipe)
    return jax.jit(lambda p: _requantize(p, recipe, cd, shardings))
