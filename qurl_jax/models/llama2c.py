"""Reader for llama2.c checkpoints (e.g. the pretrained stories260K model) into our params pytree.

The llama2.c "version 0" format is a header of 7 little-endian int32 (dim, hidden_dim, n_layers,
n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means an untied classifier follows)
and then float32 arrays in a fixed order, Linear weights [out, in] stacked over layers, plus two
RoPE tables. llama2.c rotates interleaved pairs (2i, 2i+1) whereas our model (like Hugging Face)
rotates halves (i, i + head_dim/2), so the rows of wq and wk are permuted within each head; q.k is
unchanged because queries and keys get the same permutation. The result goes through the Hugging
Face name mapping, so a stories260K model is an ordinary `llama` config with tied embeddings.
"""

from __future__ import annotations

import os

import numpy as np

from qurl_jax.models.config import ModelConfig
from qurl_jax.models.hf import Params, params_from_hf_state_dict

_HEADER_INTS = 7
_ROPE_THETA = 10000.0
_RMS_NORM_EPS = 1e-5


def interleaved_to_half_rotation(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Permutes Linear rows [H*D, in] per head from interleaved-pair to half-rotation RoPE order.

    Within each head, row 2i (real part of pair i) goes to row i and row 2i+1 to row i + D/2.
    """
    out_features, in_features = w.shape
    d = out_features // num_heads
    return (w.reshape(num_heads, d // 2, 2, in_features).transpose(0, 2, 1, 3)
            .reshape(out_features, in_features))


def _config_from_header(path: str, header: np.ndarray) -> ModelConfig:
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = (int(x) for x in header)
    for name, value in (("dim", dim), ("hidden_dim", hidden), ("n_layers", n_layers),
                        ("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("seq_len", seq_len)):
        if value <= 0:
            raise ValueError(f"{path}: header field {name}={value} must be positive")
    if vocab == 0 or dim % n_heads:
        raise ValueError(f"{path}: bad header (vocab_size={vocab}, dim={dim}, n_heads={n_heads})")
    return ModelConfig(
        model_type="llama",
        vocab_size=abs(vocab),
        hidden_size=dim,
        intermediate_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv_heads,
        head_dim=dim // n_heads,
        rope_theta=_ROPE_THETA,
        rms_norm_eps=_RMS_NORM_EPS,
        tie_word_embeddings=vocab > 0,
        max_position_embeddings=seq_len,
    ).validate()


def _array_shapes(cfg: ModelConfig, seq_len: int) -> list[tuple[str, tuple[int, ...]]]:
    """The float32 arrays after the header, in file order."""
    e, m, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q, kv, half = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim // 2
    shapes = [
        ("token_embedding", (v, e)), ("rms_att", (n, e)), ("wq", (n, q, e)), ("wk", (n, kv, e)),
        ("wv", (n, kv, e)), ("wo", (n, e, q)), ("rms_ffn", (n, e)), ("w1", (n, m, e)),
        ("w2", (n, e, m)), ("w3", (n, m, e)), ("rms_final", (e,)),
        ("freq_cis_real", (seq_len, half)), ("freq_cis_imag", (seq_len, half)),
    ]
    if not cfg.tie_word_embeddings:
        shapes.append(("wcls", (v, e)))
    return shapes


def load_llama2c(path: str | os.PathLike) -> tuple[ModelConfig, Params]:
    """Reads a llama2.c checkpoint -> (llama ModelConfig, float32 params pytree).

    Raises:
      ValueError naming the file when the size does not match the header, the header is invalid,
      or the stored RoPE tables disagree with theta=10000 (a RoPE we would otherwise silently
      get wrong).
    """
    path = os.fspath(path)
    raw = np.fromfile(path, dtype="<i4", count=_HEADER_INTS)
    if raw.size != _HEADER_INTS:
        raise ValueError(f"{path}: too short for a llama2.c header ({raw.size * 4} bytes)")
    cfg = _config_from_header(path, raw)
    seq_len = int(raw[6])
    shapes = _array_shapes(cfg, seq_len)
    n_floats = sum(int(np.prod(s)) for _, s in shapes)
    expected = 4 * (_HEADER_INTS + n_floats)
    actual = os.path.getsize(path)
    if actual != expected:
        raise ValueError(
            f"{path}: file size {actual} bytes does not match the llama2.c header "
            f"(dim={cfg.hidden_size}, hidden_dim={cfg.intermediate_size}, "
            f"n_layers={cfg.num_layers}, "
            f"n_heads={cfg.num_heads}, n_kv_heads={cfg.num_kv_heads}, vocab_size={int(raw[5])}, "
            f"seq_len={seq_len}), which implies {expected} bytes"
        )
    flat = np.fromfile(path, dtype="<f4", offset=4 * _HEADER_INTS)
    arrays: dict[str, np.ndarray] = {}
    start = 0
    for name, shape in shapes:
        size = int(np.prod(shape))
        arrays[name] = flat[start:start + size].reshape(shape)
        start += size

    half = cfg.head_dim // 2
    inv_freq = 1.0 / _ROPE_THETA ** (np.arange(half) * 2.0 / cfg.head_dim)
    angles = np.arange(seq_len)[:, None] * inv_freq[None]
    if not (np.allclose(arrays["freq_cis_real"], np.cos(angles), atol=1e-3)
            and np.allclose(arrays["freq_cis_imag"], np.sin(angles), atol=1e-3)):
        raise ValueError(f"{path}: stored RoPE tables do not match rope_theta={_ROPE_THETA}")

    tensors = {"model.embed_tokens.weight": arrays["token_embedding"],
               "model.norm.weight": arrays["rms_final"]}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        tensors.update({
            f"{p}.input_layernorm.weight": arrays["rms_att"][i],
            f"{p}.post_attention_layernorm.weight": arrays["rms_ffn"][i],
            f"{p}.self_attn.q_proj.weight": interleaved_to_half_rotation(arrays["wq"][i],
                                                                         cfg.num_heads),
            f"{p}.self_attn.k_proj.weight": interleaved_to_half_rotation(arrays["wk"][i],
                                                                         cfg.num_kv_heads),
            f"{p}.self_attn.v_proj.weight": arrays["wv"][i],
            f"{p}.self_attn.o_proj.weight": arrays["wo"][i],
            f"{p}.mlp.gate_proj.weight": arrays["w1"][i],
            f"{p}.mlp.down_proj.weight": arrays["w2"][i],
            f"{p}.mlp.up_proj.weight": arrays["w3"][i],
        })
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = arrays["wcls"]
    return cfg, params_from_hf_state_dict(cfg, tensors, np.float32)
