"""LoRA on a frozen quantized base (`qurl_jax.lora`): b = 0 is the base exactly, an update moves
only the adapter, the rollout and the learner read the very same base arrays, a rollout with a
stale adapter stops the run, resume is exact, a LoRA checkpoint and a full fine-tune's refuse
each other, the config's checks, remat 'projections' keeping the W8A8 products out of the
backward, and the PEFT export against `peft` (slow: needs torch)."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax import lora, quant
from qurl_jax.config.base import validate
from qurl_jax.config.settings import RunSettings
from qurl_jax.learner.learner import Learner, OptimConfig
from qurl_jax.models import ModelConfig, Transformer, init_params
from qurl_jax.parallel import sharding as shd
from qurl_jax.plan import memory_plan
from qurl_jax.rl.objectives import ObjectiveConfig
from qurl_jax.runtime.checkpoint import CheckpointMismatchError
from qurl_jax.runtime.errors import ConfigError
from qurl_jax.train.evaluation import evaluate_run
from qurl_jax.train.trainer import Trainer
from tests.test_learner import _batch
from tests.test_trainer import tiny_config

CFG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True,
                  tie_word_embeddings=True)
LORA = lora.LoraConfig(rank=4, alpha=8.0)
INT8 = quant.get_recipe("int8", quantize_vocab=True)


def _base_and_adapter(b_scale: float = 0.0, cfg: lora.LoraConfig = LORA, recipe=INT8):
    params = init_params(CFG, jax.random.key(0))
    base = lora.quantize_base(params, cfg, recipe, jnp.float32)
    adapter = lora.init_adapter(jax.random.key(1), params, cfg)
    if b_scale:  # a trained-looking adapter: b != 0
        adapter = jax.tree.map(lambda x: x, adapter)
        for i, module in enumerate(lora.target_paths(params, cfg)):
            node = lora.adapter_at(adapter, module)
            node["b"] = b_scale * jax.random.normal(jax.random.key(10 + i), node["b"].shape)
    return params, base, adapter


def _logits(dot, params):
    tokens = jnp.arange(14).reshape(2, 7) % CFG.vocab_size
    positions = jnp.tile(jnp.arange(7), (2, 1))
    return Transformer(CFG, dot).apply({"params": params}, tokens, positions)[0]


def test_zero_b_gives_the_base_logits_exactly():
    params, base, adapter = _base_and_adapter()
    assert len(lora.target_paths(params, LORA)) == 2 * 7
    # The rollout: the recipe's W8A8 products, with and without the adapters.
    with_adapter = _logits(lora.dot_general(quant.rollout_dot_general),
                           lora.attach(base, adapter, LORA.scale))
    np.testing.assert_array_equal(with_adapter, _logits(quant.rollout_dot_general, base))
    # The learner: the same codes weight-only.
    inner = lora.learner_products(jax.lax.dot_general)
    weight_only = lora.weight_only(base)
    np.testing.assert_array_equal(
        _logits(lora.dot_general(inner), lora.attach(weight_only, adapter, LORA.scale)),
        _logits(inner, weight_only))
    # The base's quantization is requantize's: the same codes and scales.
    np.testing.assert_array_equal(
        base["layers_1"]["mlp"]["up_proj"]["kernel"].qvalue,
        quant.requantize(params, INT8)["layers_1"]["mlp"]["up_proj"]["kernel"].qvalue)


def test_w8a8_learner_is_the_rollouts_product_with_an_int8_input_gradient():
    """learner_products='w8a8': at b = 0 the learner's logits are the rollout's W8A8 logits
    bit for bit (the same product of the same codes); the input gradient is the int8 product
    of dy diag(s) and the codes, within int8 rounding of the float one, zero for a zero row, and
    the frozen kernel gets no gradient."""
    _, base, adapter = _base_and_adapter()
    learner = lora.dot_general(lora.learner_products(jax.lax.dot_general))
    np.testing.assert_array_equal(
        _logits(learner, lora.attach(lora.learner_base(base, "w8a8"), adapter, LORA.scale)),
        _logits(quant.rollout_dot_general, base))
    kernel = base["layers_0"]["mlp"]["up_proj"]["kernel"]  # int8 [32, 64], W8A8
    assert lora.is_w8a8_linear(kernel) and lora.learner_base(base, "w8a8") is base
    x = jax.random.normal(jax.random.key(2), (6, 32))
    dy = jax.random.normal(jax.random.key(3), (6, 64)).at[2].set(0.0)
    y, vjp = jax.vjp(lora.w8a8_linear, x, kernel)
    np.testing.assert_array_equal(y, quant.rollout_dot_general(x, kernel, (((1,), (0,)),
                                                                           ((), ()))))
    dx, dkernel = vjp(dy)
    exact = np.asarray(dy) @ np.asarray(kernel.dequantize()).T
    assert np.all(np.asarray(dx)[2] == 0.0)
    err = np.abs(np.asarray(dx) - exact).max(axis=1) / np.abs(exact).max(axis=1).clip(1e-30)
    assert 0 < err.max() < 0.02  # int8 rounding of dy diag(s), per token
    assert not np.any(np.asarray(dkernel.scale))


def test_projections_remat_keeps_the_w8a8_products_out_of_the_recomputation():
    """remat 'projections' keeps each projection's output by name, so a W8A8 learner's backward
    runs every int8 base product twice (forward, input gradient), as with no remat, where 'dots'
    and 'full' run the forward's again (DOTS' rule does not see a product behind a custom VJP);
    the gradient is remat 'none''s."""
    _, base, adapter = _base_and_adapter(b_scale=0.1)
    dot = lora.dot_general(lora.learner_products(jax.lax.dot_general))
    tokens = jnp.arange(14).reshape(2, 7) % CFG.vocab_size
    positions = jnp.tile(jnp.arange(7), (2, 1))
    grads, int8_products = {}, {}
    for remat in ("none", "projections", "dots", "full"):
        model = Transformer(CFG, dot, remat=remat, scan_layers=True)

        def loss(a, model=model):
            logits = model.apply({"params": lora.attach(base, a, LORA.scale)}, tokens,
                                 positions)[0]
            return jnp.sum(jax.nn.log_softmax(logits)[..., 3])

        grad = jax.jit(jax.grad(loss))
        hlo = grad.lower(adapter).compile().as_text()
        int8_products[remat] = len(re.findall(r"= s32\[[^\]]*\]\{[^}]*\} dot\(", hlo))
        grads[remat] = grad(adapter)
    per_layer = 7  # q, k, v, o, gate, up, down: one scanned layer body
    assert int8_products["none"] == int8_products["projections"] == 2 * per_layer
    # The forward's products again, all but down_proj's (its output feeds only the residual).
    assert int8_products["dots"] == int8_products["full"] == 3 * per_layer - 1
    for a, b in zip(jax.tree.leaves(grads["projections"]), jax.tree.leaves(grads["none"]),
                    strict=True):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_attach_keeps_the_base_arrays_and_the_adapter_adds_its_product():
    params, base, adapter = _base_and_adapter(b_scale=0.1)
    attached = lora.attach(base, adapter, LORA.scale)
    kernel = attached["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert kernel.base is base["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert lora.weight_only(base)["layers_0"]["mlp"]["down_proj"]["kernel"].qvalue is \
        base["layers_0"]["mlp"]["down_proj"]["kernel"].qvalue
    # y = x W + (x a) b * alpha / r, with W the float base: against the merged kernel.
    float_cfg = lora.LoraConfig(rank=4, alpha=8.0, base_precision="compute")
    params, base, adapter = _base_and_adapter(b_scale=0.1, cfg=float_cfg,
                                              recipe=quant.get_recipe("fp"))
    merged = lora.merge(base, adapter, float_cfg.scale)
    np.testing.assert_allclose(
        _logits(lora.dot_general(jax.lax.dot_general),
                lora.attach(base, adapter, float_cfg.scale)),
        _logits(jax.lax.dot_general, merged), atol=2e-5)
    assert not np.allclose(_logits(jax.lax.dot_general, merged),
                           _logits(jax.lax.dot_general, params), atol=1e-3)


@pytest.mark.parametrize("products", lora.LEARNER_PRODUCTS)
def test_one_update_changes_only_the_adapter(products):
    _, base, adapter = _base_and_adapter()
    mesh = shd.make_mesh(1, 1, 1)
    learner = Learner(CFG, ObjectiveConfig(), OptimConfig(learning_rate=1e-2), mesh,
                      temperature=0.9, lora=dataclasses.replace(LORA, learner_products=products))
    before = jax.tree.map(np.asarray, base)
    adapter = learner.shard_params(adapter)
    a0 = jax.tree.map(np.asarray, adapter)
    opt_state = learner.init_opt_state(adapter)
    batch = learner.shard_batch(_batch(0))
    batch["logp_prox"] = learner.logprobs(adapter, batch, base)
    new, _, metrics = learner.update(adapter, opt_state, batch, base)
    assert float(metrics["update/skipped"]) == 0.0
    changed = jax.tree.map(lambda x, y: bool(np.any(np.asarray(x) != y)), new, a0)
    assert all(jax.tree.leaves(changed))  # every a and b moved (b from zero)
    assert jax.tree.structure(new) == jax.tree.structure(a0)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, base), before)


