"""Low-rank adapters over a frozen base: the adapter tree, its kernels and the products.

A LoRA policy is a frozen base (the model's `params` with its linear kernels stored once as
`quant.QuantizedTensor` codes, or in the compute dtype) plus an adapter: for every targeted
linear layer two float32 factors a[in, r] and b[r, out], and the layer computes

    y = x @ W_base + (x @ a) @ b * alpha / r        (Hu et al. 2021; PEFT's `lora_A`.T, `lora_B`.T)

`attach(base, adapter, scale)` replaces each targeted kernel of the base by a `LoraKernel` that
holds the base kernel (the same array, not a copy), a and b; `dot_general(inner)` wraps the
model's product hook so a `LoraKernel` runs the base product through `inner` (the rollout's W8A8
path, or a weight-only product of the same codes in the learner) and adds the adapter's two
thin products. Nothing of the model changes: it is built with the wrapped hook and applied to the
attached tree, exactly as the quantized rollout actor already is.

The adapter's initialisation is PEFT's default: a uniform in +-1/sqrt(in) (Kaiming-uniform with
a = sqrt(5)), b zero, so the policy starts as the base exactly.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from qurl_jax.quant import (
    QuantFormat,
    QuantizedTensor,
    Recipe,
    quantize_kernel,
    quantized_leaves,
    requantize,
)

Params = dict[str, Any]
Path = tuple[str, ...]
DotGeneral = Callable[..., jax.Array]

# The linear layers a LoRA run may target (the decoder layers' projections; never the embedding
# or the LM head, as PEFT's default for causal LMs).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Where the base's weights are kept: int8 or FP8 codes (the rollout recipe's format), or the
# compute dtype (`model.dtype`).
BASE_PRECISIONS = ("int8", "fp8", "compute")
# How the learner's forward and input gradient read the base's codes (`lora._learner`): float
# activations times the codes, or the rollout's int8 W8A8 product.
LEARNER_PRODUCTS = ("weight_only", "w8a8")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What a LoRA run trains (`model.lora`).

    rank: r, the adapter's inner size (0: no LoRA, every parameter trains).
    alpha: the adapter's output is scaled by alpha / r (PEFT's `lora_alpha`).
    targets: regular expressions; a decoder layer's projection is adapted when one of them
      `re.search`es its module path, e.g. 'layers_3/self_attn/q_proj' ('_proj$' takes all seven).
    base_precision: 'int8' | 'fp8' (the base's kernels as the rollout recipe's codes) or
      'compute' (kept in the compute dtype).
    learner_products: how the learner's forward and input gradient read the base's codes
      (`lora.LEARNER_PRODUCTS`): 'weight_only' (float activations) or 'w8a8' (the rollout's
      int8 W8A8 product, an int8 input gradient; needs the 'int8' rollout recipe).
    """

    rank: int = 0
    alpha: float = 32.0
    targets: tuple[str, ...] = PROJECTIONS
    base_precision: str = "int8"
    learner_products: str = "weight_only"

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / r: the adapter's output scale."""
        return float(self.alpha) / self.rank

    def validate(self, prefix: str = "model.lora.") -> LoraConfig:
        """Raises ValueError naming the bad field; returns self."""
        if self.rank < 0:
            raise ValueError(f"config.{prefix}rank={self.rank} must be >= 0 (0: no LoRA)")
        if self.enabled and self.alpha <= 0:
            raise ValueError(f"config.{prefix}alpha={self.alpha} must be > 0")
        if self.base_precision not in BASE_PRECISIONS:
            raise ValueError(f"config.{prefix}base_precision={self.base_precision!r} is not one "
                             f"of {BASE_PRECISIONS}")
        if self.learner_products not in LEARNER_PRODUCTS:
            raise ValueError(f"config.{prefix}learner_products={self.learner_products!r} is not "
                             f"one of {LEARNER_PRODUCTS}")
        if self.enabled and not self.targets:
            raise ValueError(f"config.{prefix}targets is empty: name the projections to adapt, "
                             f"e.g. {PROJECTIONS}")
        for pattern in self.targets:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"config.{prefix}targets: {pattern!r} is not a regular "
                                 f"expression ({e})") from None
        return self


