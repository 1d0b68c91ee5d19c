"""The int8 matmul kernel (qurl_jax.quant._cpu_kernel): exact integer results on every tile/tail
shape on each of its paths (AVX512-VNNI and AVX2; the AVX2 one runs on an AVX512 CPU too), which
path a process takes (`QURL_JAX_CPU_ISA`), dispatch rules, and that the int8 rollout model gives
the same logits and tokens with and without it."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.models import ModelConfig, Transformer, init_params
from qurl_jax.quant import _cpu_kernel, pack_for_decode, requantize, rollout_dot_general
from qurl_jax.sampling import Sampler, SamplingParams

LINEAR = (((1,), (0,)), ((), ()))

requires_kernel = pytest.mark.skipif(
    not _cpu_kernel.kernel_available(),
    reason="the int8 kernel needs an x86 CPU with AVX2 and a C++ compiler",
)
# The kernel's paths this CPU runs (an AVX512-VNNI CPU runs both), best first.
PATHS = ["avx512", "avx2"][["avx512", "avx2", ""].index(_cpu_kernel.kernel_isa()):2]


def _int8(rng: np.random.Generator, shape: tuple[int, ...]) -> jax.Array:
    return jnp.asarray(rng.integers(-128, 128, shape), jnp.int8)


def _reference(x: jax.Array, w: jax.Array) -> np.ndarray:
    return np.asarray(x, np.int64) @ np.asarray(w, np.int64)


@requires_kernel
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize(
    "m,k,n",
    [(1, 4, 1), (1, 5, 3), (2, 768, 2048), (3, 7, 65), (6, 130, 200), (7, 64, 64), (8, 768, 128),
     (13, 2048, 70), (16, 1, 129), (64, 300, 191),
     (16, 768, 2048)],  # the last is large enough to be shared with the thread pool
)
def test_kernel_matches_integer_reference(m: int, k: int, n: int, isa: str) -> None:
    rng = np.random.default_rng(m * 1000 + k + n)
    x, w = _int8(rng, (m, k)), _int8(rng, (k, n))
    got = jax.jit(functools.partial(_cpu_kernel._kernel_product, isa=isa))(x, w)
    assert got.dtype == jnp.int32 and got.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(got), _reference(x, w))


@requires_kernel
@pytest.mark.parametrize("isa", PATHS)
def test_kernel_extreme_codes(isa: str) -> None:
    # -128 and 127 everywhere: the largest magnitudes of the u8 shift and of the column sums
    # (and on AVX2 of the 16-bit pair sums, 2 x 255 x 128, which vpmaddubsw would saturate).
    product = jax.jit(functools.partial(_cpu_kernel._kernel_product, isa=isa))
    for xv, wv in [(-128, -128), (-128, 127), (127, -128), (127, 127)]:
        x = jnp.full((5, 1000), xv, jnp.int8)
        w = jnp.full((1000, 77), wv, jnp.int8)
        np.testing.assert_array_equal(np.asarray(product(x, w)), _reference(x, w))


@requires_kernel
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("k,n", [(4, 64), (768, 2048), (132, 192), (2048, 128), (2048, 2048)])
def test_pack_matches_reference_layout_and_packed_product_is_exact(k: int, n: int,
                                                                   isa: str) -> None:
    rng = np.random.default_rng(k + n)
    w = _int8(rng, (k, n))
    packed = jax.jit(functools.partial(_cpu_kernel.pack_int8, isa=isa))(w)
    np.testing.assert_array_equal(np.asarray(packed),
                                  np.asarray(jax.jit(_cpu_kernel.pack_int8_reference)(w)))
    # The layout's definition, element by element for a few entries.
    p6 = np.asarray(packed).reshape(n // 64, k // 4, 4, 4, 4, 4)  # [t, kg, j, L, i, r]
    for t, kg, j, lane, i, r in [(0, 0, 0, 0, 0, 0), (n // 64 - 1, k // 4 - 1, 3, 3, 3, 3),
                                 (0, k // 4 - 1, 1, 2, 3, 1)]:
        expect = int(np.asarray(w)[4 * kg + r, 64 * t + 16 * lane + 4 * j + i]) ^ 0x80
        assert (int(p6[t, kg, j, lane, i, r]) & 0xFF) == (expect & 0xFF)
    for m in (1, 8, 70):  # any number of rows, including more than MAX_ROWS
        x = _int8(rng, (m, k))
        got = jax.jit(lambda x, p: _cpu_kernel.packed_int8_dot_general(
            x, p, LINEAR, preferred_element_type=jnp.int32))(x, packed) if isa == PATHS[0] else \
            jax.jit(functools.partial(_cpu_kernel._kernel_product, packed=True, isa=isa))(x,
                                                                                     packed)
        np.testing.assert_array_equal(np.asarray(got), _reference(x, w))


def test_the_path_is_the_best_the_cpu_runs_under_the_cap() -> None:
    from qurl_jax.cpu_kernels import choose

    # level: what the library says this CPU runs (2 AVX512, 1 AVX2 only, 0 neither).
    assert [choose(level, "avx512") for level in (2, 1, 0)] == ["avx512", "avx2", ""]
    assert [choose(level, "avx2") for level in (2, 1, 0)] == ["avx2", "avx2", ""]
    assert [choose(level, "none") for level in (2, 1, 0)] == ["", "", ""]
    assert [choose(level, "amx") for level in (2, 1, 0)] == ["avx512", "avx2", ""]


@pytest.mark.parametrize("flags,cap,isa,rows", [
    ({"avx512f", "amx_tile", "amx_int8", "avx2", "fma"}, "amx", "amx", 16),
    ({"avx512f", "amx_tile", "amx_int8", "avx2", "fma"}, "avx512", "avx512", 64),
    ({"avx512f", "avx2", "fma"}, "amx", "avx512", 64),
    ({"avx2", "fma"}, "amx", "avx2", 64)])
def test_an_amx_cpu_leaves_products_of_more_than_16_rows_to_xla(monkeypatch, flags, cap, isa,
                                                                 rows) -> None:
    """Where XLA's int8 GEMM runs on AMX tiles the kernel takes at most `AMX_MAX_ROWS` rows;
    `QURL_JAX_CPU_ISA=avx512` takes an AVX512 CPU's choice on such a CPU."""
    from qurl_jax.runtime import xla_cpu

    monkeypatch.setattr(xla_cpu, "_cpu_flags", lambda: frozenset(flags))
    monkeypatch.setenv(xla_cpu.ISA_ENV, cap)
    assert xla_cpu.cpu_isa() == isa and _cpu_kernel.max_rows() == rows
    assert xla_cpu.has_avx512() == (isa != "avx2")


