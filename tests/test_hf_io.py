"""Hugging Face checkpoint I/O: save_hf/load_hf round trips through transformers, and bad input.

Directories written by `save_hf` must load in `transformers.AutoModelForCausalLM` with the same
logits; directories written by transformers (bf16/fp16, sharded) must load with `load_hf` (without
torch) into exactly the stored weights. Broken directories must fail with an error that names the
tensor, file or field at fault.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
import torch
import transformers

from qurl_jax.models import ModelConfig, RopeScaling, Transformer, init_params
from qurl_jax.models.hf import (
    config_from_hf,
    config_to_hf,
    load_hf,
    load_tokenizer,
    params_to_hf_state_dict,
    save_hf,
)

SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=64)
CONFIGS = {
    "qwen2_tied": ModelConfig(model_type="qwen2", attention_bias=True, tie_word_embeddings=True,
                              **SMALL),
    "qwen3": ModelConfig(model_type="qwen3", qk_norm=True, **SMALL),
    "llama3_rope": ModelConfig(model_type="llama", rope_theta=500000.0,
                               rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16), **SMALL),
    "mistral": ModelConfig(model_type="mistral", **SMALL),
}


def _random_params(config: ModelConfig, seed: int = 0):
    """Random float32 params of init_params' structure; norm gains near 1, biases nonzero."""
    shapes = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
    rng = np.random.RandomState(seed)

    def leaf(path, x):
        noise = 0.1 * rng.standard_normal(x.shape).astype(np.float32)
        return jnp.asarray(noise + (1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0))

    return jax.tree_util.tree_map_with_path(leaf, shapes)


def _tokens(vocab: int) -> np.ndarray:
    return np.random.RandomState(0).randint(0, vocab, (2, 9)).astype(np.int32)


def _ours(config: ModelConfig, params, tokens: np.ndarray) -> np.ndarray:
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    logits, _ = jax.jit(Transformer(config).apply)({"params": params}, jnp.asarray(tokens),
                                                   jnp.asarray(positions))
    return np.asarray(logits)