@flax.struct.dataclass
class LoraKernel:
    """A targeted linear layer's weights: the frozen base kernel [in, out] (a float array or a
    `QuantizedTensor`), the adapter's a f32[in, r] and b f32[r, out], and scale = alpha / r."""

    base: Any
    a: jax.Array
    b: jax.Array
    scale: float = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def ndim(self) -> int:
        return 2


def target_paths(params: Params, cfg: LoraConfig) -> list[Path]:
    """The module paths (without 'kernel') of the projections `cfg.targets` select, in
    flattening order; ValueError naming a pattern that selects none."""
    modules = [p[:-1] for p in traverse_util.flatten_dict(params)
               if len(p) >= 2 and p[-1] == "kernel" and p[-2] in PROJECTIONS]
    chosen, unused = [], []
    for pattern in cfg.targets:
        hits = [m for m in modules if re.search(pattern, "/".join(m))]
        if not hits:
            unused.append(pattern)
        chosen.extend(m for m in hits if m not in chosen)
    if unused:
        raise ValueError(f"config.model.lora.targets: {unused} match no projection of the model "
                         f"(module paths like 'layers_0/self_attn/q_proj', names {PROJECTIONS})")
    order = {m: i for i, m in enumerate(modules)}
    return sorted(chosen, key=order.__getitem__)


def adapter_shapes(params: Params, cfg: LoraConfig) -> Params:
    """The adapter tree as `jax.ShapeDtypeStruct`s: {module path: {'a': f32[in, r], 'b':
    f32[r, out]}} for every targeted projection of `params` (arrays or shapes)."""
    flat = traverse_util.flatten_dict(params)
    out = {}
    for module in target_paths(params, cfg):
        rows, cols = flat[module + ("kernel",)].shape
        out[module + ("a",)] = jax.ShapeDtypeStruct((rows, cfg.rank), jnp.float32)
        out[module + ("b",)] = jax.ShapeDtypeStruct((cfg.rank, cols), jnp.float32)
    return traverse_util.unflatten_dict(out)


def init_adapter(key: jax.Array, params: Params, cfg: LoraConfig) -> Params:
    """A fresh adapter for `params` (arrays or shapes): a ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's
    Kaiming-uniform, a = sqrt(5)), b = 0, float32; one key per module, folded from `key`."""
    flat = traverse_util.flatten_dict(adapter_shapes(params, cfg))
    out = {}
    for i, path in enumerate(sorted(p for p in flat if p[-1] == "a")):
        shape = flat[path].shape
        bound = 1.0 / math.sqrt(shape[0])
        out[path] = jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32,
                                       -bound, bound)
        b = path[:-1] + ("b",)
        out[b] = jnp.zeros(flat[b].shape, jnp.float32)
    return traverse_util.unflatten_dict(out)


def attach(base: Params, adapter: Params, scale: float) -> Params:
    """The policy's parameters: `base` with each adapted kernel a `LoraKernel` around the base's
    own kernel (the same array object) and the adapter's a, b. Traceable."""
    flat = traverse_util.flatten_dict(base)
    for path, leaf in traverse_util.flatten_dict(adapter).items():
        if path[-1] != "a":
            continue
        module = path[:-1]
        kernel = module + ("kernel",)
        if kernel not in flat:
            raise ValueError(f"lora.attach: the adapter's {'/'.join(module)} has no kernel in "
                             "the base")
        flat[kernel] = LoraKernel(flat[kernel], leaf, adapter_at(adapter, module)["b"], scale)
    return traverse_util.unflatten_dict(flat)