@pytest.mark.skipif("avx2" not in PATHS, reason="the CPU has no AVX2")
def test_qurl_jax_cpu_isa_avx2_takes_every_avx2_choice() -> None:
    """`QURL_JAX_CPU_ISA=avx2` (a fresh process: the choice is made once) runs the AVX2 paths of
    both kernels, in the compiled decode product too, and `train.cpu_dots='auto'` takes the
    AVX2 CPUs' choice; 'none' turns the kernels off; another value is refused by name."""
    code = ("import jax, jax.numpy as jnp\n"
            "from qurl_jax.quant import _cpu_kernel as k\n"
            "from qurl_jax.cpu_kernels import decode_attention as a\n"
            "from qurl_jax.runtime import xla_cpu\n"
            "f = jax.jit(lambda x, w: k.int8_dot_general(x, w, (((1,), (0,)), ((), ())), "
            "preferred_element_type=jnp.int32))\n"
            "text = f.lower(jnp.ones((8, 256), jnp.int8), jnp.ones((256, 256), jnp.int8))"
            ".as_text()\n"
            "print(k.kernel_isa() or '-', a.kernel_isa() or '-', xla_cpu.resolve('auto'), "
            "'qurl_int8_matmul_avx2' in text)")

    def run(value: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, JAX_PLATFORMS="cpu", QURL_JAX_CPU_ISA=value)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300)

    assert run("avx2").stdout.split() == ["avx2", "avx2", "learner", "True"]
    assert run("none").stdout.split() == ["-", "-", "learner", "False"]
    bad = run("avx3")
    assert bad.returncode != 0 and "QURL_JAX_CPU_ISA='avx3' must be one of" in bad.stderr


