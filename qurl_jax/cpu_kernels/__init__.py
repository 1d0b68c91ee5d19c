"""Builds and registers qurl_jax's C++ XLA:CPU kernels (FFI custom calls) on first use.

Three kernels in this directory run on x86 CPUs. Two speed up the rollout's decode loop: the
int8 matmul that AQT's int8 recipe uses for its integer product (`int8_matmul.cc`, wrapped by
`qurl_jax.quant._cpu_kernel`) and the decode attention the samplers use (`decode_attention.cc`,
wrapped by `decode_attention.py`); each has an AVX512 path (VNNI for the int8 product) and an AVX2
path for CPUs without AVX512 (most laptops). The third, `fixed_order.cc` (AVX512 or AVX2 + FMA,
wrapped by `fixed_order.py`), computes products, RMSNorm, attention and log-probs in one
documented order per row: exact on-policy numerics (`qurl_jax.models.exact`) and the FP8
learner's products. Each source is compiled with the system C++ compiler (`$CXX`, default `c++`)
into `$QURL_JAX_CACHE_DIR` (default `~/.cache/qurl_jax`), keyed by a hash of the directory's
sources and the jaxlib version, loaded with ctypes, and its handlers registered as FFI targets
for the CPU platform: every path this CPU can run, each under its own target name, so one process
can run both (the tests do).

Which path the library uses (`load`'s answer): the best this CPU runs, capped by the environment
variable `QURL_JAX_CPU_ISA` ('avx512', the default: no cap; 'avx2': the AVX2 paths even on an
AVX512 CPU, to test and time them; 'none': no kernel; `qurl_jax.runtime.xla_cpu.isa_cap`).
Every user has an XLA fallback: `load` returns '' (no kernel), after logging a warning once, when
the compiler is missing or fails, when the CPU has neither instruction set (the library's `isa`
function says so), with `QURL_JAX_CPU_ISA=none`, or when `QURL_JAX_CPU_KERNELS=0`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import subprocess
import tempfile

import jax
import jaxlib


def _cache_dir() -> pathlib.Path:
    default = pathlib.Path.home() / ".cache" / "qurl_jax"
    return pathlib.Path(os.environ.get("QURL_JAX_CACHE_DIR", default))


SOURCE_DIR = pathlib.Path(__file__).parent


def _compile(source: pathlib.Path) -> pathlib.Path:
    """Builds the shared library (once per hash of the sources and jaxlib version) and returns
    its path."""
    hasher = hashlib.sha256(jaxlib.__version__.encode())
    for f in sorted(SOURCE_DIR.iterdir()):
        if f.suffix in (".cc", ".h"):
            hasher.update(f.read_bytes())
    digest = hasher.hexdigest()[:16]
    out = _cache_dir() / f"{source.stem}-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "c++")
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        tmp_path = pathlib.Path(tmp.name)
    cmd = [cxx, "-O3", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}",
           f"-I{source.parent}", str(source), "-o", str(tmp_path)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        tmp_path.replace(out)  # atomic: concurrent builders never see a partial file
    finally:
        tmp_path.unlink(missing_ok=True)
    return out


# The library's `isa` function's answer for each path; 0: none this CPU runs.
_LEVELS = {"avx512": 2, "avx2": 1}


@functools.cache
def load(source: str, isa: str, targets: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]
         ) -> str:
    """Compiles `source` (a file name in this directory) if needed, registers the handlers of
    every path this CPU runs and returns the one to use: 'avx512', 'avx2', or '' (none: XLA's
    ops).

    isa: name of the library's `extern "C" int f()` that says which paths this CPU runs (2: both,
      1: AVX2 only, 0: neither).
    targets: per path ('avx512' / 'avx2'), its (FFI target name, handler symbol) pairs.
    """
    from qurl_jax.runtime.xla_cpu import isa_cap

    cap = isa_cap()
    if os.environ.get("QURL_JAX_CPU_KERNELS", "1") == "0" or cap == "none":
        return ""
    try:
        lib = ctypes.cdll.LoadLibrary(str(_compile(SOURCE_DIR / source)))
        level = getattr(lib, isa)()
        runs = [path for path, _ in targets if _LEVELS[path] <= level]
        if not runs:
            logging.warning("qurl_jax: this CPU cannot run %s (it needs AVX2); using XLA's ops "
                            "instead", source)
            return ""
        for path, pairs in targets:
            for target, symbol in pairs if path in runs else ():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                            platform="cpu")
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as e:
        logging.warning("qurl_jax: the CPU kernel %s is unavailable (%s); using XLA's ops "
                        "instead", source, e)
        return ""
    return choose(level, cap)


def choose(level: int, cap: str) -> str:
    """The path to use on a CPU whose library says `level` (2: AVX512 and AVX2 paths run, 1: the
    AVX2 one, 0: none) under `QURL_JAX_CPU_ISA`'s `cap`: the best at most the cap ('' none)."""
    from qurl_jax.runtime.xla_cpu import CPU_ISAS

    runs = [path for path, need in _LEVELS.items() if need <= level]
    return max((p for p in runs if CPU_ISAS.index(p) <= CPU_ISAS.index(cap)), key=_LEVELS.get,
               default="")
