"""Builds and registers qurl_jax's C++ XLA:CPU kernels (FFI custom calls) on first use.

Two kernels in this directory speed up the rollout's decode loop on x86 CPUs with AVX512: the int8
matmul that AQT's int8 recipe uses for its integer product (`int8_matmul.cc`, wrapped by
`qurl_jax.quant._cpu_kernel`) and the decode attention the sampler uses (`decode_attention.cc`,
wrapped by `decode_attention.py`). The third, `fixed_order.cc` (AVX512 or AVX2 + FMA, wrapped by
`fixed_order.py`), computes products, RMSNorm, attention and log-probs in one documented order
per row: exact on-policy numerics (`qurl_jax.models.exact`) and the FP8 learner's products.
Each source is compiled with the system C++ compiler (`$CXX`,
default `c++`) into `$QURL_JAX_CACHE_DIR` (default `~/.cache/qurl_jax`), keyed by a hash of the
directory's sources and the jaxlib version, loaded with ctypes, and its handlers registered as FFI
targets for the CPU platform.

Every user has an XLA fallback: `load` returns False, after logging a warning once, when the
compiler is missing or fails, when the CPU lacks the instructions (the library's `supported`
function says so), or when `QURL_JAX_CPU_KERNELS=0`.
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


@functools.cache
def load(source: str, supported: str, targets: tuple[tuple[str, str], ...]) -> bool:
    """Compiles `source` (a file name in this directory) if needed and registers its handlers;
    True when they can be called.

    supported: name of the library's `extern "C" int f()` that says whether this CPU can run it.
    targets: (FFI target name, handler symbol) pairs to register for the CPU platform.
    """
    if os.environ.get("QURL_JAX_CPU_KERNELS", "1") == "0":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(_compile(SOURCE_DIR / source)))
        if not getattr(lib, supported)():
            logging.warning("qurl_jax: this CPU cannot run %s; using XLA's ops instead", source)
            return False
        for target, symbol in targets:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as e:
        logging.warning("qurl_jax: the CPU kernel %s is unavailable (%s); using XLA's ops "
                        "instead", source, e)
        return False
    return True