def test_packed_product_rejects_other_patterns() -> None:
    x, w = jnp.zeros((2, 64), jnp.int8), jnp.zeros((64, 64), jnp.int8)
    with pytest.raises(ValueError, match="packed_int8_dot_general"):
        _cpu_kernel.packed_int8_dot_general(x, w, (((1,), (1,)), ((), ())))
    with pytest.raises(ValueError, match="packed_int8_dot_general"):
        _cpu_kernel.packed_int8_dot_general(x.astype(jnp.float32), w, LINEAR)
    with pytest.raises(ValueError, match="N % 64"):
        _cpu_kernel.pack_int8_reference(jnp.zeros((64, 32), jnp.int8))


@requires_kernel
def test_kernel_is_in_the_compiled_program_only_for_decode_shapes() -> None:
    rng = np.random.default_rng(0)
    w = _int8(rng, (256, 256))
    f = jax.jit(lambda x, w: _cpu_kernel.int8_dot_general(x, w, LINEAR,
                                                          preferred_element_type=jnp.int32))
    decode = _int8(rng, (_cpu_kernel.max_rows(), 256))
    prefill = _int8(rng, (_cpu_kernel.max_rows() + 1, 256))
    assert "qurl_int8_matmul" in f.lower(decode, w).as_text()
    assert "qurl_int8_matmul" not in f.lower(prefill, w).as_text()
    small = _int8(rng, (256, 255))  # under MIN_KERNEL_ELEMENTS: XLA's dot
    assert "qurl_int8_matmul" not in f.lower(decode, small).as_text()
    for x, w_ in ((decode, w), (prefill, w), (decode, small)):
        np.testing.assert_array_equal(np.asarray(f(x, w_)), _reference(x, w_))


def test_int8_dot_general_falls_back_to_xla_for_other_products() -> None:
    rng = np.random.default_rng(1)
    # float operands, a transposed contraction, and batch dimensions all go to lax.dot_general.
    xf, wf = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32), jnp.ones((8, 3), jnp.float32)
    np.testing.assert_allclose(_cpu_kernel.int8_dot_general(xf, wf, LINEAR), xf @ wf, rtol=1e-6)
    x, wt = _int8(rng, (4, 8)), _int8(rng, (3, 8))
    out = _cpu_kernel.int8_dot_general(x, wt, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.int32)
    np.testing.assert_array_equal(np.asarray(out), _reference(x, wt.T))
    xb, wb = _int8(rng, (2, 4, 8)), _int8(rng, (2, 8, 3))
    out = _cpu_kernel.int8_dot_general(xb, wb, (((2,), (1,)), ((0,), (0,))),
                                       preferred_element_type=jnp.int32)
    np.testing.assert_array_equal(np.asarray(out),
                                  np.einsum("bmk,bkn->bmn", np.asarray(xb, np.int64),
                                            np.asarray(wb, np.int64)))


# q/o and the MLP kernels are large enough for the kernel (>= MIN_KERNEL_ELEMENTS); k/v are not.
CONFIG = ModelConfig(model_type="qwen2", vocab_size=97, hidden_size=256, intermediate_size=512,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, attention_bias=True,
                     tie_word_embeddings=False)


