"""The llama2.c reader on the real pretrained stories260K checkpoint.

Two independent references: (1) the same weights converted inside this test (own parsing, own
RoPE row permutation) and loaded into `transformers.LlamaForCausalLM`; (2) a float64 numpy forward
pass written in llama2.c's own convention (interleaved-pair RoPE on the unpermuted weights), which
would catch a wrong permutation that (1) shares with the loader.
"""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from qurl_jax.models import ModelConfig, Transformer
from qurl_jax.models.llama2c import load_llama2c

# The shared read-only checkpoint beside the repository (realpath: also right from Bazel runfiles).
CHECKPOINT = os.environ.get("QURL_STORIES260K", os.path.join(
    os.path.dirname(os.path.realpath(__file__)), "..", "..", "shared", "models", "stories260K",
    "stories260K.bin"))
pytestmark = pytest.mark.skipif(not os.path.exists(CHECKPOINT), reason="stories260K.bin absent")

# The header values documented in the checkpoint's README.
DIM, HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, SEQ_LEN = 64, 172, 5, 8, 4, 512, 512
HEAD_DIM = DIM // HEADS


def _raw_arrays() -> dict[str, np.ndarray]:
    """The float32 arrays of the file, in README order, as float64."""
    shapes = [("emb", (VOCAB, DIM)), ("rms_att", (LAYERS, DIM)),
              ("wq", (LAYERS, HEADS * HEAD_DIM, DIM)), ("wk", (LAYERS, KV_HEADS * HEAD_DIM, DIM)),
              ("wv", (LAYERS, KV_HEADS * HEAD_DIM, DIM)), ("wo", (LAYERS, DIM, HEADS * HEAD_DIM)),
              ("rms_ffn", (LAYERS, DIM)), ("w1", (LAYERS, HIDDEN, DIM)),
              ("w2", (LAYERS, DIM, HIDDEN)), ("w3", (LAYERS, HIDDEN, DIM)), ("rms_final", (DIM,))]
    flat = np.fromfile(CHECKPOINT, dtype="<f4", offset=28).astype(np.float64)
    out, start = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        out[name] = flat[start:start + n].reshape(shape)
        start += n
    return out


def _to_half_rotation(w: np.ndarray, heads: int) -> np.ndarray:
    """Row order per head: all even rows (pair reals) first, then all odd rows."""
    rows = [h * HEAD_DIM + r for h in range(heads)
            for r in [*range(0, HEAD_DIM, 2), *range(1, HEAD_DIM, 2)]]
    return w[rows]


def _transformers_model() -> transformers.LlamaForCausalLM:
    a = _raw_arrays()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
        max_position_embeddings=SEQ_LEN, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation="eager")
    state = {"model.embed_tokens.weight": a["emb"], "model.norm.weight": a["rms_final"],
             "lm_head.weight": a["emb"]}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": a["rms_att"][i],
            p + "post_attention_layernorm.weight": a["rms_ffn"][i],
            p + "self_attn.q_proj.weight": _to_half_rotation(a["wq"][i], HEADS),
            p + "self_attn.k_proj.weight": _to_half_rotation(a["wk"][i], KV_HEADS),
            p + "self_attn.v_proj.weight": a["wv"][i],
            p + "self_attn.o_proj.weight": a["wo"][i],
            p + "mlp.gate_proj.weight": a["w1"][i],
            p + "mlp.down_proj.weight": a["w2"][i],
            p + "mlp.up_proj.weight": a["w3"][i],
        })
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict({k: torch.tensor(v, dtype=torch.float32) for k, v in state.items()})
    return model