def _lora_config(**overrides):
    c = tiny_config(**overrides)
    c.model.lora.rank = 4
    c.rl.num_minibatches = 1
    return c


def test_rollout_and_learner_read_the_same_base_arrays_and_a_stale_adapter_stops(tmp_path):
    c = _lora_config()
    c.model.lora.learner_products = "w8a8"  # the learner runs the rollout's own product
    t = Trainer(c, str(tmp_path))
    seen = {}
    sample, update = t.sampler.sample, t.learner.update

    def spy_sample(params, *args, **kwargs):
        seen["rollout"] = params
        return sample(params, *args, **kwargs)

    def spy_update(params, opt_state, batch, frozen=None):
        seen["learner"] = frozen
        return update(params, opt_state, batch, frozen)

    t.sampler.sample, t.learner.update = spy_sample, spy_update
    first = jax.tree.map(jnp.copy, t.params)
    t.step()
    rollout = jax.tree.leaves(seen["rollout"])
    learner = jax.tree.leaves(seen["learner"])
    base_ids = {id(x) for x in learner}
    assert {id(x) for x in jax.tree.leaves(t.base)} == base_ids
    assert base_ids <= {id(x) for x in rollout}  # identity, not equal copies
    assert any(x.dtype == jnp.int8 for x in learner), "the base holds int8 codes"
    # The adapter moved in step 1 (its update, or AdamW's weight decay alone); a rollout that
    # never got the new one stops the run before the update.
    t._adapter_on_rollout = lambda adapter: first
    with pytest.raises(RuntimeError, match="not the learner's of this step"):
        t.step()


