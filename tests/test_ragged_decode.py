"""The engine's decode attention choice (`model.decode_attention`): the ragged Pallas kernel
(Pallas' interpreter on this CPU) gives the samplers the same tokens as XLA's masked attention,
and log-probs within float32 summation-order noise; compressed caches keep the masked path; on an
H100 (compile-only) the static sampler's decode program compiles with the kernel."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from qurl_jax.config import base as qconfig
from qurl_jax.config.settings import rollout_sampler_settings
from qurl_jax.cpu_kernels import decode_attention as cpu_attention
from qurl_jax.models import param_logical_axes
from qurl_jax.parallel.sharding import make_mesh, shard_params
from qurl_jax.runtime.errors import ConfigError
from qurl_jax.sampling import FinishReason, KVPolicyConfig, RefillSampler, Sampler, SamplingParams
from qurl_jax.sampling._engine import Engine
from qurl_jax.sampling.factory import RolloutSamplerSettings, build_rollout_sampler
from tests.compile_only import compiler_or_skip
from tests.test_sampler import PROMPTS, _abstract, _random_params

# The kernel's split-k flash decoding sums the softmax in another order than XLA's: float32
# log-probs agree to ~1e-6 here; 1e-4 leaves margin for the larger logits of peaked rows.
LOGP_ATOL = 1e-4
PROMPTS4 = PROMPTS + [[90, 91, 92, 93, 94, 3]]
KW = dict(max_prompt_len=16, max_new_tokens=16)
MODES = [dict(greedy=True), dict(temperature=0.8, top_k=40)]


@pytest.fixture(scope="module")
def qwen(tiny_model_config):
    cfg = tiny_model_config("qwen2")
    params = _random_params(cfg)
    # An EOS id that ends row 0 at its 4th greedy token (so some rows finish on EOS).
    free = Sampler(cfg, decode_attention="xla", **KW).sample(
        params, PROMPTS4, key=jax.random.key(0), settings=SamplingParams(max_new_tokens=8,
                                                                          greedy=True))
    return cfg, params, int(np.asarray(free.tokens)[0, 3])


def _settings(eos: int, **mode) -> SamplingParams:
    return SamplingParams(max_new_tokens=12, eos_ids=(eos,), **mode)


def _assert_same(got, want) -> None:
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
    np.testing.assert_array_equal(np.asarray(got.finish_reason), np.asarray(want.finish_reason))
    for name in ("logp", "logp_untruncated"):
        np.testing.assert_allclose(np.asarray(getattr(got, name)),
                                   np.asarray(getattr(want, name)), atol=LOGP_ATOL, err_msg=name)


def _run(kind, cfg, params, eos, mode, decode_attention, **kw):
    sampler = kind(cfg, decode_attention=decode_attention, **KW, **kw)
    return sampler.sample(params, PROMPTS4, key=jax.random.key(7), n=2,
                          settings=_settings(eos, **mode))


@pytest.mark.parametrize("kind,mode", [
    pytest.param(Sampler, MODES[0], id="static-greedy"),
    pytest.param(Sampler, MODES[1], id="static-sampled"),
    pytest.param(RefillSampler, MODES[0], id="refill-greedy"),
    pytest.param(RefillSampler, MODES[1], id="refill-sampled", marks=pytest.mark.slow)])
def test_pallas_gives_the_tokens_of_xla(qwen, kind, mode) -> None:
    cfg, params, eos = qwen
    extra = dict(max_concurrent_rows=4, refill_min=1) if kind is RefillSampler else {}
    want = _run(kind, cfg, params, eos, mode, "xla", **extra)
    got = _run(kind, cfg, params, eos, mode, "pallas", **extra)
    _assert_same(got, want)
    if mode.get("greedy"):
        assert (np.asarray(want.finish_reason) == FinishReason.EOS).any()


@pytest.mark.parametrize("kind", [Sampler, pytest.param(RefillSampler, marks=pytest.mark.slow)],
                         ids=["static", "refill"])
def test_pallas_per_shard_on_a_mesh(qwen, kind) -> None:
    """8 devices: rows over data x fsdp, kv heads over tensor; the kernel runs under shard_map."""
    cfg, params, eos = qwen
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = shard_params(params, param_logical_axes(cfg), mesh)
    extra = dict(max_concurrent_rows=8, mesh=mesh)
    if kind is RefillSampler:
        extra.update(refill_min=1)
    mode = MODES[1]
    want = _run(kind, cfg, sharded, eos, mode, "xla", **extra)
    got = _run(kind, cfg, sharded, eos, mode, "pallas", **extra)
    _assert_same(got, want)


def test_compressed_cache_keeps_the_masked_path(qwen) -> None:
    """A compressed cache has holes in its live slots: 'pallas' keeps XLA's masked attention."""
    cfg, params, eos = qwen
    kv = KVPolicyConfig(policy="snapkv", budget=6, interval=3, window=2, pool_kernel=3)
    engine = Engine(cfg, kv_policy=kv, decode_attention="pallas", **KW)
    assert engine.attention_hook() is None
    want = _run(Sampler, cfg, params, eos, MODES[1], "xla", kv_policy=kv)
    got = _run(Sampler, cfg, params, eos, MODES[1], "pallas", kv_policy=kv)
    for name in ("tokens", "logp", "logp_untruncated", "mask"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                      np.asarray(getattr(want, name)), err_msg=name)


