"""GGUF import (`qurl_jax.models.gguf`): a tiny Llama file written with the `gguf` package's writer,
laid out as llama.cpp's converter lays it out (q/k rows in its rotary order, Q8_0 / Q4_1 matrices,
F32 norms, no `output.weight` when tied), must give the logits `transformers`' own GGUF loader
gives, and a tokenizer whose ids, decoding and chat rendering match the ones `transformers`
builds from the same file. Nothing is downloaded; the real model's test is
`test_gguf_real_model.py` (slow).
"""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import torch
import transformers

from qurl_jax.models import Transformer
from qurl_jax.models.gguf import config_from_gguf, load_gguf, load_gguf_tokenizer
from qurl_jax.models.hf import save_hf

VOCAB = 320
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 96, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS = ["Mia has 23 stickers. She gets 18 more. How many stickers does Mia have now?",
          "The answer is 41. Each of the boxes has 7 pencils, so Tom buys 28 pencils in all.",
          "Hello world! It's a tokenizer test: café, naïve, 3.14 and    spaces.\n\nNew line."] * 4


def _llama_cpp_order(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written here independently of the module)."""
    d = weight.shape[0] // heads
    return weight.reshape(heads, 2, d // 2, weight.shape[1]).swapaxes(1, 2).reshape(weight.shape)


def _bpe() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=list(SPECIALS), show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _weights(tied: bool, rng: np.random.RandomState) -> dict[str, np.ndarray]:
    """Hugging Face layout: name -> float32 [out, in]."""
    def w(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    out = {"model.embed_tokens.weight": w(VOCAB, HIDDEN),
           "model.norm.weight": 1 + w(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": 1 + w(HIDDEN),
                p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
                p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
                p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
                p + "mlp.up_proj.weight": w(FFN, HIDDEN),
                p + "mlp.down_proj.weight": w(HIDDEN, FFN)}
    if not tied:
        out["lm_head.weight"] = w(VOCAB, HIDDEN)
    return out


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _write(path, tied: bool = True, arch: str = "llama", pre: str = "gpt2") -> None:
    """A tiny Llama GGUF file as llama.cpp's converter and quantizer would write it."""
    tok = _bpe()
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == VOCAB
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, array in _weights(tied, np.random.RandomState(0)).items():
        if name == "model.embed_tokens.weight":
            gname, qtype = "token_embd.weight", gguf.GGMLQuantizationType.Q8_0
        elif name == "lm_head.weight":
            gname, qtype = "output.weight", gguf.GGMLQuantizationType.Q8_0
        elif name == "model.norm.weight":
            gname, qtype = "output_norm.weight", gguf.GGMLQuantizationType.F32
        else:
            i, module = name.split(".")[2], name.split(".", 3)[3].rsplit(".", 1)[0]
            gname = f"blk.{i}.{_GGUF_NAMES[module]}.weight"
            qtype = (gguf.GGMLQuantizationType.F32 if array.ndim == 1
                     else gguf.GGMLQuantizationType.Q4_1)
            if module == "self_attn.q_proj":
                array = _llama_cpp_order(array, HEADS)
            elif module == "self_attn.k_proj":
                array = _llama_cpp_order(array, KV_HEADS)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, array)
        else:
            w.add_tensor(gname, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write(path)
    return path


def _ours(config, params, tokens: np.ndarray) -> np.ndarray:
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    logits, _ = jax.jit(Transformer(config).apply)({"params": params}, jnp.asarray(tokens),
                                                   jnp.asarray(positions))
    return np.asarray(logits)


def _theirs(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _tokens() -> np.ndarray:
    return np.random.RandomState(1).randint(0, VOCAB, (2, 11)).astype(np.int32)


@pytest.mark.parametrize("tied", [True, False])
def test_logits_equal_transformers_gguf_load(tmp_path, tied):
    path = tmp_path / "m.gguf"
    _write(path, tied=tied)
    config, params = load_gguf(path)
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.head_dim, config.tie_word_embeddings) == (
        VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, tied)
    assert config_from_gguf(path) == config
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    tokens = _tokens()
    np.testing.assert_allclose(_ours(config, params, tokens), _theirs(model, tokens), atol=1e-4)


def test_rotary_rows_are_restored(tiny_gguf):
    """Without undoing llama.cpp's q/k order the logits would differ: the import's q rows are the
    Hugging Face rows (up to Q4_1 rounding), not the permuted ones."""
    _, params = load_gguf(tiny_gguf)
    q_hf = _weights(True, np.random.RandomState(0))["model.layers.0.self_attn.q_proj.weight"]
    ours = np.asarray(params["layers_0"]["self_attn"]["q_proj"]["kernel"]).T
    assert np.abs(ours - q_hf).max() < 0.05  # Q4_1 of N(0, 0.1): steps of ~0.03
    assert np.abs(ours - _llama_cpp_order(q_hf, HEADS)).max() > 0.1


def test_tokenizer_matches_transformers_and_trained_bpe(tiny_gguf):
    ours = load_gguf_tokenizer(tiny_gguf)
    theirs = transformers.AutoTokenizer.from_pretrained(tiny_gguf.parent,
                                                        gguf_file=tiny_gguf.name)
    trained = _bpe()
    for text in CORPUS[:3] + ["Zoe   gives 7 of them away.\n", "<|im_end|> x"]:
        ids = ours(text, add_special_tokens=False)["input_ids"]
        assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ids == trained.encode(text).ids, text
        assert ours.decode(ids) == text
    assert (ours.eos_token, ours.pad_token, ours.bos_token) == (SPECIALS[2], SPECIALS[0],
                                                                SPECIALS[1])
    messages = [{"role": "user", "content": "How many?"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nHow many?<|im_end|>\n<|im_start|>assistant\n"
    assert rendered == theirs.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
    assert ours(rendered, add_special_tokens=False)["input_ids"][0] == ours.bos_token_id


def test_smollm_pre_tokenizer_splits_digits(tmp_path):
    path = tmp_path / "s.gguf"
    _write(path, pre="smollm")
    tok = load_gguf_tokenizer(path)
    pieces = tok.convert_ids_to_tokens(tok("has 123 apples", add_special_tokens=False)["input_ids"])
    assert "1" in pieces and "2" in pieces and "3" in pieces


def test_export_loads_in_transformers_with_tokenizer(tmp_path, tiny_gguf):
    config, params = load_gguf(tiny_gguf)
    save_hf(tmp_path / "export", config, params, tokenizer=load_gguf_tokenizer(tiny_gguf))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export",
                                                              dtype=torch.float32).eval()
    tokens = _tokens()
    np.testing.assert_allclose(_ours(config, params, tokens), _theirs(model, tokens), atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    text = CORPUS[0]
    assert tok(text)["input_ids"] == load_gguf_tokenizer(tiny_gguf)(text)["input_ids"]
    assert tok.chat_template == TEMPLATE


def test_unsupported_architecture_names_the_field(tmp_path):
    path = tmp_path / "q.gguf"
    _write(path, arch="gpt2")
    with pytest.raises(ValueError, match="general.architecture='gpt2'"):
        load_gguf(path)


def test_unsupported_pre_tokenizer_names_the_field(tmp_path):
    path = tmp_path / "p.gguf"
    _write(path, pre="falcon")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre='falcon'"):
        load_gguf_tokenizer(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not gguf at all" * 10)
    with pytest.raises(ValueError, match="x.gguf"):
        load_gguf(path)


def test_tokenizer_needs_no_torch(tiny_gguf):
    code = ("import sys; sys.modules['torch'] = None\n"
            "from qurl_jax.models.gguf import load_gguf, load_gguf_tokenizer\n"
            f"load_gguf({str(tiny_gguf)!r})\n"
            f"t = load_gguf_tokenizer({str(tiny_gguf)!r})\n"
            "print(t.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "<|im_start|>user\nhi<|im_end|>" in out.stdout


def test_cli_rejects_missing_gguf_path(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "qurl_jax.main", "--config=configs/arith_tiny.py",
         f"--workdir={tmp_path}", "--config.model.source=gguf",
         f"--config.model.path={tmp_path / 'absent.gguf'}"],
        capture_output=True, text=True, check=False)
    assert out.returncode != 0
    assert "config.model.path=" in out.stderr and "absent.gguf" in out.stderr


def test_memory_plan_reads_the_shape_from_the_gguf_header(tiny_gguf, tmp_path):
    """`bench.memory` and the preflight plan a GGUF config from the file's metadata (no tensor
    read); a file that is not GGUF is one line naming the field and the file."""
    from qurl_jax.config.settings import ModelSettings
    from qurl_jax.plan.memory_plan import PlanError, model_shape

    settings = ModelSettings(source="gguf", path=str(tiny_gguf), dtype="float32")
    shape = model_shape(settings, str(tmp_path))
    assert (shape.vocab_size, shape.hidden_size, shape.num_layers, shape.num_kv_heads) == (
        VOCAB, HIDDEN, LAYERS, KV_HEADS)
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not gguf at all" * 10)
    with pytest.raises(PlanError, match=r"config.model.path: .*x.gguf"):
        model_shape(ModelSettings(source="gguf", path=str(bad)), str(tmp_path))