def adapter_at(adapter: Params, module: Path) -> Params:
    """The {'a', 'b'} of one module of an adapter tree."""
    node = adapter
    for name in module:
        node = node[name]
    return node


def weight_only(base: Params) -> Params:
    """The same base for float activations: each `QuantizedTensor` re-wrapped with no activation
    format (the same codes and scales, the same array objects), so a product reads its codes
    weight-only, as the learner's forward and the evaluation do."""
    is_q = lambda x: isinstance(x, QuantizedTensor)  # noqa: E731
    return jax.tree.map(lambda x: x.replace(act_format=None) if is_q(x) else x, base,
                        is_leaf=is_q)


def dot_general(inner: DotGeneral) -> DotGeneral:
    """The model's product hook with adapters: a `LoraKernel` rhs gives inner(x, base) + (x @ a)
    @ b * scale (the adapter's products through `inner` too, in the activations' dtype); any
    other rhs goes to `inner` unchanged. `inner` must take the base's kernels (for
    `QuantizedTensor`s: `quant.rollout_dot_general`, or `lora.learner_products`)."""

    def hook(lhs: jax.Array, rhs: Any, dimension_numbers: Any, precision: Any = None,
             preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
        if not isinstance(rhs, LoraKernel):
            return inner(lhs, rhs, dimension_numbers, precision=precision,
                         preferred_element_type=preferred_element_type, **kwargs)
        (lhs_c, rhs_c), (lhs_b, _) = dimension_numbers
        if lhs_b or tuple(lhs_c) != (lhs.ndim - 1,) or tuple(rhs_c) != (0,):
            raise ValueError(f"lora.dot_general: a LoraKernel supports only x[..., in] @ kernel"
                             f"[in, out]; got dimension_numbers={dimension_numbers}")
        linear = (((lhs.ndim - 1,), (0,)), ((), ()))
        out = inner(lhs, rhs.base, dimension_numbers, precision=precision,
                    preferred_element_type=preferred_element_type, **kwargs)
        down = inner(lhs, rhs.a.astype(lhs.dtype), linear, precision=precision)
        up = inner(down, rhs.b.astype(lhs.dtype), linear, precision=precision)
        return out + (up * rhs.scale).astype(out.dtype)

    return hook


def merge(base: Params, adapter: Params, scale: float, dtype: Any = jnp.float32) -> Params:
    """Plain float parameters of the policy: every base leaf dequantized (or cast) to `dtype`,
    each adapted kernel plus a @ b * scale. For the Hugging Face export (`--export_hf`)."""
    def plain(x: Any) -> Any:
        if isinstance(x, QuantizedTensor):
            return np.asarray(x.dequantize(jnp.float32)).astype(dtype)
        return np.asarray(x, np.float32).astype(dtype)

    is_q = lambda x: isinstance(x, QuantizedTensor)  # noqa: E731
    flat = traverse_util.flatten_dict(jax.tree.map(plain, base, is_leaf=is_q))
    for path, a in traverse_util.flatten_dict(adapter).items():
        if path[-1] != "a":
            continue
        module = path[:-1]
        b = np.asarray(adapter_at(adapter, module)["b"], np.float32)
        kernel = flat[module + ("kernel",)].astype(np.float32)
        flat[module + ("kernel",)] = (kernel + np.asarray(a, np.float32) @ b * scale).astype(dtype)
    return traverse_util.unflatten_dict(flat)


@jax.jit
def _sums(leaves: Sequence[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.stack([jnp.sum(x), jnp.sum(x * x)]) for x in leaves])


def fingerprint(adapter: Params) -> np.ndarray:
    """f32[leaves, 2]: each adapter leaf's sum and sum of squares, by one jitted program. Two
    placements of the same values (the learner's, the rollout's, both replicated) give the same
    bits; an adapter that is not the learner's (never moved to the rollout, an earlier step's)
    does not."""
    leaves = jax.tree.leaves(adapter)
    return np.asarray(jax.device_get(_sums(leaves))) if leaves else np.zeros((0, 2), np.float32)


def check_base_recipe(cfg: LoraConfig, recipe: Recipe) -> None:
    """ValueError (one line naming both fields) when the rollout recipe does not store the
    base's kernels in `cfg.base_precision`: 'int8' takes an int8 recipe (W8A8 'int8', or
    'int8_weight_only'), 'fp8' an FP8 one ('fp8', 'fp8_block'), 'compute' the 'fp' recipe;
    learner_products 'w8a8' takes the W8A8 'int8' recipe."""
    wanted = {"int8": QuantFormat.INT8, "fp8": QuantFormat.FP8_E4M3, "compute": None}
    if recipe.weight_format is not wanted[cfg.base_precision]:
        raise ValueError(f"config.model.lora.base_precision={cfg.base_precision!r} does not "
                         f"match config.rollout.precision={recipe.name!r}: the rollout reads the "
                         "base's own codes, so pick a rollout recipe of the base's format "
                         "(int8: 'int8' or 'int8_weight_only'; fp8: 'fp8' or 'fp8_block'; "
                         "compute: 'fp')")
    if cfg.learner_products == "w8a8" and not (
            recipe.weight_format is QuantFormat.INT8 and recipe.act_format is QuantFormat.INT8
            and recipe.weight_block is None):
        raise ValueError(f"config.model.lora.learner_products='w8a8' runs the learner on the "
                         f"rollout's int8 W8A8 product, but config.rollout.precision="
                         f"{recipe.name!r} is not that product: use rollout.precision='int8' "
                         "or learner_products='weight_only'")


def quantize_base(params: Params, cfg: LoraConfig, recipe: Recipe, compute_dtype: Any,
                  shardings: Params | None = None) -> Params:
    """The frozen base, made once from the float parameters: the recipe's linear kernels (and,
    with `recipe.quantize_vocab`, the vocabulary tables) as codes and scales, every other leaf
    in the compute dtype, the values `quant.requantize` gives; with base_precision 'compute',
    every leaf in the compute dtype. One small program per leaf, each output placed at once by
    `shardings` (a tree like the output's, e.g. the rollout layout's), so the float32 weights
    never sit whole on a device: a 32B model's base is quantized on an 80 GB GPU from host
    memory."""
    check_base_recipe(cfg, recipe)
    flat = traverse_util.flatten_dict(params)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    formats = {path: rest for path, *rest in quantized_leaves(shapes, recipe)} if (
        recipe.quantizes) else {}
    placed = traverse_util.flatten_dict(shardings) if shardings is not None else {}
    dtype = jnp.dtype(compute_dtype)
    out = {}
    for path, leaf in flat.items():
        if path in formats:
            out[path] = _quantize_leaf(leaf, *formats[path], placed.get(path))
        else:
            out[path] = _cast_leaf(leaf, dtype, placed.get(path))
    return traverse_util.unflatten_dict(out)


def base_shapes(params: Params, cfg: LoraConfig, recipe: Recipe, compute_dtype: Any) -> Params:
    """`quantize_base`'s output as `jax.ShapeDtypeStruct`s (nothing quantized or placed)."""
    check_base_recipe(cfg, recipe)
    return jax.eval_shape(lambda p: requantize(p, recipe if recipe.quantizes else "fp",
                                               compute_dtype=compute_dtype), params)


def _quantize_leaf(w: Any, fmt: QuantFormat, block: tuple[int, int], act_format: Any,
                   sharding: Any) -> QuantizedTensor:
    fn = jax.jit(quantize_kernel, static_argnums=(1, 2, 3),
                 out_shardings=None if sharding is None else sharding)
    return fn(w, fmt, block, act_format)


def _cast_leaf(x: Any, dtype: Any, sharding: Any) -> jax.Array:
    value = x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jnp.asarray(value) if sharding is None else jax.device_put(value, sharding)