def _interleaved_reference(tokens: np.ndarray) -> np.ndarray:
    """float64 logits [T, V] of one unpadded sequence, llama2.c conventions, unpermuted weights."""
    a = _raw_arrays()
    t = len(tokens)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w

    angle = np.arange(t)[:, None, None] * 10000.0 ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    cos, sin = np.cos(angle), np.sin(angle)

    def rope(v):  # [T, H, D]; rotate the pair (2i, 2i+1) by angle i
        even, odd = v[..., 0::2], v[..., 1::2]
        out = np.empty_like(v)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    causal = np.tril(np.ones((t, t), bool))
    x = a["emb"][tokens]
    for i in range(LAYERS):
        h = rms(x, a["rms_att"][i])
        q = rope((h @ a["wq"][i].T).reshape(t, HEADS, HEAD_DIM))
        k = np.repeat(rope((h @ a["wk"][i].T).reshape(t, KV_HEADS, HEAD_DIM)), 2, axis=1)
        v = np.repeat((h @ a["wv"][i].T).reshape(t, KV_HEADS, HEAD_DIM), 2, axis=1)
        s = np.where(causal, np.einsum("thd,shd->hts", q, k) / np.sqrt(HEAD_DIM), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", p, v).reshape(t, DIM) @ a["wo"][i].T
        h = rms(x, a["rms_ffn"][i])
        gate = h @ a["w1"][i].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ a["w3"][i].T)) @ a["w2"][i].T
    return rms(x, a["rms_final"]) @ a["emb"].T


def _ours(config, params, tokens, mask, positions) -> np.ndarray:
    logits, _ = jax.jit(Transformer(config).apply)({"params": params}, jnp.asarray(tokens),
                                                   jnp.asarray(positions), jnp.asarray(mask))
    return np.asarray(logits)


def _batch():
    rng = np.random.RandomState(0)
    lengths = [20, 11]
    mask = np.array([[j >= 20 - n for j in range(20)] for n in lengths])
    tokens = np.where(mask, rng.randint(1, VOCAB, (2, 20)), 0).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, mask, positions


def test_config_from_header():
    config, _ = load_llama2c(CHECKPOINT)
    assert config == ModelConfig(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=172, num_layers=5,
        num_heads=8, num_kv_heads=4, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, max_position_embeddings=512)


def test_stories260k_matches_transformers_llama():
    config, params = load_llama2c(CHECKPOINT)
    tokens, mask, positions = _batch()
    ours = _ours(config, params, tokens, mask, positions)
    with torch.no_grad():
        theirs = _transformers_model()(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(positions, dtype=torch.long)).logits.numpy()
    diff = np.abs(ours - theirs)[mask]
    assert diff.max() < 1e-4, diff.max()
    assert np.abs(theirs[mask]).max() > 1.0


def test_stories260k_matches_interleaved_rope_reference():
    config, params = load_llama2c(CHECKPOINT)
    tokens, mask, positions = _batch()
    ours = _ours(config, params, tokens, mask, positions)
    for row in range(2):
        reference = _interleaved_reference(tokens[row][mask[row]])
        np.testing.assert_allclose(ours[row][mask[row]], reference, atol=1e-4)


def test_trained_model_predicts_its_own_text_well():
    """A trained model is confident on its own greedy continuation; random weights are not."""
    config, params = load_llama2c(CHECKPOINT)
    tokens = [1]
    for _ in range(24):
        logits = _interleaved_reference(np.array(tokens))
        tokens.append(int(logits[-1].argmax()))
    seq = np.array([tokens], np.int32)
    logits = _ours(config, params, seq, np.ones_like(seq, bool), np.arange(seq.shape[1])[None])
    logp = jax.nn.log_softmax(logits[0, :-1], axis=-1)
    nll = -float(np.mean(np.take_along_axis(np.asarray(logp), seq[0, 1:, None], axis=-1)))
    assert nll < 0.5 * np.log(VOCAB), nll


@pytest.mark.parametrize("delta", [-4, 4])
def test_wrong_file_size_is_named(tmp_path, delta):
    bad = tmp_path / "broken.bin"
    data = open(CHECKPOINT, "rb").read()
    bad.write_bytes(data[:delta] if delta < 0 else data + b"\0" * delta)
    with pytest.raises(ValueError, match=rf"broken\.bin: file size {len(data) + delta} bytes .* "
                                         rf"implies {len(data)} bytes"):
        load_llama2c(bad)


def test_truncated_header_is_named(tmp_path):
    bad = tmp_path / "tiny.bin"
    shutil.copyfile(CHECKPOINT, bad)
    bad.write_bytes(bad.read_bytes()[:12])
    with pytest.raises(ValueError, match=r"tiny\.bin: too short"):
        load_llama2c(bad)
