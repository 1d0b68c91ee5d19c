"""Which library runs a run's float matrix products on XLA:CPU (`config.train.cpu_dots`).

XLA:CPU hands a float dot whose operands are laid out row-major to a YNNPACK fusion and the others
(transposed operands, as in the weight gradients of a backward pass) to its Eigen matmul. With the
YNNPACK fusions off (`--xla_cpu_experimental_ynn_fusion_type=`) every float dot runs through Eigen.
The choices:

- 'xla': XLA's own choice everywhere.
- 'learner': the learner's programs (its update and log-prob passes) compile with the YNNPACK
  fusions off (`jax.jit`'s per-program `compiler_options`, `learner_compiler_options`); the
  rollout, the evaluation and the warm start keep XLA's choice.
- 'eigen': every program of the process (XLA_FLAGS, `apply`).
- 'auto' (the default): 'learner' on a CPU without AVX512, 'xla' on one with it.

Measured (docs/performance.md), float32, the update of a SmolLM2-135M-shaped learner at the
library's defaults (576 wide, 30 unrolled layers, 2,912 packed positions): on a 2-core Intel Xeon
(AVX512 + VNNI) 1.16x faster with Eigen before the learner's plain weight-gradient products
(`models.cpu_weight_grads`), and the 128-wide warm start 4% slower; on a 2-core AMD EPYC with
AVX2 only the learner's programs were 0.98-0.99x as fast with Eigen's products on batches under
a thousand positions and 1.2-1.3x faster from a few thousand on (128 to 576 wide), the update
0.89-1.12x torch's (four runs, median 1.00) instead of 1.19x, while the INT8 rollout there
loses about 40% without YNNPACK (a whole GRPO step 1.13x slower with 'eigen', 1.06x faster with
'learner'). Only CPU programs change; the values differ by float rounding.

XLA reads its flags once, when JAX starts its first backend, so `apply` works only before that:
`python -m qurl_jax.main` calls it right after reading the config. A user's own
`--xla_cpu_experimental_ynn_fusion_type` in `XLA_FLAGS` wins, for the learner's programs too.
"""

from __future__ import annotations

import functools
import os
from typing import Any

CPU_DOTS = ("auto", "xla", "learner", "eigen")
_FLAG_NAME = "xla_cpu_experimental_ynn_fusion_type"
# The instruction sets the library's CPU choices tell apart, lowest first ('amx': AVX512 with
# AMX-INT8 tiles, where XLA's int8 GEMM runs on the tile unit).
CPU_ISAS = ("none", "avx2", "avx512", "amx")
ISA_ENV = "QURL_JAX_CPU_ISA"


def isa_cap() -> str:
    """The most `QURL_JAX_CPU_ISA` lets the library use (one of `CPU_ISAS`; unset: 'amx', no
    cap). 'avx2' makes an AVX512 CPU take every AVX2 CPU's choices (the CPU kernels' AVX2 paths,
    `train.cpu_dots='auto'`'s 'learner'), to test and time them; 'avx512' makes an AMX CPU take
    an AVX512 one's (the int8 kernel's decode rows, `quant.int8_kernel_rows`); 'none' turns the
    kernels off. XLA's own code generation has its own cap (`XLA_FLAGS=--xla_cpu_max_isa=AVX2`);
    it is not capped here: XLA's int8 GEMM uses AMX where the CPU has it."""
    value = os.environ.get(ISA_ENV, "").strip().lower() or "amx"
    if value not in CPU_ISAS:
        raise ValueError(f"{ISA_ENV}={value!r} must be one of {CPU_ISAS}")
    return value


@functools.cache
def _cpuinfo(key: str) -> str:
    """The value of the first `key` line of Linux's /proc/cpuinfo ('' where it cannot tell)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[-1].strip() for line in f if line.startswith(key)),
                        "")
    except OSError:
        return ""


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """This host's CPU flags (none where /proc/cpuinfo cannot tell)."""
    return frozenset(_cpuinfo("flags").split())


def cpu_model() -> str:
    """This host's CPU model name ('' where /proc/cpuinfo cannot tell)."""
    return _cpuinfo("model name")


def cpu_isa() -> str:
    """The best of `CPU_ISAS` this host's CPU has (AMX-INT8 tiles with AVX512F; AVX512F; AVX2
    with FMA), capped by `isa_cap()`."""
    flags = _cpu_flags()
    best = ("amx" if {"avx512f", "amx_tile", "amx_int8"} <= flags else "avx512"
            if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "none")
    return min(best, isa_cap(), key=CPU_ISAS.index)


def has_avx512() -> bool:
    """Whether this host's CPU has AVX512F and `QURL_JAX_CPU_ISA` does not cap it lower."""
    return CPU_ISAS.index(cpu_isa()) >= CPU_ISAS.index("avx512")


def resolve(choice: str) -> str:
    """`choice` with 'auto' replaced by what it means on this host ('learner' or 'xla')."""
    if choice not in CPU_DOTS:
        raise ValueError(f"cpu_dots={choice!r} must be one of {CPU_DOTS}")
    if choice == "auto":
        return "xla" if has_avx512() else "learner"
    return choice


def learner_compiler_options(choice: str) -> dict[str, Any] | None:
    """`jax.jit` compiler options for the learner's CPU programs under `choice`: YNNPACK's fusions
    off for 'learner' (and 'auto' where it means that); None otherwise, and when the user's
    XLA_FLAGS set the option themselves."""
    if resolve(choice) != "learner" or _user_sets_flag():
        return None
    return {_FLAG_NAME: ""}


def _user_sets_flag(flags: str | None = None) -> bool:
    """Whether `flags` (default: this process's XLA_FLAGS) set the YNNPACK option themselves:
    then they win over every choice."""
    return _FLAG_NAME in (os.environ.get("XLA_FLAGS", "") if flags is None else flags)


def describe(choice: str) -> str:
    """One line for a run's log: what `choice` means on this host."""
    what = {"xla": "XLA's choice (YNNPACK where it takes the dot) in every program",
            "learner": "Eigen's in the learner's programs, XLA's choice elsewhere",
            "eigen": "Eigen's in every program"}[resolve(choice)]
    why = (f" (auto: this CPU has {'' if has_avx512() else 'no '}AVX512)" if choice == "auto"
           else "")
    if _user_sets_flag():
        return (f"XLA:CPU float products: as XLA_FLAGS' --{_FLAG_NAME} says in every program "
                f"(it wins over train.cpu_dots={choice!r}{why})")
    return f"XLA:CPU float products: {what}, train.cpu_dots={choice!r}{why}"


def xla_flags(choice: str, flags: str = "") -> str:
    """`XLA_FLAGS` (given as `flags`) with what `choice` (one of `CPU_DOTS`) adds: a process
    that starts JAX with it runs its float products that way ('eigen' only: the other choices
    add nothing process-wide); a flag already there wins."""
    if resolve(choice) != "eigen" or _user_sets_flag(flags):
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
