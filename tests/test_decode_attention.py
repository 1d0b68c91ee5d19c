"""Ragged decode attention (`qurl_jax.models.decode_attention`): every implementation against a
float64 reference, the Pallas kernels in Pallas' interpreter on the host.

Tolerances (max abs error against float64 math on the same inputs, unit-variance q, k, v):
- float32: XLA, the CPU kernel and the GPU kernels agree to 2e-6 (summation order only);
  the TPU paged kernel runs its products at the TPU's default precision (one bf16 pass, on the
  interpreter too), so it is held to the bf16 bound.
- bfloat16 inputs: 2e-2 (bf16 scores, probabilities and partial outputs; measured ~5e-3).
"""

from __future__ import annotations

import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.cpu_kernels import decode_attention as cpu_decode
from qurl_jax.models import KVCache, ModelConfig, Transformer, init_params
from qurl_jax.models import decode_attention as da

# The GPU kernels run compiled on a GPU (the accelerator runner), in Pallas' interpreter elsewhere.
INTERPRET_GPU_KERNELS = jax.default_backend() != "gpu"

F32_TOL = 2e-6
BF16_TOL = 2e-2
TOL = {jnp.float32: F32_TOL, jnp.bfloat16: BF16_TOL}


def reference(q, k, v, starts, lengths) -> np.ndarray:
    """float64: q [B, H, D], k, v [B, Hkv, S, D]; row r attends to slots [starts[r], lengths[r])."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    b, h, d = q.shape
    g = h // k.shape[1]
    out = np.zeros((b, h, d))
    for r in range(b):
        if lengths[r] <= starts[r]:
            continue
        window = slice(starts[r], lengths[r])
        for head in range(h):
            s = k[r, head // g, window] @ q[r, head] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[r, head] = (p / p.sum()) @ v[r, head // g, window]
    return out


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


# Rows: one token, exactly one 16-token page, one past a page boundary, a full cache, a window
# starting after 3 left-pad slots, an empty row.
LENGTHS = np.array([1, 16, 17, 64, 20, 0], np.int32)
STARTS = np.array([0, 0, 0, 0, 3, 0], np.int32)
B, H, HKV, D, S, PAGE = 6, 4, 2, 32, 64, 16


def _dense_case(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (_normal(rng, (B, H, D), dtype), _normal(rng, (B, HKV, S, D), dtype),
            _normal(rng, (B, HKV, S, D), dtype))


@pytest.mark.parametrize("dtype,impl,kwargs", [
    (jnp.float32, "xla", {}),
    (jnp.float32, "pallas", {"interpret": INTERPRET_GPU_KERNELS}),
    (jnp.float32, "cpu", {}),
    (jnp.bfloat16, "xla", {}),
    (jnp.bfloat16, "pallas", {"interpret": INTERPRET_GPU_KERNELS}),
])
def test_dense_matches_reference(dtype, impl, kwargs):
    if impl == "cpu" and not cpu_decode.available():
        pytest.skip("CPU decode attention kernel not available here")
    if impl == "cpu" and jax.default_backend() != "cpu":
        pytest.skip("the CPU decode attention kernel runs where JAX's backend is the CPU")
    q, k, v = _dense_case(dtype)
    fn = jax.jit(lambda q, k, v, n, s: da.decode_attention(q, k, v, n, s, impl=impl, **kwargs))
    out = fn(q, k, v, LENGTHS, STARTS)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = np.abs(np.asarray(out, np.float64) - reference(q, k, v, STARTS, LENGTHS))
    assert err.max() < TOL[dtype], err.max(axis=(1, 2))
    assert not np.asarray(out[LENGTHS == 0]).any()  # the empty row is zeros


def _paged_case(dtype, seed=1):
    """A pool of 12 pages whose page table reuses pages: row 1 now owns page 7, row 3 pages 3 and
    11, which an earlier row filled; their contents past each row's length are stale."""
    rng = np.random.default_rng(seed)
    pages = 12
    table = np.array([[5, 0, 0, 0], [7, 0, 0, 0], [2, 6, 0, 0], [9, 1, 11, 3], [4, 10, 0, 0],
                      [0, 0, 0, 0]], np.int32)
    q = _normal(rng, (B, H, D), dtype)
    k_pages = _normal(rng, (HKV, pages, PAGE, D), dtype)
    v_pages = _normal(rng, (HKV, pages, PAGE, D), dtype)
    return q, k_pages, v_pages, table


