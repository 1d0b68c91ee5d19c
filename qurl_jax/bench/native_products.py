"""What the quantized products compile to on a chip we do not have: native low-precision matrix
units, or an upcast to a wider float.

    python -m qurl_jax.bench.native_products --target=gpu:h100-1 --json=h100.json
    python -m qurl_jax.bench.native_products --target=tpu:v5p-8 --json=v5p.json
    python -m qurl_jax.bench.native_products --table h100.json v5p.json   # markdown table

The products (compute dtype bfloat16 activations, as the rollout and the learner run them on an
accelerator; `--shape=M,K,N`, default one 1.5B MLP up-projection at 256 tokens):

- `bf16`: the float reference, bf16 x bf16 -> f32;
- `int8_rollout` / `fp8_rollout`: `quant.rollout_dot_general` on a per-channel int8 / FP8 E4M3
  kernel (W8A8: AQT quantizes the activations per token, s8 x s8 -> s32 or e4m3 x e4m3 -> f32);
- `fp8_block_forward` / `fp8_block_dgrad` / `fp8_block_wgrad`: the three GEMMs of
  `quant.fp8_block_linear` (Jet-RL's block-scaled FP8 training product): the forward, the gradient
  of the input and the gradient of the weight, each compiled alone (`jax.vjp` with the other
  cotangent dropped, so XLA removes the other GEMM).

What is read from the compiler's output, per target:

- TPU: libtpu's final LLO bundles (`--xla_jf_dump_llo_text`), the MXU instructions by operand type:
  `vmatmul.s8` is the int8 MXU path, `vmatmul.bf16` bf16, `vmatmul.f32` a float32 matmul (on
  chips without an FP8 MXU the e4m3 codes are first widened by `vunpack`). The LLO dump flags must
  reach libtpu before it starts, so `main` sets `LIBTPU_INIT_ARGS` itself (`tpu_dump_args`).
- GPU (H100): the optimized HLO (a Triton GEMM fusion or a cuBLAS custom call, e.g.
  `__cublas$lt$matmul$f8`) and the PTX of the Triton kernels: `wgmma...e4m3.e4m3` / `mma...s8.s8`
  are FP8 / INT8 tensor-core instructions, `cvt...e4m3x2` followed by `mma...f16.f16` is an
  upcast to f16 in registers. A compile-only GPU has no autotuner, so XLA gives every GEMM one
  fixed small fallback tile; what a real H100 would run is one of the autotuner's candidates, so
  two more variants are compiled: a Triton tile as the autotuner picks for large GEMMs
  (`TRITON_TILE`, forced with `xla_gpu_override_gemm_autotuner`) and the cuBLAS path
  (`xla_gpu_enable_triton_gemm=false`). Which one the autotuner picks is decided on the device.

Everything here is compiler output, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qurl_jax.parallel import targets
from qurl_jax.quant import fp8_block_linear, get_recipe, requantize, rollout_dot_general

PRODUCTS = ("bf16", "int8_rollout", "fp8_rollout", "fp8_block_forward", "fp8_block_dgrad",
            "fp8_block_wgrad")
DEFAULT_SHAPE = (256, 1536, 8960)  # tokens x hidden -> MLP width of DeepSeek-R1-Distill-Qwen-1.5B
LINEAR_DN = (((1,), (0,)), ((), ()))

# A tile the GEMM autotuner picks for large GEMMs on an H100 (TritonGemmConfig text proto).
TRITON_TILE = ("block_m: 128 block_n: 128 block_k: 64 split_k: 1 num_stages: 4 num_warps: 8 "
               "num_ctas: 1")
GPU_VARIANTS: dict[str, dict[str, Any]] = {
    "fallback": {},  # what a compile-only GPU gives: XLA's fixed tile, no autotuning
    "triton": {"xla_gpu_override_gemm_autotuner": TRITON_TILE},
    "cublas": {"xla_gpu_enable_triton_gemm": False},
}

_TPU_MXU = re.compile(r"\b(vmatmul[.a-z0-9]*?\.(s8|s4|u8|bf16|f16|f32|f8[a-z0-9]*))\.")
_TPU_UNPACK = re.compile(r"\bvunpack\.[a-z.0-9]*?(f8[a-z0-9]*|s8|s4)\b")
_PTX = re.compile(r"\b(wgmma\.mma_async[.a-z0-9_]*|mma\.sync[.a-z0-9_]*|"
                  r"cvt\.rn\.f16x2\.e4m3x2)")  # the last: e4m3 codes widened to f16
_HLO_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_HLO_MATMUL = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.+?) "
                         r"(dot|convolution|custom-call)\(([^)]*)\)(.*)$")


@dataclasses.dataclass(frozen=True)
class Product:
    """One product as a jittable function of abstract arguments; `low` is the element type its
    GEMM should take ('s8', 'f8e4m3fn', or 'bf16' for the reference)."""

    name: str
    fn: Callable[..., Any]
    args: tuple[jax.ShapeDtypeStruct, ...]
    low: str


def _rollout_kernel(recipe: str, k: int, n: int) -> Any:
    r = get_recipe(recipe).replace(layers=("up_proj",))
    w = jax.ShapeDtypeStruct((k, n), jnp.float32)
    tree = jax.eval_shape(lambda w: requantize({"mlp": {"up_proj": {"kernel": w}}}, r), w)
    return tree["mlp"]["up_proj"]["kernel"]


def build_product(name: str, shape: tuple[int, int, int] = DEFAULT_SHAPE) -> Product:
    """The product `name` (see `PRODUCTS`) at x[M, K] @ w[K, N], as abstract arguments."""
    m, k, n = shape
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    if name == "bf16":
        w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
        return Product(name, lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32),
                       (x, w), "bf16")
    if name in ("int8_rollout", "fp8_rollout"):
        q = _rollout_kernel(name.split("_")[0], k, n)
        return Product(name, lambda x, q: rollout_dot_general(x, q, LINEAR_DN), (x, q),
                       "s8" if name == "int8_rollout" else "f8e4m3fn")
    w = jax.ShapeDtypeStruct((k, n), jnp.float32)
    dy = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    if name == "fp8_block_forward":
        return Product(name, fp8_block_linear, (x, w), "f8e4m3fn")
    if name in ("fp8_block_dgrad", "fp8_block_wgrad"):
        wanted = 0 if name == "fp8_block_dgrad" else 1

        def grad(x: jax.Array, w: jax.Array, dy: jax.Array) -> jax.Array:
            _, vjp = jax.vjp(fp8_block_linear, x, w)
            return vjp(dy)[wanted]

        return Product(name, grad, (x, w, dy), "f8e4m3fn")
    raise ValueError(f"product {name!r}: expected one of {', '.join(PRODUCTS)}")


def tpu_dump_args(dump_dir: str) -> str:
    """LIBTPU_INIT_ARGS that make libtpu write each program's final LLO bundles to dump_dir."""
    return (f"--xla_jf_dump_to={dump_dir} --xla_jf_dump_llo_text=true "
            "--xla_jf_dump_llo_pass_label_regex=final_bundles")


