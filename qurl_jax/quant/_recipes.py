"""Precision recipes for the rollout actor, selected by name.

A `Recipe` says which number format the weights and the activations of the quantized linear layers
use, at which granularity their scales are computed, and which layers are quantized. The recipes
follow the papers: QuRL's W8A8 (`int8`, `fp8`: weight scales per output channel, activation scales
per token, computed on the fly) and Jet-RL's / DeepSeek-V3's block-scaled FP8 (`fp8_block`: 128x128
weight blocks, 1x128 activation groups). `int8_weight_only` is the weight-only reference point.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax.numpy as jnp

LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LM_HEAD = "lm_head"
EMBEDDING = ("embed_tokens", "embedding")  # the token table [V, E] (the tied LM head too)


class QuantFormat(enum.Enum):
    """Low-precision storage formats. The value is what AQT's `quantizer_make(n_bits=...)` takes."""

    INT8 = 8
    FP8_E4M3 = "e4m3"

    @property
    def dtype(self) -> Any:
        return jnp.dtype(jnp.int8) if self is QuantFormat.INT8 else jnp.dtype(jnp.float8_e4m3fn)

    @property
    def max_code(self) -> float:
        """Largest representable magnitude: 127 (symmetric int8) or 448 (E4M3)."""
        return 127.0 if self is QuantFormat.INT8 else float(jnp.finfo(jnp.float8_e4m3fn).max)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How the rollout copy of the actor is quantized.

    Attributes:
      name: the recipe's name (`get_recipe` key).
      weight_format: format of quantized kernels; None means no quantization (the `fp` recipe).
      act_format: format of the activations entering a quantized layer (quantized dynamically,
        inside the forward); None means weight-only (the kernel is dequantized before the product).
      weight_block: (rows, cols) of one weight scale block of a kernel [in, out]; None means one
        scale per output channel (a block of all input rows by one column). A block larger than a
        dimension shrinks to that dimension.
      act_group: number of consecutive input features of one token sharing an activation scale;
        None means one scale per token. Must equal weight_block[0] when both are set, so that each
        partial product has exactly one activation and one weight scale.
      layers: module names of the linear layers to quantize (`q_proj`, ..., `down_proj`).
      quantize_lm_head: also quantize an untied `lm_head` like the linear layers (W8A8; off by
        default: the sampled distribution is most sensitive there).
      quantize_vocab: hold the vocabulary tables - the token embedding and the LM head, tied or
        not - as weight-only int8 codes with one float32 scale per vocabulary entry
        (`VOCAB_FORMAT`, `vocab_block`): the rollout reads and the once-per-step reshard moves
        1 byte per element instead of 2 (bf16), and the activations stay in the compute dtype
        (the product is codes x activations, then the entry's scale). Off by default for a
        `Recipe`; the trainer turns it on with `rollout.quantize_vocab` (its default). An
        untied LM head that `quantize_lm_head` already quantizes stays W8A8.
    """

    name: str
    weight_format: QuantFormat | None
    act_format: QuantFormat | None
    weight_block: tuple[int, int] | None = None
    act_group: int | None = None
    layers: tuple[str, ...] = LINEAR_LAYERS
    quantize_lm_head: bool = False
    quantize_vocab: bool = False

    def __post_init__(self) -> None:
        unknown = [layer for layer in self.layers if layer not in LINEAR_LAYERS]
        if unknown:
            raise ValueError(
                f"Recipe {self.name!r}: layers {unknown} are not linear layers of the model; "
                f"expected a subset of {LINEAR_LAYERS}"
            )
        if self.weight_format is None and self.act_format is not None:
            raise ValueError(f"Recipe {self.name!r}: act_format needs a weight_format")
        if (self.weight_block is None) != (self.act_group is None):
            raise ValueError(
                f"Recipe {self.name!r}: weight_block={self.weight_block} and "
                f"act_group={self.act_group} must be set together"
            )
        if self.weight_block is not None and self.weight_block[0] != self.act_group:
            raise ValueError(
                f"Recipe {self.name!r}: act_group={self.act_group} must equal the weight block's "
                f"input size {self.weight_block[0]}"
            )

    @property
    def quantizes(self) -> bool:
        return self.weight_format is not None

    @property
    def quantized_modules(self) -> tuple[str, ...]:
        """Names of the modules whose `kernel` is quantized."""
        if not self.quantizes:
            return ()
        return self.layers + ((LM_HEAD,) if self.quantize_lm_head else ())

    @property
    def quantizes_vocab(self) -> bool:
        return self.quantizes and self.quantize_vocab

    def replace(self, **kwargs: Any) -> Recipe:
        return dataclasses.replace(self, **kwargs)


# Vocabulary tables (`Recipe.quantize_vocab`) are int8 under every recipe: weight-only, they need
# no low-precision product, and int8 with one scale per entry resolves 1/254 of the entry's largest
# |w| everywhere, where E4M3 keeps 3 mantissa bits.
VOCAB_FORMAT = QuantFormat.INT8


def vocab_block(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, int]:
    """The scale block of a vocabulary table: one scale per vocabulary entry, i.e. per row of the
    embedding [V, E] and per column (output channel) of an untied LM head kernel [E, V]."""
    rows, cols = shape
    return (1, cols) if tuple(path[-2:]) == EMBEDDING else (rows, 1)


RECIPES: dict[str, Recipe] = {
    "fp": Recipe("fp", None, None),
    "int8": Recipe("int8", QuantFormat.INT8, QuantFormat.INT8),
    "int8_weight_only": Recipe("int8_weight_only", QuantFormat.INT8, None),
    "fp8": Recipe("fp8", QuantFormat.FP8_E4M3, QuantFormat.FP8_E4M3),
    "fp8_block": Recipe("fp8_block", QuantFormat.FP8_E4M3, QuantFormat.FP8_E4M3,
                        weight_block=(128, 128), act_group=128),
}


def get_recipe(name: str | Recipe, **overrides: Any) -> Recipe:
    """The recipe called `name` (a `Recipe` passes through), with fields replaced by `overrides`.

    Raises ValueError naming the unknown recipe and the known ones.
    """
    if isinstance(name, Recipe):
        recipe = name
    elif name in RECIPES:
        recipe = RECIPES[name]
    else:
        raise ValueError(f"unknown quantization recipe {name!r}; known recipes: {sorted(RECIPES)}")
    return recipe.replace(**overrides) if overrides else recipe