def _live_page_mask(table, lengths, pages) -> np.ndarray:
    """bool[P, PAGE]: (page, offset) holds a live token of some row."""
    live = np.zeros((pages, PAGE), bool)
    for r, n in enumerate(lengths):
        for s in range(n):
            live[table[r, s // PAGE], s % PAGE] = True
    return live


PAGED_CASES = [
    (jnp.float32, "xla", {}),
    (jnp.float32, "pallas", {"interpret": INTERPRET_GPU_KERNELS}),  # the GPU kernel
    (jnp.float32, "pallas", {"interpret": True, "platform": "tpu"}),
    (jnp.bfloat16, "pallas", {"interpret": INTERPRET_GPU_KERNELS}),
    (jnp.bfloat16, "pallas", {"interpret": True, "platform": "tpu"}),
]


@pytest.mark.parametrize("dtype,impl,kwargs", PAGED_CASES)
def test_paged_matches_reference_and_ignores_stale_pages(dtype, impl, kwargs):
    q, k_pages, v_pages, table = _paged_case(dtype)
    lengths = np.where(STARTS > 0, LENGTHS - STARTS, LENGTHS)  # paged rows start at slot 0
    fn = jax.jit(lambda q, kp, vp, t, n: da.paged_decode_attention(q, kp, vp, t, n, impl=impl,
                                                                   **kwargs))
    out = fn(q, k_pages, v_pages, table, lengths)
    want = reference(q, da.gather_pages(k_pages, table), da.gather_pages(v_pages, table),
                     np.zeros(B, np.int32), lengths)
    tol = BF16_TOL if kwargs.get("platform") == "tpu" else TOL[dtype]
    err = np.abs(np.asarray(out, np.float64) - want)
    assert err.max() < tol, err.max(axis=(1, 2))
    assert not np.asarray(out[lengths == 0]).any()
    # Whatever a freed page still holds (a finished row's tokens) must not reach the output.
    stale = ~_live_page_mask(table, lengths, k_pages.shape[1])[None, :, :, None]
    junk = jnp.asarray(50.0, dtype)
    again = fn(q, jnp.where(stale, junk, k_pages), jnp.where(stale, -junk, v_pages), table,
               lengths)
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(out, np.float32))


def test_paged_equals_dense_on_the_gathered_cache():
    q, k_pages, v_pages, table = _paged_case(jnp.float32)
    lengths = np.array([1, 16, 17, 64, 20, 0], np.int32)
    paged = da.paged_decode_attention(q, k_pages, v_pages, table, lengths, impl="pallas",
                                      interpret=True)
    dense = da.decode_attention(q, da.gather_pages(k_pages, table),
                                da.gather_pages(v_pages, table), lengths, impl="xla")
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense), atol=F32_TOL)


def test_auto_on_cpu_is_the_cpu_kernel_or_xla_and_errors_name_the_field():
    q, k, v = _dense_case(jnp.float32)
    auto = da.decode_attention(q, k, v, LENGTHS, STARTS)
    xla = da.decode_attention(q, k, v, LENGTHS, STARTS, impl="xla")
    np.testing.assert_allclose(np.asarray(auto), np.asarray(xla), atol=F32_TOL)
    with pytest.raises(ValueError, match="impl="):
        da.decode_attention(q, k, v, LENGTHS, impl="flash")
    with pytest.raises(ValueError, match="no dense kernel on platform 'tpu'"):
        da.decode_attention(q, k, v, LENGTHS, impl="pallas", platform="tpu")
    with pytest.raises(ValueError, match="k, v"):
        da.decode_attention(q, k[:, :, :, :16], v, LENGTHS)
    with pytest.raises(ValueError, match="lengths"):
        da.decode_attention(q, k, v, LENGTHS[:2])
    with pytest.raises(ValueError, match="page_table"):
        pool = k.transpose(1, 0, 2, 3)  # [Hkv, B pages of S tokens, D]
        da.paged_decode_attention(q, pool, pool, np.zeros((2, 4), np.int32), LENGTHS)