def _theirs(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _hf_model(config: ModelConfig, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A transformers model with random, perturbed weights (built from its own config class)."""
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**config_to_hf(config))
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_save_hf_loads_in_transformers_with_same_logits(tmp_path, name):
    config = CONFIGS[name]
    params = _random_params(config)
    save_hf(tmp_path, config, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    model.eval()
    assert type(model).__name__ == config_to_hf(config)["architectures"][0]
    tokens = _tokens(config.vocab_size)
    np.testing.assert_allclose(_ours(config, params, tokens), _theirs(model, tokens), atol=1e-4)
    # And back: load_hf returns exactly what was saved.
    config2, params2 = load_hf(tmp_path)
    assert config2 == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, params2)


@pytest.mark.parametrize("dtype,np_dtype", [(torch.bfloat16, ml_dtypes.bfloat16),
                                            (torch.float16, np.float16)])
def test_load_hf_reads_transformers_half_precision(tmp_path, dtype, np_dtype):
    config = CONFIGS["qwen2_tied"]
    model = _hf_model(config, dtype)
    model.save_pretrained(tmp_path)
    stored = safetensors.numpy.load_file(os.path.join(tmp_path, "model.safetensors"))
    assert stored["model.embed_tokens.weight"].dtype == np_dtype

    loaded_config, params = load_hf(tmp_path)
    assert loaded_config == config
    assert params["embed_tokens"]["embedding"].dtype == jnp.float32
    # Exact: half -> float32 is lossless, and kernels are the transposed [out, in] weights.
    q = model.model.layers[1].self_attn.q_proj.weight.float().detach().numpy()
    np.testing.assert_array_equal(np.asarray(params["layers_1"]["self_attn"]["q_proj"]["kernel"]),
                                  q.T)
    tokens = _tokens(config.vocab_size)
    # Reference: transformers itself loading the half-precision weights into float32 compute
    # (not `model.float()`, whose RoPE buffers were rounded to half by `.to(dtype)`).
    reference = _theirs(transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32).eval(), tokens)
    np.testing.assert_allclose(_ours(config, params, tokens), reference, atol=1e-4)


def test_load_hf_bfloat16_params_dtype(tmp_path):
    config = CONFIGS["qwen3"]
    save_hf(tmp_path, config, _random_params(config))
    loaded_config, params = load_hf(tmp_path, dtype=jnp.bfloat16)
    assert loaded_config.param_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}


def test_load_hf_reads_sharded_checkpoint(tmp_path):
    config = CONFIGS["llama3_rope"]
    model = _hf_model(config)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2
    assert not (tmp_path / "model.safetensors").exists()
    loaded_config, params = load_hf(tmp_path)
    assert loaded_config == config
    tokens = _tokens(config.vocab_size)
    np.testing.assert_allclose(_ours(config, params, tokens), _theirs(model, tokens), atol=1e-4)


def test_load_hf_does_not_import_torch(tmp_path):
    config = CONFIGS["qwen2_tied"]
    save_hf(tmp_path, config, _random_params(config))
    code = ("import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises
            "from qurl_jax.models.hf import load_hf\n"
            f"config, params = load_hf({str(tmp_path)!r})\n"
            "print(config.model_type)\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "qwen2"


def test_save_hf_with_tokenizer_and_chat_template(tmp_path):
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "hello": 4, "world": 5}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                               "{% endfor %}")
    config = ModelConfig(model_type="llama", **{**SMALL, "vocab_size": 6})
    save_hf(tmp_path, config, _random_params(config), tokenizer=tokenizer)

    loaded = load_tokenizer(tmp_path)
    text = loaded.apply_chat_template([{"role": "hello", "content": "world"}], tokenize=False)
    assert text == "hello world "
    assert loaded("hello world")["input_ids"][-2:] == [4, 5]
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["pad_token_id"] == 0
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path).config.eos_token_id == 2


def test_config_from_hf_reads_new_and_legacy_rope_formats():
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    new = config_from_hf({**base, "rope_parameters": {**llama3, "rope_theta": 500000.0}})
    legacy = config_from_hf({**base, "rope_theta": 500000.0, "rope_scaling": llama3})
    assert new == legacy
    assert new.rope_theta == 500000.0
    assert new.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    # Defaults a minimal config implies: head_dim = hidden/heads, kv heads = heads, theta 1e4.
    plain = config_from_hf(base)
    assert (plain.head_dim, plain.num_kv_heads, plain.rope_theta, plain.rope_scaling) == (
        8, 2, 10000.0, None)
    linear = config_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling == RopeScaling("linear", 2.0)


# ----------------------------------------------------------------------------------------------
# Bad input: the error names what is wrong.
# ----------------------------------------------------------------------------------------------


def _saved(tmp_path, name: str = "qwen3") -> tuple[ModelConfig, dict[str, np.ndarray]]:
    config = CONFIGS[name]
    save_hf(tmp_path, config, _random_params(config))
    return config, safetensors.numpy.load_file(os.path.join(tmp_path, "model.safetensors"))


def _rewrite(tmp_path, tensors: dict[str, np.ndarray]) -> None:
    safetensors.numpy.save_file(tensors, os.path.join(tmp_path, "model.safetensors"),
                                metadata={"format": "pt"})


def _edit_config(tmp_path, edit) -> None:
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    edit(hf)
    path.write_text(json.dumps(hf))


def test_missing_tensor_is_named(tmp_path):
    _, tensors = _saved(tmp_path)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    _rewrite(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm"):
        load_hf(tmp_path)


def test_wrong_shape_names_tensor_and_file(tmp_path):
    _, tensors = _saved(tmp_path)
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((40, 31), np.float32)
    _rewrite(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' \(in file "
                                         r"model\.safetensors\) has shape \(40, 31\), expected "
                                         r"\(40, 32\)"):
        load_hf(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    _, tensors = _saved(tmp_path)
    tensors["model.layers.2.mlp.up_proj.weight"] = np.zeros((40, 32), np.float32)
    _rewrite(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj"):
        load_hf(tmp_path)


def test_untied_checkpoint_without_lm_head_fails(tmp_path):
    _, tensors = _saved(tmp_path, "mistral")
    del tensors["lm_head.weight"]
    _rewrite(tmp_path, tensors)
    with pytest.raises(ValueError, match=r"missing tensor 'lm_head\.weight'"):
        load_hf(tmp_path)


def test_unsupported_architecture_is_named(tmp_path):
    _saved(tmp_path)
    _edit_config(tmp_path, lambda hf: hf.update(model_type="gpt2"))
    with pytest.raises(ValueError, match=r"model_type='gpt2' is not supported.*'llama'.*'qwen3'"):
        load_hf(tmp_path)


def test_missing_config_field_is_named(tmp_path):
    _saved(tmp_path)
    _edit_config(tmp_path, lambda hf: hf.pop("intermediate_size"))
    with pytest.raises(ValueError, match="missing required field 'intermediate_size'"):
        load_hf(tmp_path)


@pytest.mark.parametrize("field,value,message", [
    ("attention_bias", True, "attention_bias=true for llama"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "'yarn'"),
])
def test_unsupported_features_are_named(field, value, message):
    hf = config_to_hf(CONFIGS["llama3_rope"])
    hf[field] = value
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)


def test_missing_shard_is_named(tmp_path):
    config = CONFIGS["mistral"]
    tensors = params_to_hf_state_dict(config, _random_params(config))
    names = sorted(tensors)
    first = {n: tensors[n] for n in names[:5]}
    safetensors.numpy.save_file(first, os.path.join(tmp_path, "part-1.safetensors"))
    weight_map = {n: ("part-1.safetensors" if n in first else "part-2.safetensors")
                  for n in names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(config)))
    with pytest.raises(ValueError, match="shard 'part-2.safetensors'"):
        load_hf(tmp_path)
    rest = {n: tensors[n] for n in names[5:]}
    safetensors.numpy.save_file(rest, os.path.join(tmp_path, "part-2.safetensors"))
    assert load_hf(tmp_path)[0] == config


def test_no_weights_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(CONFIGS["mistral"])))
    with pytest.raises(ValueError, match=r"no \*\.safetensors files"):
        load_hf(tmp_path)
