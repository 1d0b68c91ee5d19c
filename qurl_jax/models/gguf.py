"""GGUF files (llama.cpp's format): a Llama model's config, weights and tokenizer, without torch.

`load_gguf(path)` gives (ModelConfig, params) like `qurl_jax.models.hf.load_hf`: the file is read
with the `gguf` package (llama.cpp's own reader, numpy only), every tensor is dequantized to float32
(`gguf.quants.dequantize`: Q4_0/Q4_1/Q8_0/K-quants/F16/BF16/F32, whatever the package supports),
llama.cpp's tensor names are mapped to Hugging Face names, and the row permutation llama.cpp's
converter applies to `attn_q` / `attn_k` (its rotary layout pairs dimensions (2i, 2i+1) of a head;
Hugging Face pairs (i, i + head_dim/2)) is undone, with the query heads for q and the key/value
heads for k. The Hugging Face state dict then goes through `params_from_hf_state_dict`, so a missing
or mis-shaped tensor is named the same way. A file without `output.weight` has its head tied to the
embedding.

`load_gguf_tokenizer(path)` builds the tokenizer from the file's metadata with the `tokenizers`
library (byte-level BPE from `tokenizer.ggml.tokens` / `merges`, the pre-tokenizer that
`tokenizer.ggml.pre` names, control tokens as special tokens, the chat template from
`tokenizer.chat_template`) and wraps it in `transformers.PreTrainedTokenizerFast`. `transformers`'
own GGUF tokenizer loader is not used: in transformers 5.x it imports torch, and it splits digits
differently from SmolLM's tokenizer (it has no rule for the 'smollm' pre-tokenizer).

Only `general.architecture = llama` files are read (Llama, SmolLM, Mistral-as-llama); anything
else is a ValueError naming the file and the field.
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from qurl_jax.models.config import ModelConfig, RopeScaling
from qurl_jax.models.hf import Params, params_from_hf_state_dict

ARCHITECTURES = ("llama",)
# `tokenizer.ggml.pre` values whose splitting rule is built here.
PRE_TOKENIZERS = ("default", "gpt2", "smollm")

# llama.cpp block tensor -> Hugging Face module under `model.layers.{i}`.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_CONTROL_TOKEN = 3  # llama.cpp's token type CONTROL (special tokens such as <|im_end|>)


def hf_tensor_name(name: str) -> str | None:
    """llama.cpp tensor name -> Hugging Face name, or None when it has none."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


def to_gguf_rotary_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face q/k projection rows [heads * head_dim, ...] -> llama.cpp's interleaved rotary
    order (what its converter writes): within each head, row i of the first half and row i of the
    second half become rows 2i and 2i+1."""
    rows = weight.shape[0]
    return (weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def from_gguf_rotary_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of `to_gguf_rotary_order`: llama.cpp's q/k rows -> Hugging Face's."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _reader(path: str | os.PathLike) -> Any:
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError) as err:
        raise ValueError(f"{path}: not a readable GGUF file: {err}") from err


def _value(reader: Any, path: str, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ValueError(f"{path}: missing metadata field {key!r}")
        return default
    return field.contents()


def _config(reader: Any, path: str, tensor_names: set[str]) -> ModelConfig:
    arch = _value(reader, path, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported; supported: "
                         f"{list(ARCHITECTURES)}")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(f"{path}: tensor 'rope_freqs.weight' (llama3 RoPE scaling) is not "
                         "supported")
    heads = int(_value(reader, path, f"{arch}.attention.head_count"))
    hidden = int(_value(reader, path, f"{arch}.embedding_length"))
    head_dim = int(_value(reader, path, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(_value(reader, path, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count={rope_dim} differs from the head "
                         f"size {head_dim} (partial rotary is not supported)")
    scaling_type = _value(reader, path, f"{arch}.rope.scaling.type", "none")
    scaling = None
    if scaling_type == "linear":
        scaling = RopeScaling(rope_type="linear",
                              factor=float(_value(reader, path, f"{arch}.rope.scaling.factor")))
    elif scaling_type not in ("none", ""):
        raise ValueError(f"{path}: {arch}.rope.scaling.type={scaling_type!r} is not supported")
    vocab = _value(reader, path, f"{arch}.vocab_size", None)
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    try:
        return ModelConfig(
            model_type="llama",
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(_value(reader, path, f"{arch}.feed_forward_length")),
            num_layers=int(_value(reader, path, f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(_value(reader, path, f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rope_theta=float(_value(reader, path, f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rms_norm_eps=float(_value(reader, path, f"{arch}.attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in tensor_names,
            max_position_embeddings=int(_value(reader, path, f"{arch}.context_length", 2048)),
        ).validate()
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from err


def config_from_gguf(path: str | os.PathLike) -> ModelConfig:
    """The file's ModelConfig from its metadata (no tensor is dequantized)."""
    reader = _reader(path)
    return _config(reader, os.fspath(path), {t.name for t in reader.tensors})