@requires_kernel
def test_int8_rollout_logits_identical_with_and_without_kernel(monkeypatch) -> None:
    config = CONFIG
    params = init_params(config, jax.random.key(0))
    rollout = requantize(params, "int8")
    model = Transformer(config, dot_general=rollout_dot_general)
    tokens = jax.random.randint(jax.random.key(1), (5, 3), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(3), (5, 3))

    def logits() -> jax.Array:
        program = jax.jit(lambda p, t: model.apply({"params": p}, t, positions)[0])
        assert ("qurl_int8_matmul" in program.lower(rollout, tokens).as_text()) == (
            _cpu_kernel.kernel_available())
        return program(rollout, tokens)

    with_kernel = logits()
    monkeypatch.setattr(_cpu_kernel, "kernel_available", lambda: False)
    np.testing.assert_array_equal(np.asarray(with_kernel), np.asarray(logits()))


@requires_kernel
def test_pack_for_decode_packs_only_what_the_kernel_reads() -> None:
    params = init_params(CONFIG, jax.random.key(0))
    for recipe, expect_packed in [("int8", True), ("int8_weight_only", False), ("fp8", False)]:
        packed = pack_for_decode(requantize(params, recipe))
        mlp = packed["layers_0"]["mlp"]
        attn = packed["layers_0"]["self_attn"]
        assert mlp["gate_proj"]["kernel"].packed is expect_packed
        assert mlp["down_proj"]["kernel"].packed is expect_packed
        assert attn["q_proj"]["kernel"].packed is expect_packed
        if expect_packed:  # k/v [256, 128] are under MIN_KERNEL_ELEMENTS: left as they are
            assert attn["k_proj"]["kernel"].packed is False
    rollout = pack_for_decode(requantize(params, "int8"))
    with pytest.raises(ValueError, match="packed"):
        rollout["layers_0"]["mlp"]["gate_proj"]["kernel"].dequantize()


def _amx_cpu(monkeypatch, rows: int, amx: bool = True) -> None:
    """This process as an AMX CPU whose kernel takes at most `rows` rows (`amx=False`: as an
    AVX512 CPU without AMX)."""
    from qurl_jax.runtime import xla_cpu

    monkeypatch.setattr(xla_cpu, "_cpu_flags", lambda: frozenset(
        {"avx512f", "avx2", "fma"} | ({"amx_tile", "amx_int8"} if amx else set())))
    monkeypatch.delenv(xla_cpu.ISA_ENV, raising=False)
    monkeypatch.setattr(_cpu_kernel, "AMX_MAX_ROWS", rows)


def test_an_amx_cpu_packs_only_the_decode_loops_of_the_rows_the_kernel_takes(monkeypatch) -> None:
    _amx_cpu(monkeypatch, 4, amx=False)
    assert _cpu_kernel.packs_for_decode(200)  # not AMX: packed at any rows
    _amx_cpu(monkeypatch, 4)
    assert _cpu_kernel.packs_for_decode(4) and not _cpu_kernel.packs_for_decode(5)


@requires_kernel
def test_an_amx_sampler_decodes_more_rows_than_the_kernel_takes_on_xla(monkeypatch) -> None:
    """On an AMX CPU a decode loop of more rows than `AMX_MAX_ROWS` keeps its codes unpacked and
    runs XLA's int8 product; the tokens and log-probs are the kernel's (integer products)."""
    params = requantize(init_params(CONFIG, jax.random.key(0)), "int8")
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]

    def sample() -> tuple[str, np.ndarray, np.ndarray]:
        sampler = Sampler(CONFIG, rollout_dot_general, max_prompt_len=8, max_new_tokens=12)
        program = sampler.lower_programs(jax.eval_shape(lambda: params), 6, 8, 16,
                                         n=2)["decode"].as_text()
        out = sampler.sample(params, prompts, SamplingParams(max_new_tokens=12, temperature=1.0),
                             key=jax.random.key(3), n=2)
        return program, np.asarray(out.tokens), np.asarray(out.logp)

    program, tokens, logp = sample()
    assert "qurl_int8_matmul_packed" in program
    _amx_cpu(monkeypatch, 4)  # 6 rows decode on XLA's product
    program, tokens_xla, logp_xla = sample()
    assert "qurl_int8_matmul" not in program
    np.testing.assert_array_equal(tokens, tokens_xla)
    np.testing.assert_array_equal(logp, logp_xla)


