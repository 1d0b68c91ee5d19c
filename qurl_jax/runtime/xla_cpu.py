"""Which library runs a run's float matrix products on XLA:CPU (`config.train.cpu_dots`).

XLA:CPU hands a float dot whose operands are laid out row-major to a YNNPACK fusion and the others
(transposed operands, as in the weight gradients of a backward pass) to its Eigen matmul. 'xla'
keeps that choice; 'eigen' turns the YNNPACK fusions off (XLA_FLAGS
`--xla_cpu_experimental_ynn_fusion_type=`), so every float dot runs through Eigen. Measured on a
2-core Intel Xeon (AVX512 + VNNI), float32 (docs/performance.md): the update of a
SmolLM2-135M-shaped learner at the library's defaults (576 wide, 30 unrolled layers, 2,912 packed
positions) 1.16x faster with 'eigen'; the 128-wide embedded default's warm start 4% slower; a
whole GRPO step of SmolLM2-135M with its layers rematerialised in a scan 1.13x slower (its
rollout 1.5x). So 'xla' is the default, and 'eigen' is for an update like the first. Only CPU
programs change; the values differ by float rounding.

XLA reads its flags once, when JAX starts its first backend, so `apply` works only before that:
`python -m qurl_jax.main` calls it right after reading the config. A user's own
`--xla_cpu_experimental_ynn_fusion_type` in `XLA_FLAGS` wins.
"""

from __future__ import annotations

import os

CPU_DOTS = ("xla", "eigen")
_FLAG_NAME = "xla_cpu_experimental_ynn_fusion_type"


def xla_flags(choice: str, flags: str = "") -> str:
    """`XLA_FLAGS` (given as `flags`) with what `choice` (one of `CPU_DOTS`) adds: a process
    that starts JAX with it runs its float products that way; a flag already there wins."""
    if choice not in CPU_DOTS:
        raise ValueError(f"cpu_dots={choice!r} must be one of {CPU_DOTS}")
    if choice == "xla" or _FLAG_NAME in flags:
        return flags
    return f"{flags} --{_FLAG_NAME}=".strip()


def apply(choice: str) -> str | None:
    """Sets this process's `XLA_FLAGS` for `choice`; returns a line saying why it could not
    (JAX's backends already started), else None."""
    flags = os.environ.get("XLA_FLAGS", "")
    wanted = xla_flags(choice, flags)
    if wanted == flags:
        return None
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return (f"config.train.cpu_dots={choice!r} not applied: JAX's backends had started; set "
                f"XLA_FLAGS=--{_FLAG_NAME}= before JAX starts instead")
    os.environ["XLA_FLAGS"] = wanted
    return None