def _on_device(args: tuple[Any, ...], device: jax.Device) -> tuple[Any, ...]:
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)


def hlo_matmuls(hlo: str) -> list[str]:
    """The matrix products of an optimized HLO module, one line each: 'dot f8e4m3fn[64,256] x
    f8e4m3fn[256,512] -> f32[64,512]' (operand types looked up by name), or the custom call's
    target for library GEMMs."""
    types = {}
    for line in hlo.splitlines():
        m = _HLO_DEF.match(line)
        if m:
            types[m.group(1)] = f"{m.group(2)}[{m.group(3)}]"
    out = []
    for line in hlo.splitlines():
        m = _HLO_MATMUL.match(line)
        if not m:
            continue
        result, op, operands, rest = m.groups()
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        if op == "custom-call" and not (target and ("blas" in target.group(1)
                                                    or "matmul" in target.group(1))):
            continue
        names = [a.strip().lstrip("%") for a in operands.split(",") if a.strip()]
        shape = re.search(r"\w+\[[\d,]*\]", result).group(0)  # a library call's first output
        what = target.group(1) if op == "custom-call" else op
        ins = " x ".join(types.get(a, a) for a in names[:2])
        precision = re.search(r'"operand_precision":\[([^\]]*)\]', rest)
        note = f" (precision {precision.group(1)})" if precision else ""
        out.append(f"{what} {ins} -> {shape}{note}".replace('"', ""))
    return out


def tpu_instructions(dump_dir: str, before: set[str]) -> collections.Counter:
    """MXU matmul and unpack instructions (by operand type) in the LLO bundles written to
    dump_dir since `before` (the file names present before the compile)."""
    count: collections.Counter = collections.Counter()
    for path in glob.glob(os.path.join(dump_dir, "*final_bundles.txt")):
        if os.path.basename(path) in before or "schedule-analysis" in path:
            continue
        text = open(path).read()
        count.update(f"vmatmul {m.group(2)}" for m in _TPU_MXU.finditer(text))
        count.update(f"vunpack {m.group(1)}" for m in _TPU_UNPACK.finditer(text))
    return count


def ptx_instructions(dump_dir: str) -> collections.Counter:
    """Tensor-core MMA and e4m3 convert instructions in the PTX files of dump_dir."""
    count: collections.Counter = collections.Counter()
    for path in glob.glob(os.path.join(dump_dir, "*.ptx")):
        count.update(_PTX.findall(open(path).read()))
    return count


