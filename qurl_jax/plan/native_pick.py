"""Whether a chip multiplies the rollout actor's format natively; what to pick where it does not.

What each chip's compiler makes of the quantized products was read from its compiled code
(`python -m qurl_jax.bench.native_products`; the table and the instructions are in
docs/hardware.md): the int8 product (s8 x s8 -> s32) reaches the int8 matrix path on TPU v5e, v6e
and v5p and on the H100; FP8 (e4m3) has no matrix path on those TPUs (libtpu widens the codes and
runs f32 passes, the `fp8` and `fp8_block` actors alike), and is native on the H100. The float
actors (`fp`, and `int8_weight_only`, whose product is in the compute dtype) run the bf16 path
everywhere.

    note = native_pick.rollout_note("fp8", native_pick.chip_of(device.device_kind))
    # "rollout.precision='fp8' has no native product on TPU v5p: ... the native pick is 'int8' ..."

`memory_plan.preflight` and `memory_plan.report` (so `bench.memory`) log the note in one line.
It is a note, not an error: an upcast FP8 actor still runs, and matches an FP8 learner's format.
"""

from __future__ import annotations

# Rollout precisions (`quant.RECIPES`) whose product each chip runs natively.
_FLOAT = frozenset({"fp", "int8_weight_only"})
NATIVE: dict[str, frozenset[str]] = {
    "v5e": _FLOAT | {"int8"},
    "v6e": _FLOAT | {"int8"},
    "v5p": _FLOAT | {"int8"},
    "h100": _FLOAT | {"int8", "fp8", "fp8_block"},
}
PICK = "int8"  # native on every chip of NATIVE, and the same bytes per weight as FP8
_NAMES = {"v5e": "TPU v5e", "v6e": "TPU v6e", "v5p": "TPU v5p", "h100": "H100"}
# device_kind as JAX reports it (compile-only devices too) -> chip.
_KINDS = (("tpu v5 lite", "v5e"), ("tpu v5e", "v5e"), ("tpu v6 lite", "v6e"), ("tpu v6e", "v6e"),
          ("tpu v5p", "v5p"), ("tpu v5", "v5p"), ("h100", "h100"))


def chip_of(device_kind: str) -> str | None:
    """The chip (a key of NATIVE) of a JAX device kind ('TPU v5 lite', 'TPU v5',
    'NVIDIA H100 80GB HBM3', ...), or None for a chip not in the table (CPU included)."""
    kind = device_kind.lower()
    return next((chip for prefix, chip in _KINDS if prefix in kind), None)


def rollout_note(precision: str, chip: str | None) -> str | None:
    """One line when `precision` has no native product on `chip`, naming the native pick; None
    where it is native or the chip is not in the table."""
    if chip not in NATIVE or precision in NATIVE[chip]:
        return None
    return (f"rollout.precision={precision!r} has no native product on {_NAMES[chip]}: its FP8 "
            f"codes are widened and multiplied in f32 (docs/hardware.md), so it saves HBM bytes "
            f"but not matrix time; the native pick is {PICK!r} "
            f"(--config.rollout.precision={PICK}), the same bytes per weight")