def test_tilings_divide_the_paper_shapes():
    # 1.5B: 1024 + 8192 slots; 7B DAPO: 2048 + 20480.
    assert da.gpu_dense_tiles(9216) == (16, 64)
    assert da.gpu_dense_tiles(22528) == (16, 128)
    assert da.gpu_dense_tiles(64) == (4, 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        da.gpu_dense_tiles(100)
    assert da.gpu_paged_splits(576) == 16 and da.pages_per_compute_block(576, 16) == 4
    assert da.pages_per_compute_block(576) == 8


@pytest.mark.slow
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_larger_interpreted_kernels_at_the_1p5b_head_layout(paged, dtype):
    """12 query / 2 kv heads of 128 (the 1.5B model), 8 rows of random lengths up to 512 slots."""
    rng = np.random.default_rng(7)
    b, h, hkv, d, s = 8, 12, 2, 128, 512
    lengths = rng.integers(1, s + 1, b).astype(np.int32)
    lengths[0], lengths[1] = 1, s
    q = _normal(rng, (b, h, d), dtype)
    if paged:
        n = s // PAGE
        table = rng.permutation(b * n).reshape(b, n).astype(np.int32)
        kp, vp = (_normal(rng, (hkv, b * n, PAGE, d), dtype) for _ in range(2))
        want = reference(q, da.gather_pages(kp, table), da.gather_pages(vp, table),
                         np.zeros(b, np.int32), lengths)
        outs = {p: da.paged_decode_attention(q, kp, vp, table, lengths, impl="pallas",
                                             interpret=True, platform=p) for p in ("gpu", "tpu")}
    else:
        k, v = (_normal(rng, (b, hkv, s, d), dtype) for _ in range(2))
        want = reference(q, k, v, np.zeros(b, np.int32), lengths)
        outs = {"gpu": da.decode_attention(q, k, v, lengths, impl="pallas", platform="gpu",
                                           interpret=True)}
    for platform, out in outs.items():
        tol = BF16_TOL if platform == "tpu" else TOL[dtype]
        assert np.abs(np.asarray(out, np.float64) - want).max() < tol, platform


def test_window_of_a_mask():
    mask = np.zeros((4, 8), bool)
    mask[0, 2:5] = True
    mask[1, :] = True
    mask[3, 7] = True
    starts, lengths = da.window_of(jnp.asarray(mask))
    assert starts.tolist() == [2, 0, 0, 7] and lengths.tolist() == [5, 8, 0, 8]


CONFIG = ModelConfig(model_type="qwen2", vocab_size=101, hidden_size=64, intermediate_size=128,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True,
                     tie_word_embeddings=True)


def test_model_decode_steps_with_the_hook_match_the_model():
    """A left-padded prompt, then decode steps through `model_hook`, against the model's own
    masked attention: the window the hook reads off the mask is the model's rule."""
    params = init_params(CONFIG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, CONFIG.vocab_size)
    mask = jnp.array([[False, False, True, True, True, True, True, True, True]] + [[True] * 9] * 2)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)

    def run(hook):
        apply = jax.jit(Transformer(CONFIG, decode_attention=hook).apply)
        _, cache = apply({"params": params}, tokens[:, :6], positions[:, :6], mask[:, :6],
                         cache=KVCache.zeros(CONFIG, 3, 16))
        out = []
        for t in range(6, 9):
            logits, cache = apply({"params": params}, tokens[:, t:t + 1], positions[:, t:t + 1],
                                  None, cache=cache)
            out.append(np.asarray(logits))
        return np.concatenate(out, axis=1)

    np.testing.assert_allclose(run(da.model_hook("pallas", interpret=True)), run(None), atol=1e-5)


def test_kernels_under_shard_map_with_rows_split_over_devices():
    """Pallas calls are not partitioned by XLA: a sharded decode step runs them per shard (JAX's
    kernels declare no varying-axes types, so shard_map needs check_vma=False). Dense:
    rows split over the mesh. Paged: each device owns its rows and its own pool (pages split on
    the pool's page axis), with page-table entries local to the device's pool."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices()[:2])
    mesh = Mesh(devices, ("rows",))
    q, k, v = _dense_case(jnp.float32)
    dense = jax.jit(jax.shard_map(
        lambda q, k, v, n, s: da.decode_attention(q, k, v, n, s, impl="pallas", interpret=True),
        mesh=mesh, in_specs=P("rows"), out_specs=P("rows"), check_vma=False))
    want = reference(q, k, v, STARTS, LENGTHS)
    assert np.abs(np.asarray(dense(q, k, v, LENGTHS, STARTS)) - want).max() < F32_TOL

    q, k_pages, v_pages, table = _paged_case(jnp.float32)
    lengths = np.where(STARTS > 0, LENGTHS - STARTS, LENGTHS)
    # Device d holds rows [3d, 3d + 3) and pool pages [12d, 12d + 12): two pools side by side.
    pools = [jnp.concatenate([x, x[:, ::-1]], axis=1) for x in (k_pages, v_pages)]
    local = table.copy()
    local[3:] = 11 - table[3:]  # the second device's rows find their pages mirrored
    paged = jax.jit(jax.shard_map(
        lambda q, kp, vp, t, n: da.paged_decode_attention(q, kp, vp, t, n, impl="pallas",
                                                          interpret=True),
        mesh=mesh, in_specs=(P("rows"), P(None, "rows"), P(None, "rows"), P("rows"), P("rows")),
        out_specs=P("rows"), check_vma=False))
    want = reference(q, da.gather_pages(k_pages, table), da.gather_pages(v_pages, table),
                     np.zeros(B, np.int32), lengths)
    got = paged(q, *pools, local, lengths)
    assert np.abs(np.asarray(got) - want).max() < F32_TOL


# ----------------------------------------------------------------------------- compile proofs
@pytest.mark.slow
@pytest.mark.parametrize("target,env_var", [("h100", "QURL_GPU_PYTHON"),
                                            ("v5p", "QURL_TPU_PYTHON")])
def test_kernels_compile_deviceless_at_the_1p5b_decode_shape(target, env_var):
    """`python -m qurl_jax.bench.paged compile` for H100 (Triton) or v5p (Mosaic), run by the Python
    that the environment variable names (one with jax[cuda] or jax[tpu] installed); skipped when it
    is unset."""
    python = os.environ.get(env_var)
    if not python:
        pytest.skip(f"{env_var} is not set (a Python with the {target} compiler)")
    # One process per libtpu is libtpu's default; a compile-only client needs no lock.
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([python, "-m", "qurl_jax.bench.paged", "compile", f"--target={target}",
                           "--rows=64"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled" in proc.stdout, proc.stdout
