"""Attention implementations: blockwise == dense (forward and gradients), cuDNN == dense on a GPU,
the dispatcher, the model switch (`ModelConfig.attention`), and that the switch never reaches a
Hugging Face config. Comparisons run in the run's `precision.dtype` (float32 in the default suite,
bfloat16 under the accelerator runner) with the tolerances of tests/tolerances.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.models import KVCache, ModelConfig, Transformer, hf, init_params
from qurl_jax.models import attention as attn_lib
from qurl_jax.parallel import targets


def _inputs(seed: int, b: int, t: int, s: int, h: int, hkv: int, d: int):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32)
    return q, k, v, rng


def _left_padded(lengths: list[int], t: int) -> tuple[jax.Array, jax.Array]:
    """(positions i32[B, T], mask bool[B, T]) of left-padded rows; length 0 = an empty row."""
    mask = np.arange(t)[None] >= (t - np.asarray(lengths))[:, None]
    return jnp.asarray(np.maximum(np.cumsum(mask, 1) - 1, 0), jnp.int32), jnp.asarray(mask)


def _compare(q, k, v, q_pos, k_pos, k_valid, cotangent_seed, fn, precision, name):
    """`fn` vs dense on q, k, v in the compute dtype: outputs and gradients of <out, w> on rows
    that see some key, within tolerance `name`; no NaN."""
    q, k, v = (x.astype(precision.dtype) for x in (q, k, v))
    seen = attn_lib.allowed_mask(q_pos, k_pos, k_valid).any(-1)[:, :, None, None]  # [B, T, 1, 1]
    w = jnp.asarray(np.random.default_rng(cotangent_seed).normal(size=q.shape), jnp.float32) * seen
    outs, grads = [], []
    for f in (attn_lib.dot_product_attention, fn):
        loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v, q_pos, k_pos, k_valid) * w)  # noqa: E731
        outs.append(jax.jit(f)(q, k, v, q_pos, k_pos, k_valid))
        grads.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    assert outs[1].dtype == q.dtype and np.isfinite(np.asarray(outs[1], np.float32)).all()
    precision.assert_close(outs[1] * seen, outs[0] * seen, name, "output")
    for arg, dense_g, other_g in zip("qkv", grads[0], grads[1], strict=True):
        assert np.isfinite(np.asarray(other_g, np.float32)).all()
        precision.assert_close(other_g, dense_g, name, f"d/d{arg}")


def _blockwise(block_q: int, block_k: int):
    return lambda *a: attn_lib.blockwise_attention(*a, block_q=block_q, block_k=block_k)


@pytest.mark.parametrize("h,hkv,block_q,block_k", [(6, 2, 8, 16), (4, 4, 16, 8), (4, 1, 64, 64)])
def test_blockwise_matches_dense_left_padded(h, hkv, block_q, block_k, precision):
    # 37 positions: no block size divides it; row 2 is empty (every query fully masked), row 1 is
    # left-padded, so its pad queries (position 0) see only its first real token.
    t = 37
    q, k, v, _ = _inputs(0, 3, t, t, h, hkv, 8)
    pos, mask = _left_padded([37, 20, 0], t)
    _compare(q, k, v, pos, pos, mask, 1, _blockwise(block_q, block_k), precision,
             "attention.blockwise_vs_dense")


def test_blockwise_matches_dense_against_a_cache_with_holes(precision):
    # Prefill-like: 5 queries at positions 9..13 against a 29-slot cache that holds an arbitrary
    # subset of the past (a compressed cache) in shuffled slot order, plus empty slots.
    q, k, v, rng = _inputs(2, 2, 5, 29, 4, 2, 8)
    k_pos = jnp.asarray(np.stack([rng.permutation(29) for _ in range(2)]), jnp.int32)
    k_valid = jnp.asarray(rng.random((2, 29)) < 0.6)
    q_pos = jnp.broadcast_to(jnp.arange(9, 14, dtype=jnp.int32), (2, 5))
    _compare(q, k, v, q_pos, k_pos, k_valid, 3, _blockwise(4, 8), precision,
             "attention.blockwise_vs_dense")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention runs on a GPU only")
@pytest.mark.parametrize("h,hkv,lengths", [(4, 2, [40, 33]), (8, 1, [64, 1])])
def test_cudnn_matches_dense_left_padded(h, hkv, lengths):
    """cuDNN flash attention (bf16 only, whatever the run's dtype) on left-padded rows: same
    outputs and gradients as dense wherever a query sees a key (head size 64: cuDNN's)."""
    from tests.tolerances import Precision

    t = max(lengths)
    q, k, v, _ = _inputs(5, len(lengths), t, t, h, hkv, 64)
    pos, mask = _left_padded(lengths, t)
    _compare(q, k, v, pos, pos, mask, 6, attn_lib.cudnn_attention, Precision("bfloat16"),
             "attention.cudnn_vs_dense")


def test_blockwise_in_bfloat16_stays_close_to_float32():
    q, k, v, _ = _inputs(4, 2, 40, 40, 4, 2, 16)
    pos, mask = _left_padded([40, 33], 40)
    ref = attn_lib.dot_product_attention(q, k, v, pos, pos, mask)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = attn_lib.blockwise_attention(*bf, pos, pos, mask, block_q=16, block_k=16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2)


def test_auto_picks_dense_for_short_sequences_and_decode_steps():
    resolve, impl = attn_lib.resolve_implementation, attn_lib.Implementation
    big = attn_lib.AUTO_BLOCKWISE_MIN_KEYS + 1
    assert resolve("auto", 64, 64) is impl.DENSE
    assert resolve("auto", 1, 100 * big) is impl.DENSE  # a decode step's scores are only [1, S]
    assert resolve("auto", 2, big) is impl.BLOCKWISE
    assert resolve("dense", 2, big) is impl.DENSE
    with pytest.raises(ValueError, match="blockwse"):
        resolve("blockwse", 2, 2)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the non-GPU error")
@pytest.mark.skipif(targets.compiler_installed("gpu"), reason="checks the error without JAX's "
                    "CUDA plugin; with it (the gpu-compile extra) the model lowers for an H100")
def test_cudnn_without_a_gpu_names_the_field():
    q, k, v, _ = _inputs(0, 1, 4, 4, 2, 1, 8)
    pos, mask = _left_padded([4], 4)
    with pytest.raises(ValueError, match="ModelConfig.attention='cudnn' needs a GPU"):
        attn_lib.attention(q, k, v, pos, pos, mask, "cudnn")


CFG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)


@pytest.mark.parametrize("other", [
    "blockwise",
    pytest.param("cudnn", marks=pytest.mark.skipif(jax.default_backend() != "gpu",
                                                   reason="cuDNN attention runs on a GPU only")),
])
def test_model_switch_gives_the_same_logits_with_and_without_a_cache(other, precision):
    if other == "cudnn" and precision.is_float32:
        pytest.skip("cuDNN attention takes bf16/fp16 only; run with --dtype bfloat16")
    cfg = CFG.replace(dtype=precision.dtype)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 21)), jnp.int32)
    pos, mask = _left_padded([21, 13], 21)

    def run(attention: str):
        apply = jax.jit(Transformer(cfg.replace(attention=attention)).apply,
                        static_argnames="last_only")
        full, _ = apply({"params": params}, tokens, pos, mask)
        cache = KVCache.zeros(cfg, 2, 30)
        last, _ = apply({"params": params}, tokens, pos, mask, cache=cache, last_only=True)
        return full, last

    # Blockwise with the library's block size would be one block here; blockwise_attention's
    # multi-block path is covered above, this checks the model routes the switch to both callers.
    dense, switched = run("dense"), run(other)
    name = "attention.model_switch"
    precision.assert_close(switched[0] * mask[..., None], dense[0] * mask[..., None], name, "full")
    precision.assert_close(switched[1], dense[1], name, "last position through the cache")


def test_attention_field_is_validated_and_never_exported(tmp_path):
    with pytest.raises(ValueError, match="ModelConfig.attention='flash'"):
        CFG.replace(attention="flash").validate()
    config = CFG.replace(attention="blockwise")
    hf.save_hf(tmp_path, config, init_params(CFG, jax.random.key(0)))
    with open(tmp_path / "config.json") as f:
        assert "attention" not in json.load(f)
    loaded, _ = hf.load_hf(tmp_path)
    assert loaded.attention == "auto"
