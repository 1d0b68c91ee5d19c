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
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from qurl_jax.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling
from qurl_jax.runtime import paths

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


def params_to_hf_state_dict(
    config: ModelConfig, params: Params, dtype: Any = None
) -> dict[str, np.ndarray]:
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


# ----------------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ----------------------------------------------------------------------------------------------

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# transformers' defaults for fields a config.json may omit (the values its config classes use).
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5.x `rope_parameters` or older `rope_theta` +
    `rope_scaling` (whose type key may be the legacy `type`)."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = dict(params) if params else dict(hf.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    kwargs = {k: scaling[k] for k in _ROPE_FIELDS if k in scaling}
    if rope_type == "llama3":
        missing = [k for k in _ROPE_FIELDS if k not in scaling]
        if missing:
            raise ValueError(f"config.json: llama3 rope scaling lacks field(s) {missing}")
    elif rope_type == "linear" and "factor" not in scaling:
        raise ValueError("config.json: linear rope scaling lacks field 'factor'")
    return float(theta), RopeScaling(rope_type=rope_type, **kwargs)


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Hugging Face `config.json` dict -> validated ModelConfig.

    Raises:
      ValueError naming an unsupported `model_type` (with the supported list), a missing required
      field, or a feature this model does not implement (o_proj/MLP biases, sliding-window attention
      in Qwen, non-SiLU activations, RoPE types other than default/linear/llama3).
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type={model_type!r} is not supported; supported: "
            f"{list(SUPPORTED_MODEL_TYPES)}"
        )
    for field in _REQUIRED_FIELDS:
        if hf.get(field) is None:
            raise ValueError(f"config.json ({model_type}): missing required field {field!r}")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")
    if hf.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported")
    if model_type == "qwen2":
        # Qwen2 always has q/k/v biases (its config has no switch) and never an o_proj bias.
        attention_bias = True
    elif hf.get("attention_bias"):
        raise ValueError(
            f"config.json: attention_bias=true for {model_type} also puts a bias on o_proj, which "
            "is not supported (only Qwen2-style q/k/v biases are)"
        )
    else:
        attention_bias = False
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true is not supported")
    heads = int(hf["num_attention_heads"])
    default_head_dim = 128 if model_type == "qwen3" else int(hf["hidden_size"]) // heads
    theta, scaling = _rope_from_hf(hf)
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or default_head_dim),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=model_type == "qwen3",
        max_position_embeddings=int(hf.get("max_position_embeddings")
                                    or _DEFAULT_MAX_POSITIONS[model_type]),
    ).validate()


def config_to_hf(config: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """ModelConfig -> `config.json` dict that transformers 5.x (`rope_parameters`) and 4.x
    (`rope_theta` + `rope_scaling`) both read.

    Raises:
      ValueError when the combination has no Hugging Face equivalent (Qwen2 without q/k/v biases,
      biases or q/k norm outside Qwen2/Qwen3).
    """
    config.validate()
    mt = config.model_type
    if config.attention_bias != (mt == "qwen2"):
        raise ValueError(
            f"attention_bias={config.attention_bias} has no Hugging Face {mt} equivalent "
            "(q/k/v biases exist exactly in qwen2)")
    if config.qk_norm != (mt == "qwen3"):
        raise ValueError(
            f"qk_norm={config.qk_norm} has no Hugging Face {mt} equivalent (q/k norm exists "
            "exactly in qwen3)")
    rope: dict[str, Any] = {"rope_type": "default"}
    if config.rope_scaling is not None and config.rope_scaling.rope_type != "default":
        rs = config.rope_scaling
        rope = {"rope_type": rs.rope_type, "factor": rs.factor}
        if rs.rope_type == "llama3":
            rope.update(low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                        original_max_position_embeddings=rs.original_max_position_embeddings)
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[mt]],
        "model_type": mt,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if rope["rope_type"] == "default" else dict(rope),
        "rope_parameters": {**rope, "rope_theta": config.rope_theta},
        "dtype": torch_dtype,
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }
    if mt in ("llama", "mistral", "qwen3"):
        hf.update(attention_bias=False)
    if mt == "llama":
        hf.update(mlp_bias=False)
    if mt == "mistral":
        hf.update(sliding_window=None)
    if mt in ("qwen2", "qwen3"):
        hf.update(use_sliding_window=False, sliding_window=None)
    return hf