def read_gguf_tensors(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(ModelConfig, Hugging Face name -> float32 array [out, in]) of a GGUF file: dequantized,
    renamed, q/k rows back in Hugging Face's rotary order. ValueError naming the file and the
    tensor for an unknown tensor name or a type the `gguf` package cannot dequantize."""
    import gguf

    path = os.fspath(path)
    reader = _reader(path)
    config = _config(reader, path, {t.name for t in reader.tensors})
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            raise ValueError(f"{path}: tensor {t.name!r} has no Llama equivalent")
        try:
            array = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        except NotImplementedError as err:
            raise ValueError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which "
                             f"the gguf package cannot dequantize") from err
        # numpy order is ggml's shape reversed: [out, in] for matrices, as in Hugging Face.
        array = array.reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name.endswith("attn_q.weight"):
            array = from_gguf_rotary_order(array, config.num_heads)
        elif t.name.endswith("attn_k.weight"):
            array = from_gguf_rotary_order(array, config.num_kv_heads)
        tensors[name] = array
    return config, tensors


def load_gguf(path: str | os.PathLike, dtype: Any = jnp.float32) -> tuple[ModelConfig, Params]:
    """Reads a Llama GGUF file -> (ModelConfig, params in `dtype`), like `load_hf`: the config's
    `param_dtype` is `dtype`, its compute dtype float32. ValueError naming the file and the field
    or tensor that cannot be read."""
    path = os.fspath(path)
    config, tensors = read_gguf_tensors(path)
    config = config.replace(param_dtype=jnp.dtype(dtype).name)
    try:
        params = params_from_hf_state_dict(config, tensors, dtype)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
    return config, params


def _pre_tokenizer(pre: str, path: str) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        return byte_level
    if pre == "smollm":  # every digit its own piece, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    raise ValueError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
                     f"{list(PRE_TOKENIZERS)}")


def load_gguf_tokenizer(path: str | os.PathLike) -> Any:
    """A `transformers.PreTrainedTokenizerFast` built from the file's tokenizer metadata (byte-level
    BPE, `tokenizer.ggml.model = gpt2`), with its bos/eos/pad tokens and chat template. Needs no
    torch. ValueError naming the file and the field of an unsupported tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    path = os.fspath(path)
    reader = _reader(path)
    kind = _value(reader, path, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (only 'gpt2', "
                         "byte-level BPE)")
    tokens = list(_value(reader, path, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _value(reader, path, "tokenizer.ggml.merges")]
    types = list(_value(reader, path, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens repeats a token")
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(_value(reader, path, "tokenizer.ggml.pre", "default"),
                                           path)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == _CONTROL_TOKEN])

    def token(key: str) -> str | None:
        index = _value(reader, path, key, None)
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise ValueError(f"{path}: {key}={index} is outside the {len(tokens)}-token vocabulary")
        return tokens[int(index)]

    bos = token("tokenizer.ggml.bos_token_id")
    if _value(reader, path, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, vocab[bos])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"), clean_up_tokenization_spaces=False)
    template = _value(reader, path, "tokenizer.chat_template", None)
    if template:
        tokenizer.chat_template = template
    return tokenizer
