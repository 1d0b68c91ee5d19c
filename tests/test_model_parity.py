"""Logits parity of our decoder against transformers (torch, CPU, float32) for every family.

Each case builds a tiny randomly initialised transformers model, perturbs every parameter (so norm
gains differ from 1 and biases from 0), maps its state dict into our params and compares logits on a
left-padded batch with explicit positions; only real (non-pad) positions are compared. A second test
checks that prefill + token-by-token decode through our KV cache equals the full forward.

Our side computes in the run's `precision.dtype` (float32 in the default suite, bfloat16 under the
accelerator runner) with the tolerances of tests/tolerances.py; transformers stays in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from qurl_jax.models import KVCache, ModelConfig, RopeScaling, Transformer
from qurl_jax.models.hf import config_from_hf, params_from_hf_state_dict

TOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# (hf config class, hf kwargs beyond the shared sizes, our matching ModelConfig overrides)
CASES = {
    "llama": (transformers.LlamaConfig, {}, {}),
    "llama_tied": (transformers.LlamaConfig, {"tie_word_embeddings": True},
                   {"tie_word_embeddings": True}),
    "llama3_rope": (transformers.LlamaConfig,
                    {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}},
                    {"rope_theta": 500000.0,
                     "rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 16)}),
    "qwen2_bias_tied": (transformers.Qwen2Config, {"tie_word_embeddings": True},
                        {"model_type": "qwen2", "attention_bias": True,
                         "tie_word_embeddings": True}),
    "qwen3_qk_norm": (transformers.Qwen3Config, {"head_dim": 8},
                      {"model_type": "qwen3", "qk_norm": True, "head_dim": 8}),
    "mistral_gqa1": (transformers.MistralConfig, {"num_key_value_heads": 1, "sliding_window": None},
                     {"model_type": "mistral", "num_kv_heads": 1}),
}
SIZES = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 64}


def _our_config(overrides: dict) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=64)
    return ModelConfig(**{**base, **overrides})


def _hf_model(config_cls: type, kwargs: dict, seed: int = 0) -> transformers.PreTrainedModel:
    """Random transformers model whose every parameter (norm gains, biases too) is perturbed."""
    torch.manual_seed(seed)
    hf_config = config_cls(**{**SIZES, **kwargs}, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def _state_dict(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _left_padded_batch(vocab: int, lengths: list[int], seed: int = 1):
    """tokens i32[B,T] (pads 0), mask bool[B,T], positions i32[B,T] (0 at the first real token)."""
    t = max(lengths)
    rng = np.random.RandomState(seed)
    mask = np.array([[j >= t - n for j in range(t)] for n in lengths])
    tokens = np.where(mask, rng.randint(1, vocab, (len(lengths), t)), 0).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, mask, positions


def _hf_logits(model: torch.nn.Module, tokens, mask, positions) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(positions, dtype=torch.long))
    return out.logits.float().numpy()


@functools.cache
def _apply(config: ModelConfig):
    """Jitted `Transformer(config).apply` (one compile per config and shape, not per op)."""
    return jax.jit(Transformer(config).apply)


def _our_logits(config: ModelConfig, params, tokens, mask, positions) -> np.ndarray:
    logits, _ = _apply(config)({"params": params}, jnp.asarray(tokens), jnp.asarray(positions),
                               jnp.asarray(mask))
    return np.asarray(logits)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers_on_left_padded_batch(case, precision):
    config_cls, hf_kwargs, overrides = CASES[case]
    config = _our_config(overrides)
    model = _hf_model(config_cls, hf_kwargs)
    assert config_from_hf(model.config.to_dict()) == config
    params = params_from_hf_state_dict(config, _state_dict(model))

    tokens, mask, positions = _left_padded_batch(config.vocab_size, [12, 7, 3])
    ours = _our_logits(config.replace(dtype=precision.dtype), params, tokens, mask, positions)
    theirs = _hf_logits(model, tokens, mask, positions)
    assert np.isfinite(ours).all()
    precision.assert_close(ours[mask], theirs[mask], "model_parity.logits_vs_transformers", case)
    # The logits are not trivially tiny: the agreement is meaningful (a real mismatch, such as a
    # wrong rotary frequency, moves logits by ~their spread of 0.5).
    assert np.abs(theirs[mask]).max() > 0.1


def test_llama3_rope_scaling_changes_logits():
    """Guards the llama3 case above: scaling on these positions must matter, in both models."""
    config_cls, hf_kwargs, overrides = CASES["llama3_rope"]
    scaled = _hf_model(config_cls, hf_kwargs)
    plain = _hf_model(config_cls, {"rope_parameters": {"rope_type": "default",
                                                       "rope_theta": 500000.0}})
    plain.load_state_dict(scaled.state_dict())
    tokens, mask, positions = _left_padded_batch(97, [12, 7, 3])
    hf_gap = np.abs(_hf_logits(scaled, tokens, mask, positions)
                    - _hf_logits(plain, tokens, mask, positions))[mask].max()
    config = _our_config(overrides)
    params = params_from_hf_state_dict(config, _state_dict(scaled))
    ours_gap = np.abs(_our_logits(config, params, tokens, mask, positions)
                      - _our_logits(config.replace(rope_scaling=None), params, tokens, mask,
                                    positions))[mask].max()
    assert hf_gap > 100 * TOL
    assert ours_gap > 100 * TOL


def test_padding_does_not_change_real_positions(precision):
    """A left-padded row gives the same logits as the same sequence without padding."""
    config = _our_config({"dtype": precision.dtype})
    params = params_from_hf_state_dict(config, _state_dict(_hf_model(*CASES["llama"][:2], seed=3)))
    tokens, mask, positions = _left_padded_batch(config.vocab_size, [9, 4])
    padded = _our_logits(config, params, tokens, mask, positions)
    alone = _our_logits(config, params, tokens[1:, -4:], mask[1:, -4:], positions[1:, -4:])
    precision.assert_close(padded[1, -4:], alone[0], "model_parity.padding_invariance")


@pytest.mark.parametrize("case", ["llama", "qwen3_qk_norm"])
def test_kv_cache_prefill_then_decode_equals_full_forward(case, precision):
    config_cls, hf_kwargs, overrides = CASES[case]
    config = _our_config({**overrides, "dtype": precision.dtype})
    params = params_from_hf_state_dict(config, _state_dict(_hf_model(config_cls, hf_kwargs, 7)))
    apply = _apply(config)
    prompt_lengths, prompt_len, steps = [6, 2, 4], 6, 5
    p_tokens, p_mask, _ = _left_padded_batch(config.vocab_size, prompt_lengths, seed=2)
    gen = np.random.RandomState(3).randint(1, config.vocab_size, (3, steps)).astype(np.int32)
    tokens = np.concatenate([p_tokens, gen], axis=1)
    mask = np.concatenate([p_mask, np.ones_like(gen, bool)], axis=1)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    full = _our_logits(config, params, tokens, mask, positions)

    cache = KVCache.zeros(config, batch=3, length=prompt_len + steps + 2)
    prefill, cache = apply({"params": params}, jnp.asarray(p_tokens),
                           jnp.asarray(positions[:, :prompt_len]), jnp.asarray(p_mask), cache=cache)
    name = "model_parity.cache_decode_vs_full_forward"
    precision.assert_close(np.asarray(prefill)[p_mask], full[:, :prompt_len][p_mask], name)
    for j in range(steps):
        s = prompt_len + j
        np.testing.assert_array_equal(np.asarray(cache.next_pos), positions[:, s])
        step, cache = apply({"params": params}, jnp.asarray(tokens[:, s:s + 1]),
                            cache.next_pos[:, None], None, cache=cache)
        precision.assert_close(np.asarray(step)[:, 0], full[:, s], name, f"decode step {j}")