def test_the_choice_per_platform(tiny_model_config) -> None:
    cfg = tiny_model_config("qwen2")
    hook = lambda **kw: Engine(cfg, **KW, **kw).attention_hook()  # noqa: E731
    assert hook(decode_attention="xla", platform="cpu") is None
    assert hook(decode_attention="xla", platform="cuda") is None
    if cpu_attention.usable(cfg.compute_dtype, cfg.head_dim):
        assert hook(decode_attention="auto", platform="cpu") is cpu_attention.decode_attention
    assert hook(decode_attention="auto", platform="tpu") is None  # no dense ragged TPU kernel
    assert hook(decode_attention="auto", platform="gpu") is not None
    assert hook(decode_attention="pallas", platform="cpu") is not None
    # A GPU's programs built on host devices (a memory estimate) keep XLA under 'auto'.
    assert hook(decode_attention="auto", platform="gpu", mesh=make_mesh(data=2)) is None
    kv = KVPolicyConfig(policy="streaming", budget=6, interval=3, window=2, sinks=1)
    assert hook(decode_attention="auto", platform="gpu", kv_policy=kv) is None
    with pytest.raises(ValueError, match="decode_attention='pallas'.*'tpu'"):
        Engine(cfg, decode_attention="pallas", platform="tpu")
    with pytest.raises(ValueError, match="decode_attention='paged'"):
        Engine(cfg, decode_attention="paged")


def test_config_field_reaches_the_engine(tiny_model_config) -> None:
    c = qconfig.base_config()
    c.model.source, c.data.task = "tiny", "arithmetic"  # reads no files
    assert c.model.decode_attention == "auto"
    c.model.decode_attention = "pallas"
    settings = rollout_sampler_settings(c)
    assert settings.decode_attention == "pallas"
    sampler = build_rollout_sampler(tiny_model_config("qwen2"), jax.lax.dot_general, settings,
                                    **KW)
    assert sampler.engine.decode_attention == "pallas"
    with pytest.raises(ValueError, match="model.decode_attention='flash'"):
        RolloutSamplerSettings(decode_attention="flash")
    c.model.decode_attention = "flash"
    with pytest.raises(ConfigError, match=r"config.model.decode_attention='flash'"):
        qconfig.validate(c)


def test_static_decode_program_compiles_for_h100_with_the_kernel(tiny_model_config) -> None:
    """Compile-only H100 (needs the CUDA plugin, `pip install -e .[gpu-compile]`): the static
    sampler's decode program with decode_attention='pallas' compiles (a Triton call per layer);
    its memory analysis is printed beside the 'xla' program's."""
    target = compiler_or_skip("gpu:h100-1")
    cfg = tiny_model_config("qwen2")
    mesh = make_mesh(devices=target.devices()[:1])
    whole = NamedSharding(mesh, PartitionSpec())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole),
                            _abstract(_random_params(cfg)))
    memory = {}
    for choice in ("xla", "pallas"):
        sampler = Sampler(cfg, mesh=mesh, decode_attention=choice, **KW)
        lowered = sampler.lower_programs(abstract, 8, 16, 16, n=2)["decode"]
        assert ("triton" in lowered.as_text()) == (choice == "pallas")
        m = lowered.compile().memory_analysis()
        memory[choice] = m
        print(choice, {k: getattr(m, k) for k in ("argument_size_in_bytes",
                                                  "output_size_in_bytes", "temp_size_in_bytes",
                                                  "alias_size_in_bytes")})
    assert memory["pallas"].argument_size_in_bytes == memory["xla"].argument_size_in_bytes
