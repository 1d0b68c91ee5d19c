"""Hugging Face checkpoints: config and tensor-name mapping, safetensors load/save, tokenizer.

Our parameters are the linen `params` pytree of `qurl_jax.models.transformer` (kernels stored
[in, out]); a Hugging Face state dict names the same tensors like
`model.layers.{i}.self_attn.q_proj.weight` and stores Linear weights [out, in].
`params_from_hf_state_dict` / `params_to_hf_state_dict` are the pure mapping between the two (numpy
in, numpy out, no file I/O); `load_hf` / `save_hf` add the directory format (`config.json`,
`*.safetensors`, sharded `model.safetensors.index.json`). Reading never imports torch: safetensors'
numpy API returns bfloat16 as `ml_dtypes.bfloat16`. Every missing, unexpected or mis-shaped tensor
raises a ValueError naming the tensor (and its file); nothing is silently initialised at random.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from qurl_jax.models.config import ModelConfig

Params = dict[str, Any]

# Buffers some older checkpoints carry that are recomputed from the config, never parameters.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tensor: HF name, our param path, HF shape, and whether it is a (transposed) kernel."""

    hf_name: str
    path: tuple[str, ...]
    hf_shape: tuple[int, ...]
    transpose: bool


def _entries(config: ModelConfig) -> list[_Entry]:
    """Every tensor the config implies, in a fixed order (HF shapes: Linear weights [out, in])."""
    e, m, v = config.hidden_size, config.intermediate_size, config.vocab_size
    d = config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    out = [_Entry("model.embed_tokens.weight", ("embed_tokens", "embedding"), (v, e), False)]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"layers_{i}"
        out += [
            _Entry(f"{hf}.input_layernorm.weight", (ours, "input_layernorm", "scale"), (e,), False),
            _Entry(f"{hf}.post_attention_layernorm.weight",
                   (ours, "post_attention_layernorm", "scale"), (e,), False),
        ]
        for name, features in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append(_Entry(f"{hf}.self_attn.{name}.weight", (ours, "self_attn", name, "kernel"),
                              (features, e), True))
            if config.attention_bias:
                out.append(_Entry(f"{hf}.self_attn.{name}.bias", (ours, "self_attn", name, "bias"),
                                  (features,), False))
        out.append(_Entry(f"{hf}.self_attn.o_proj.weight", (ours, "self_attn", "o_proj", "kernel"),
                          (e, q), True))
        if config.qk_norm:
            for name in ("q_norm", "k_norm"):
                out.append(_Entry(f"{hf}.self_attn.{name}.weight",
                                  (ours, "self_attn", name, "scale"), (d,), False))
        for name, shape in (("gate_proj", (m, e)), ("up_proj", (m, e)), ("down_proj", (e, m))):
            out.append(_Entry(f"{hf}.mlp.{name}.weight", (ours, "mlp", name, "kernel"), shape,
                              True))
    out.append(_Entry("model.norm.weight", ("norm", "scale"), (e,), False))
    if not config.tie_word_embeddings:
        out.append(_Entry("lm_head.weight", ("lm_head", "kernel"), (v, e), True))
    return out


def _where(name: str, sources: Mapping[str, str] | None) -> str:
    if sources and name in sources:
        return f" (in file {sources[name]})"
    return ""


def params_from_hf_state_dict(
    config: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    dtype: Any = None,
    *,
    sources: Mapping[str, str] | None = None,
) -> Params:
    """Hugging Face state dict (numpy arrays, any float dtype) -> our params pytree.

    Args:
      config: the model the tensors belong to.
      tensors: HF name -> array, Linear weights [out, in]. For tied embeddings an `lm_head.weight`
        copy is accepted and ignored; `*.rotary_emb.inv_freq` buffers are ignored.
      dtype: dtype of the returned params; default `config.param_dtype`.
      sources: optional HF name -> file name, only used to name the file in error messages.

    Returns:
      Nested dict of jax arrays matching `init_params(config, ...)` (kernels [in, out]).

    Raises:
      ValueError naming the first missing, unexpected or mis-shaped tensor.
    """
    dtype = jnp.dtype(config.param_dtype if dtype is None else dtype)
    entries = _entries(config)
    expected = {en.hf_name for en in entries}
    for name in tensors:
        ignorable = name.endswith(_IGNORED_SUFFIXES) or (
            name == "lm_head.weight" and config.tie_word_embeddings)
        if name not in expected and not ignorable:
            raise ValueError(
                f"unexpected tensor {name!r}{_where(name, sources)} for a {config.model_type} "
                f"model "
                f"with num_layers={config.num_layers}, attention_bias={config.attention_bias}, "
                f"qk_norm={config.qk_norm}, tie_word_embeddings={config.tie_word_embeddings}"
            )
    params: Params = {}
    for en in entries:
        if en.hf_name not in tensors:
            raise ValueError(f"missing tensor {en.hf_name!r}: the checkpoint does not contain it")
        array = np.asarray(tensors[en.hf_name])
        if tuple(array.shape) != en.hf_shape:
            raise ValueError(
                f"tensor {en.hf_name!r}{_where(en.hf_name, sources)} has shape "
                f"{tuple(array.shape)}, "
                f"expected {en.hf_shape} from the config"
            )
        if en.transpose:
            array = array.T
        # Upcast through float32: bf16/fp16 -> f32 is exact, and jnp handles ml_dtypes inputs.
        leaf = jnp.asarray(np.ascontiguousarray(array, dtype=np.float32), dtype=dtype)
        node = params
        for key in en.path[:-1]:
            node = node.setdefault(key, {})
        node[en.path[-1]] = leaf
    return params


def params_to_hf_state_dict(config: ModelConfig, params: Params, dtype: Any = None) -> dict[
        str, np.ndarray]:
    """Our params pytree -> Hugging Face state dict of contiguous numpy arrays ([out, in] weights).

    `dtype` (e.g. `ml_dtypes.bfloat16`) converts every tensor; default keeps each leaf's dtype.
    A tied model gets no `lm_head.weight` (transformers re-ties it from the embedding).
    """
    out: dict[str, np.ndarray] = {}
    for en in _entries(config):
        node: Any = params
        try:
            for key in en.path:
                node = node[key]
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"params lack {'/'.join(en.path)} (HF tensor {en.hf_name!r})") from err
        array = np.asarray(node)
        if en.transpose:
            array = array.T
        if tuple(array.shape) != en.hf_shape:
            raise ValueError(
                f"param {'/'.join(en.path)} gives {en.hf_name!r} shape {tuple(array.shape)}, "
                f"expected {en.hf_shape} from the config"
            )
        out[en.hf_name] = np.ascontiguousarray(array if dtype is None else array.astype(dtype))
    return out