def verdict(platform: str, low: str, matmuls: list[str], instrs: collections.Counter) -> str:
    """'native', or what the product is upcast to, from the compiler output (see module doc)."""
    if platform == "tpu":
        kinds = {k.split()[1] for k in instrs if k.startswith("vmatmul")}
        want = {"s8": "s8", "f8e4m3fn": "f8", "bf16": "bf16"}[low]
        if any(k.startswith(want) for k in kinds):
            return "native"
        unpack = sorted(k.split()[1] for k in instrs if k.startswith("vunpack"))
        via = f" (codes widened by vunpack {', '.join(unpack)})" if unpack else ""
        return f"upcast: MXU runs {'/'.join(sorted(kinds)) or 'no matmul'}{via}"
    ptx_low = {"s8": ".s8.s8", "f8e4m3fn": ".e4m3.e4m3", "bf16": ".bf16.bf16"}[low]
    if any(ptx_low in k for k in instrs if "mma" in k):
        return "native"
    libs = [m.split()[0] for m in matmuls if m.startswith("__cublas")]
    if libs:
        lib_low = {"s8": "s8[", "f8e4m3fn": "f8e4m3fn[", "bf16": "bf16["}[low]
        lib = [m for m in matmuls if m.startswith("__cublas")]
        return ("native (library GEMM " + ", ".join(sorted(set(libs))) + ")"
                if all(m.split()[1].startswith(lib_low) for m in lib)
                else "upcast before the library GEMM")
    mma = sorted({k for k in instrs if "mma" in k})
    cvt = any(k.startswith("cvt") for k in instrs)
    return ("upcast" + (" in registers (cvt e4m3 -> f16)" if cvt else "")
            + (f": {', '.join(mma)}" if mma else ""))


def inspect_product(target: targets.Target, name: str,
                    shape: tuple[int, int, int] = DEFAULT_SHAPE,
                    tpu_dump_dir: str | None = None) -> list[dict[str, Any]]:
    """Compiles product `name` for one device of `target` and reads it (see module docstring).

    For a TPU target, libtpu must have been started with `tpu_dump_args(tpu_dump_dir)`. Returns
    one record per compiled variant (TPU: one; GPU: `GPU_VARIANTS`): target, product, variant,
    matmuls (HLO lines), instructions (counts), verdict.
    """
    product = build_product(name, shape)
    device = target.devices()[0]
    args = _on_device(product.args, device)
    lowered = jax.jit(product.fn).lower(*args)
    records = []
    if target.platform == "tpu":
        if tpu_dump_dir is None:
            raise ValueError("inspect_product: a TPU target needs tpu_dump_dir (see tpu_dump_args)")
        before = set(os.listdir(tpu_dump_dir)) if os.path.isdir(tpu_dump_dir) else set()
        compiled = lowered.compile()
        variants = [("libtpu", compiled, tpu_instructions(tpu_dump_dir, before))]
    else:
        variants = []
        for variant, options in GPU_VARIANTS.items():
            with tempfile.TemporaryDirectory() as d:
                compiled = lowered.compile(compiler_options={"xla_dump_to": d, **options})
                variants.append((variant, compiled, ptx_instructions(d)))
    for variant, compiled, instrs in variants:
        matmuls = hlo_matmuls(compiled.as_text())
        records.append({
            "target": target.name, "device_kind": device.device_kind, "product": name,
            "shape": list(shape), "variant": variant, "matmuls": matmuls,
            "instructions": dict(sorted(instrs.items())),
            "verdict": verdict(target.platform, product.low, matmuls, instrs),
        })
    return records


def markdown_table(records: list[dict[str, Any]]) -> str:
    """One row per product, one column per target (and GPU variant): the verdict."""
    columns = []
    for r in records:
        col = r["target"] if r["variant"] == "libtpu" else f"{r['target']} ({r['variant']})"
        if col not in columns:
            columns.append(col)
    cell = {}
    for r in records:
        col = r["target"] if r["variant"] == "libtpu" else f"{r['target']} ({r['variant']})"
        cell[(r["product"], col)] = r["verdict"]
    names = [p for p in PRODUCTS if any(r["product"] == p for r in records)]
    lines = ["| product | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for p in names:
        lines.append(f"| {p} | " + " | ".join(cell.get((p, c), "") for c in columns) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="tpu:v5p-8, tpu:v6e-4, tpu:v5e-4, gpu:h100-1, ...")
    p.add_argument("--products", default=",".join(PRODUCTS))
    p.add_argument("--shape", default=",".join(map(str, DEFAULT_SHAPE)), help="M,K,N")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--table", nargs="+", metavar="JSON",
                   help="print the markdown table of these record files and exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.table:
        records = [r for path in args.table for r in json.load(open(path))]
        print(markdown_table(records))
        return
    try:
        target = targets.parse(args.target or "")
    except targets.TargetError as e:
        sys.exit(str(e))
    if target.platform == "cpu":
        sys.exit("--target: native_products reads accelerator compilers' output; name a tpu: or "
                 "gpu: target")
    shape = tuple(int(s) for s in args.shape.split(","))
    if len(shape) != 3:
        sys.exit(f"--shape={args.shape}: expected M,K,N")
    targets.use_cpu_unless_accelerator_attached()
    with tempfile.TemporaryDirectory() as dump_dir:
        if target.platform == "tpu":
            os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " "
                                              + tpu_dump_args(dump_dir)).strip()
        records = []
        for name in args.products.split(","):
            for record in inspect_product(target, name, shape, dump_dir):
                records.append(record)
                print(f"{record['target']} {record['variant']:8s} {name:18s} {record['verdict']}",
                      flush=True)
                for line in record["matmuls"]:
                    print(f"    {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