@requires_kernel
def test_int8_sampler_tokens_identical_with_and_without_kernel(monkeypatch) -> None:
    """The sampler's decode loop packs int8 kernels and runs the VNNI kernel; integer products
    are exact, so the sampled tokens and log-probs equal those of XLA's int8 path."""
    params = requantize(init_params(CONFIG, jax.random.key(0)), "int8")
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]

    def sample() -> tuple[np.ndarray, np.ndarray]:
        sampler = Sampler(CONFIG, rollout_dot_general, max_prompt_len=8, max_new_tokens=12)
        out = sampler.sample(params, prompts, SamplingParams(max_new_tokens=12, temperature=1.0),
                             key=jax.random.key(3), n=2)
        return np.asarray(out.tokens), np.asarray(out.logp)

    tokens, logp = sample()
    monkeypatch.setattr(_cpu_kernel, "kernel_available", lambda: False)
    tokens_xla, logp_xla = sample()
    np.testing.assert_array_equal(tokens, tokens_xla)
    np.testing.assert_array_equal(logp, logp_xla)


@pytest.mark.skipif(len(PATHS) < 2, reason="needs a CPU that runs both paths")
def test_int8_sampler_tokens_identical_on_both_paths(monkeypatch) -> None:
    """The sampler's decode loop on the AVX2 path (packed by the AVX2 pack) samples the tokens
    and log-probs of the AVX512 path: the same integers."""
    params = requantize(init_params(CONFIG, jax.random.key(0)), "int8")
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]

    def sample() -> tuple[np.ndarray, np.ndarray]:
        sampler = Sampler(CONFIG, rollout_dot_general, max_prompt_len=8, max_new_tokens=12)
        program = sampler.lower_programs(jax.eval_shape(lambda: params), 2, 8, 16,
                                         n=2)["decode"].as_text()
        suffix = "_avx2" if _cpu_kernel.kernel_isa() == "avx2" else ""
        assert f"qurl_int8_matmul_packed{suffix}" in program
        assert ("_avx2" in program) == bool(suffix)
        packing = jax.jit(lambda p: pack_for_decode(p)).lower(params).as_text()  # per call
        assert f"qurl_int8_pack{suffix}" in packing and ("_avx2" in packing) == bool(suffix)
        out = sampler.sample(params, prompts, SamplingParams(max_new_tokens=12, temperature=1.0),
                             key=jax.random.key(3), n=2)
        return np.asarray(out.tokens), np.asarray(out.logp)

    tokens, logp = sample()
    monkeypatch.setattr(_cpu_kernel, "kernel_isa", lambda: "avx2")
    tokens_avx2, logp_avx2 = sample()
    np.testing.assert_array_equal(tokens, tokens_avx2)
    np.testing.assert_array_equal(logp, logp_avx2)


@requires_kernel
def test_accelerator_lowering_has_no_cpu_kernel() -> None:
    """The kernel sits behind lax.platform_dependent: lowering the same function for CUDA emits
    XLA's dot only (the accelerator path is unchanged)."""
    from jax import export

    x, w = jnp.ones((8, 256), jnp.int8), jnp.ones((256, 256), jnp.int8)
    f = jax.jit(lambda x, w: _cpu_kernel.int8_dot_general(x, w, LINEAR,
                                                          preferred_element_type=jnp.int32))
    unchecked = [export.DisabledSafetyCheck.custom_call(name) for name in
                 ("qurl_int8_matmul", "qurl_int8_matmul_packed")]
    for platforms, has_kernel in ((["cpu"], True), (["cuda"], False)):
        module = export.export(f, platforms=platforms, disabled_checks=unchecked)(x, w)
        assert ("qurl_int8_matmul" in module.mlir_module()) is has_kernel