# ----------------------------------------------------------------------------------------------
# Directories: config.json + *.safetensors
# ----------------------------------------------------------------------------------------------

_INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError as err:
        raise ValueError(f"{path} does not exist") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err


def _safetensors_files(path: str) -> list[str]:
    """Weight files of a checkpoint directory: the index's shards if present, else *.safetensors."""
    index_path = os.path.join(path, _INDEX_FILE)
    if os.path.exists(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: no 'weight_map'")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.exists(os.path.join(path, name)):
                raise ValueError(f"{index_path} lists shard {name!r}, which is not in {path}")
        return files
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (only safetensors checkpoints are read)")
    return files


def read_safetensors_dir(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors of a checkpoint directory as numpy (bf16 as ml_dtypes.bfloat16), without torch.

    Returns:
      (name -> array, name -> file name). Raises ValueError naming a tensor stored in two files.
    """
    path = os.fspath(path)
    tensors: dict[str, np.ndarray] = {}
    sources: dict[str, str] = {}
    for name in _safetensors_files(path):
        for key, array in safetensors.numpy.load_file(os.path.join(path, name)).items():
            if key in tensors:
                raise ValueError(f"tensor {key!r} is stored twice: in {sources[key]} and {name}")
            tensors[key] = array
            sources[key] = name
    return tensors, sources


def load_hf(path: str | os.PathLike, dtype: Any = jnp.float32) -> tuple[ModelConfig, Params]:
    """Reads a Hugging Face checkpoint directory -> (ModelConfig, params in `dtype`).

    Reads `config.json` and the safetensors weights (a single file or shards listed in
    `model.safetensors.index.json`), stored in bfloat16, float16 or float32. Never imports torch.
    The returned config has `param_dtype` = `dtype`; its compute dtype stays float32 (set
    `config.replace(dtype='bfloat16')` for accelerators).

    Raises:
      ValueError naming the missing/unexpected/mis-shaped tensor and its file, the unsupported
      model_type, or the missing config field.

    A URL (gs://...) is copied to a local cache first (`qurl_jax.runtime.paths.local_copy`).
    """
    path = paths.local_copy(path)
    config = config_from_hf(_read_json(os.path.join(path, "config.json")))
    config = config.replace(param_dtype=jnp.dtype(dtype).name)
    tensors, sources = read_safetensors_dir(path)
    try:
        params = params_from_hf_state_dict(config, tensors, dtype, sources=sources)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
    return config, params


def save_hf(path: str | os.PathLike, config: ModelConfig, params: Params, tokenizer: Any = None,
            dtype: Any = None) -> None:
    """Writes a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.

    Files: `config.json`, `generation_config.json`, `model.safetensors` (one file, tensors in
    `dtype`, default float32) and, when a tokenizer is given, its files (`save_pretrained`).
    A URL (gs://...) is written locally first and then uploaded.
    """
    path = os.fspath(path)
    if paths.is_url(path):
        with tempfile.TemporaryDirectory() as local:
            save_hf(local, config, params, tokenizer=tokenizer, dtype=dtype)
            paths.upload_dir(local, path)
        return
    os.makedirs(path, exist_ok=True)
    np_dtype = np.dtype(jnp.dtype(jnp.float32 if dtype is None else dtype))
    tensors = params_to_hf_state_dict(config, params, np_dtype)
    hf = config_to_hf(config, torch_dtype=np_dtype.name)
    generation: dict[str, Any] = {}
    if tokenizer is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(tokenizer, key, None)
            if value is not None:
                hf[key] = generation[key] = value
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2, sort_keys=True)
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"),
                                metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def load_tokenizer(path: str | os.PathLike) -> Any:
    """`transformers.AutoTokenizer` from a model directory (a URL is copied to a local cache first;
    never the Hugging Face Hub), chat template included when the directory has one."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(paths.local_copy(path), local_files_only=True)


def to_transformers(config: ModelConfig, params: Params, *, attn_implementation: str = "eager",
                    **config_overrides: Any) -> Any:
    """A float32 `transformers` *ForCausalLM (torch) holding `params`, for parity tests and
    benchmarks; `config_overrides` replace config.json fields (e.g. eos_token_id=None)."""
    import torch
    import transformers

    hf = {**config_to_hf(config), **config_overrides}
    hf_config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation=attn_implementation).float().eval()
    state = {k: torch.from_numpy(np.array(v, np.float32))
             for k, v in params_to_hf_state_dict(config, params).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"to_transformers: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model