def _steps_and_save(trainer: Trainer, steps: int) -> Trainer:
    for _ in range(steps):
        trainer.step()
    trainer._save(force=True)
    trainer.checkpointer.close()
    return trainer


def test_resume_is_exact_and_checkpoints_hold_only_the_adapter(tmp_path):
    straight = _steps_and_save(Trainer(_lora_config(), str(tmp_path / "straight")), 2)
    _steps_and_save(Trainer(_lora_config(), str(tmp_path / "resumed")), 1)
    resumed = Trainer(_lora_config(), str(tmp_path / "resumed"))
    assert resumed.step_count == 1
    resumed.step()
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, straight.params),
                 jax.tree.map(np.asarray, resumed.params))
    assert set(resumed._abstract_state()) == {"adapter", "opt_state"}
    # `python -m qurl_jax.evaluate` rebuilds the same policy from the checkpoint: the trainer's
    # evaluation of step 2, reproduced.
    step, metrics = evaluate_run(_lora_config(), str(tmp_path / "straight"))
    assert step == 2 and metrics == straight.evaluate()
    # A full fine-tune's config refuses the LoRA checkpoint, in one line.
    with pytest.raises(CheckpointMismatchError, match="holds a LoRA adapter .* but this run "
                       "trains a full fine-tune's parameters") as e:
        Trainer(tiny_config(**{"rl.num_minibatches": 1}), str(tmp_path / "straight"))
    assert "\n" not in str(e.value)


def test_a_full_checkpoint_refuses_a_lora_config(tmp_path):
    _steps_and_save(Trainer(tiny_config(**{"rl.num_minibatches": 1}), str(tmp_path)), 1)
    with pytest.raises(CheckpointMismatchError, match="holds a full fine-tune's parameters "
                       ".* but this run trains a LoRA adapter"):
        Trainer(_lora_config(), str(tmp_path))


