"""Remote paths through fsspec (gs:// in production; fsspec's in-memory filesystem here): a model
directory, data files, an HF export and the run's resolved config, each given as a URL."""

import json

import fsspec
import jax
import numpy as np
import pytest

from qurl_jax.config import run_config
from qurl_jax.config.base import base_config, validate
from qurl_jax.data.datasets import load_math_file
from qurl_jax.data.tokenizer import build_char_tokenizer
from qurl_jax.models import ModelConfig, init_params
from qurl_jax.models.hf import load_hf, load_tokenizer, save_hf
from qurl_jax.runtime import paths

SMALL = ModelConfig(model_type="qwen2", attention_bias=True, vocab_size=61, hidden_size=32,
                    intermediate_size=40, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                    max_position_embeddings=64)


@pytest.fixture
def memory_root(monkeypatch, tmp_path):
    monkeypatch.setenv("QURL_JAX_CACHE", str(tmp_path / "cache"))
    root = f"memory://qurl-test-{tmp_path.name}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root.removeprefix("memory://")):
        fs.rm(root.removeprefix("memory://"), recursive=True)


def test_model_directory_round_trip_through_a_url(memory_root):
    params = init_params(SMALL, jax.random.key(0))
    url = f"{memory_root}/export"
    save_hf(url, SMALL, params, tokenizer=build_char_tokenizer())
    assert paths.isfile(paths.join(url, "config.json"))
    config, loaded = load_hf(url)
    assert config.hidden_size == SMALL.hidden_size
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert load_tokenizer(url).encode("1+2=") == build_char_tokenizer().encode("1+2=")
    # The second load reads the local copy: one copy per content.
    assert paths.local_copy(url) == paths.local_copy(url)


def test_validate_accepts_a_model_url_and_data_urls(memory_root):
    save_hf(f"{memory_root}/model", SMALL, init_params(SMALL, jax.random.key(0)))
    rows = [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "2+2?", "answer": "4"}]
    with fsspec.open(f"{memory_root}/train.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    c = base_config()
    c.model.path = f"{memory_root}/model"
    c.data.train_files = (f"{memory_root}/train.jsonl",)
    c.eval.files = (f"{memory_root}/train.jsonl",)
    c.data.max_prompt_len = c.rollout.max_new_tokens = c.eval.max_new_tokens = 32  # 64 positions
    validate(c)
    examples, stats = load_math_file(f"{memory_root}/train.jsonl")
    assert [e.answer for e in examples] == ["2", "4"] and stats.loaded == 2
    assert examples[0].source == "train"
    c.model.path = f"{memory_root}/missing"
    with pytest.raises(ValueError, match="does not exist"):
        validate(c)
    fsspec.filesystem("memory").makedirs(f"{memory_root}/empty", exist_ok=True)
    c.model.path = f"{memory_root}/empty"
    with pytest.raises(ValueError, match="has no config.json"):
        validate(c)


def test_resolved_config_saved_to_a_url_workdir(memory_root):
    c = base_config()
    run_config.check_and_save(c, f"{memory_root}/run", resuming=False)
    with fsspec.open(f"{memory_root}/run/config.json") as f:
        saved = json.load(f)
    assert saved["rl.cap"] == c.rl.cap and saved["data.train_files"] == list(c.data.train_files)
