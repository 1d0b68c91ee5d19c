"""bench.native_products: what the quantized products compile to on TPUs and an H100.

The compile tests need the chip's compiler (the CUDA plugin for H100, libtpu for TPU; `pip install
-e .[gpu-compile]` / `.[tpu-compile]`) and skip without it; the parsers run everywhere.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys

import pytest

from qurl_jax.bench import native_products as nat
from tests.compile_only import compiler_or_skip

SMALL = (64, 256, 512)  # M, K, N: two 128-wide groups, compiles in seconds


def _element_types(matmul: str) -> tuple[str, ...]:
    """('f8e4m3fn', 'f8e4m3fn', 'f32') from 'dot f8e4m3fn[64,256] x f8e4m3fn[256,512] ->
    f32[64,512]' (shapes vary: XLA may split K into a batch dimension)."""
    return tuple(re.findall(r"(\w+)\[[\d,]*\]", matmul.split(" (precision")[0]))


def test_hlo_matmuls_reads_operand_types_and_library_calls() -> None:
    hlo = "\n".join([
        "  %p0 = f8e4m3fn[64,256]{1,0} parameter(0)",
        "  %t.1 = f8e4m3fn[256,512]{0,1} transpose(%p1), dimensions={1,0}",
        "  ROOT %dot.1 = f32[64,512]{1,0} dot(%p0, %t.1), lhs_contracting_dims={1}",
        '  %g = (f32[64,512]{1,0}, s8[4096]{0}) custom-call(%p0, %t.1, %c, %c), '
        'custom_call_target="__cublas$lt$matmul$f8", backend_config={"precision_config":'
        '{"operand_precision":["DEFAULT","DEFAULT"]}}',
        '  %other = f32[8]{0} custom-call(%p0), custom_call_target="Sharding"',
    ])
    assert nat.hlo_matmuls(hlo) == [
        "dot f8e4m3fn[64,256] x f8e4m3fn[256,512] -> f32[64,512]",
        "__cublas$lt$matmul$f8 f8e4m3fn[64,256] x f8e4m3fn[256,512] -> f32[64,512] "
        "(precision DEFAULT,DEFAULT)",
    ]


def test_verdicts_from_instructions() -> None:
    c = collections.Counter
    assert nat.verdict("tpu", "s8", [], c({"vmatmul s8": 4})) == "native"
    assert nat.verdict("tpu", "f8e4m3fn", [], c({"vmatmul f32": 4, "vunpack f8e4m3b11": 8})) == (
        "upcast: MXU runs f32 (codes widened by vunpack f8e4m3b11)")
    wgmma = "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"
    assert nat.verdict("gpu", "f8e4m3fn", [], c({wgmma: 2})) == "native"
    mma16 = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    assert nat.verdict("gpu", "f8e4m3fn", [], c({mma16: 1, "cvt.rn.f16x2.e4m3x2": 6})) == (
        f"upcast in registers (cvt e4m3 -> f16): {mma16}")
    lib = ["__cublas$lt$matmul$f8 f8e4m3fn[64,256] x f8e4m3fn[256,512] -> f32[64,512]"]
    assert nat.verdict("gpu", "f8e4m3fn", lib, c()).startswith("native (library GEMM")


def test_unknown_product_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="fp8_block_wgrad"):
        nat.build_product("fp4_rollout")


def test_h100_fp8_rollout_product_reaches_the_gemm_as_f8_with_f32_accumulation() -> None:
    """On an H100 the fp8 rollout product's GEMM takes the E4M3 codes themselves (quantized, with
    the activation scale applied, before the GEMM) and returns float32; the per-token x
    per-channel scales come after it. With a tile the autotuner uses for large GEMMs it is an FP8
    tensor-core instruction (wgmma e4m3 x e4m3 -> f32), through cuBLAS the FP8 cuBLASLt call."""
    target = compiler_or_skip("gpu:h100-1")
    records = {r["variant"]: r for r in nat.inspect_product(target, "fp8_rollout", SMALL)}
    assert set(records) == set(nat.GPU_VARIANTS)
    for r in records.values():
        assert len(r["matmuls"]) == 1, r
        assert _element_types(r["matmuls"][0]) == ("f8e4m3fn", "f8e4m3fn", "f32"), r
    assert records["triton"]["verdict"] == "native"
    assert any(".f32.e4m3.e4m3" in k for k in records["triton"]["instructions"])
    assert records["cublas"]["matmuls"][0].startswith("__cublas$lt$matmul$f8 ")


def test_h100_int8_rollout_product_is_an_int8_tensor_core_gemm() -> None:
    target = compiler_or_skip("gpu:h100-1")
    for r in nat.inspect_product(target, "int8_rollout", SMALL):
        assert _element_types(r["matmuls"][0]) == ("s8", "s8", "s32"), r
        assert r["verdict"].startswith("native"), r


@pytest.mark.parametrize("product", ["fp8_block_forward", "fp8_block_dgrad", "fp8_block_wgrad"])
def test_h100_fp8_block_training_gemms_take_fp8_operands(product: str) -> None:
    """Jet-RL's three FP8 GEMMs reach the H100's GEMM as e4m3 x e4m3 -> f32, never upcast first."""
    target = compiler_or_skip("gpu:h100-1")
    for r in nat.inspect_product(target, product, SMALL):
        assert r["matmuls"], r
        for line in r["matmuls"]:
            assert _element_types(line) == ("f8e4m3fn", "f8e4m3fn", "f32"), r
        if r["variant"] != "fallback":
            assert r["verdict"].startswith("native"), r


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tpu:v5p-8", "tpu:v6e-4", "tpu:v5e-4"])
def test_tpu_cli_reads_the_mxu_instructions(target: str, tmp_path) -> None:
    """The CLI on a TPU target (its own process: libtpu's dump flags are read at start): int8 runs
    on the int8 MXU path (`vmatmul.s8`), the bf16 reference on bf16."""
    pytest.importorskip("libtpu", reason="libtpu not installed (pip install -e .[tpu-compile])")
    out = tmp_path / "records.json"
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    shape = ",".join(map(str, SMALL))
    subprocess.run([sys.executable, "-m", "qurl_jax.bench.native_products", f"--target={target}",
                    "--products=bf16,int8_rollout,fp8_rollout", f"--shape={shape}",
                    f"--json={out}"], check=True, env=env, capture_output=True, timeout=600)
    records = {r["product"]: r for r in json.loads(out.read_text())}
    assert records["bf16"]["verdict"] == "native"
    assert records["int8_rollout"]["verdict"] == "native"
    assert records["int8_rollout"]["instructions"].get("vmatmul s8", 0) > 0
    assert "vmatmul f32" in records["fp8_rollout"]["instructions"] or \
        records["fp8_rollout"]["verdict"] == "native"