@pytest.mark.parametrize("field,value,match", [
    ("model.lora.base_precision", "fp8", "does not match config.rollout.precision='int8'"),
    ("train.precision", "fp8_block", "config.train.precision='fp8_block': a LoRA run"),
    ("rollout.invariant_scaling", 1.5, "config.rollout.invariant_scaling=1.5"),
    ("model.lora.targets", ("qkv_proj",), "match no projection"),
    ("model.lora.base_precision", "int4", "not one of"),
    ("model.lora.learner_products", "int4", "learner_products='int4' is not one of"),
    ("rollout.precision", "int8_weight_only", "learner_products='w8a8' runs the learner on"),
])
def test_bad_lora_settings_name_the_field(field, value, match):
    c = _lora_config()
    c.model.lora.learner_products = "w8a8"  # the int8 W8A8 rollout's own product
    section, *rest = field.split(".")
    node = c[section]
    for name in rest[:-1]:
        node = node[name]
    node[rest[-1]] = value
    with pytest.raises((ConfigError, ValueError), match=match):
        if field == "model.lora.targets":
            lora.target_paths(init_params(CFG, jax.random.key(0)),
                              RunSettings.from_config(validate(c)).model.lora)
        else:
            validate(c)


def test_the_memory_plan_runs_no_requantize_or_reshard():
    c = validate(_lora_config())
    programs = memory_plan.run_programs(RunSettings.from_config(c))
    assert "requantize" not in programs and "reshard" not in programs
    assert "learner_update" in programs and "rollout_decode" in programs


PEFT_CHECK = r"""
import sys, json, numpy as np, torch, transformers, peft
from qurl_jax.models import hf
path, adapter, ours = sys.argv[1:4]
model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
model = peft.PeftModel.from_pretrained(model, adapter).eval()
tokens = torch.arange(14).reshape(2, 7) % model.config.vocab_size
with torch.no_grad():
    logits = model(input_ids=tokens).logits.numpy()
print(json.dumps({"max_abs": float(np.abs(logits - np.load(ours)).max())}))
"""


@pytest.mark.slow
def test_peft_loads_the_exported_adapter_onto_the_hf_base(tmp_path):
    """The adapter written by `lora.peft`, loaded by `peft` onto the Hugging Face base (a float
    base: the export's reference), gives our logits within 1e-4. Runs `peft` (with torch) in
    the interpreter of $QURL_JAX_PEFT_PYTHON (default: this one); skips without `peft`."""
    from qurl_jax.lora import peft as peft_io
    from qurl_jax.models import hf

    python = os.environ.get("QURL_JAX_PEFT_PYTHON", sys.executable)
    if subprocess.run([python, "-c", "import peft"], capture_output=True).returncode:
        pytest.skip(f"peft is not installed for {python} (set QURL_JAX_PEFT_PYTHON)")
    cfg = lora.LoraConfig(rank=4, alpha=8.0, base_precision="compute",
                          targets=("self_attn/(q|v)_proj", "layers_1/mlp"))
    params, base, adapter = _base_and_adapter(b_scale=0.2, cfg=cfg,
                                              recipe=quant.get_recipe("fp"))
    hf.save_hf(str(tmp_path / "base"), CFG, params)
    peft_io.save_adapter(str(tmp_path / "adapter"), adapter, cfg, str(tmp_path / "base"))
    ours = np.asarray(_logits(lora.dot_general(jax.lax.dot_general),
                              lora.attach(base, adapter, cfg.scale)))
    np.save(tmp_path / "ours.npy", ours)
    out = subprocess.run([python, "-c", PEFT_CHECK, str(tmp_path / "base"),
                          str(tmp_path / "adapter"), str(tmp_path / "ours.npy")],
                         capture_output=True, text=True, cwd=os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    max_abs = float(out.stdout.strip().splitlines()[-1].split(":")[1].strip(" }"))
    assert max_abs < 1e-4, max_abs
    # The adapter changes the logits well beyond the tolerance (the test can fail).
    assert np.abs(ours - np.asarray(_logits(jax.lax.dot_general, params))).max() > 1e-2
    shutil.rmtree(tmp_path / "base")
