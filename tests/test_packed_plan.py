"""The memory plan and preflight of packed learner programs (`qurl_jax.learner.packed_plan`):
worst-case shapes, the compiled programs taking them, and one-line errors naming train.pack_length /
train.tokens_per_micro_batch. Tiny shapes; the learner programs are compiled, never run."""

import numpy as np
import pytest

from qurl_jax.config.base import base_config
from qurl_jax.config.settings import RunSettings
from qurl_jax.learner import packed_plan, packing
from qurl_jax.models import ModelConfig
from qurl_jax.parallel import targets
from qurl_jax.plan import memory_plan as memory

CFG = ModelConfig(model_type="qwen2", vocab_size=256, hidden_size=32, intermediate_size=64,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, attention_bias=True)


def test_worst_case_is_one_sequence_per_row():
    # 32 sequences in 4 slices of 8 over 8 devices: 8 rows each (one per sequence), 9216 long.
    shapes = packed_plan.worst_case(32, 4, 9216, 8)
    assert (shapes.rows, shapes.rows_per_slice, shapes.sequences) == (32, 8, 32)
    # 9 sequences a slice on 2 devices: bucket 9 -> 10 rows.
    assert packed_plan.worst_case(18, 2, 64, 2).rows_per_slice == 10
    # train.pack_buckets = 2 (1, 2, 3, 4, 6, 8, 12, ...): 9 -> 12 rows, as the learner packs them.
    assert packed_plan.worst_case(18, 2, 64, 2, buckets=2).rows_per_slice == 12
    # Token budget: 8 rows a micro-batch, 256 sequences -> 32 micro-batches, every slot.
    budget = packed_plan.worst_case(256, 32, 9216, 8, tokens_per_micro_batch=8 * 9216)
    assert (budget.slices, budget.rows_per_slice, budget.sequences) == (32, 8, 32 * 256)
    assert budget.seq_index
    assert budget.index == "resp_span"  # 3 int32 a slot
    # The log-prob pass without shared prompts: one index row per sequence, not per slot.
    lp = packed_plan.worst_case(256, 32, 9216, 8, tokens_per_micro_batch=8 * 9216,
                                logprob_pass=True)
    assert (lp.slices, lp.rows, lp.sequences, lp.seq_index) == (32, 256, 256, False)
    assert lp.index == "resp_flat"
    shared = packed_plan.worst_case(256, 32, 9216, 8, tokens_per_micro_batch=8 * 9216,
                                    shared_prompts=True, logprob_pass=True)
    assert shared.index == "resp_index" and shared.sequences == 32 * 256
    # Every real packing of those sequences fits the worst case's rows.
    rng = np.random.default_rng(0)
    for _ in range(5):
        lengths = rng.integers(1, 9217, 256)
        mask = np.arange(9216)[None] < lengths[:, None]
        assert packing.budget_micro_batches(mask, 9216, 8) <= budget.slices


def test_pack_length_and_budget_errors_name_the_fields():
    assert packed_plan.pack_length(0, 9216) == 9216 and packed_plan.pack_length(0, 600) == 1024
    with pytest.raises(ValueError, match=r"^train\.pack_length=512 is shorter .* = 600"):
        packed_plan.pack_length(512, 600)
    with pytest.raises(ValueError, match=r"^train\.tokens_per_micro_batch=100 is less than one "
                                         r"packed row of train\.pack_length=128"):
        packed_plan.budget_rows(100, 128, 1)
    assert packed_plan.budget_rows(3 * 128, 128, 2) == 4


def _config():
    c = base_config()
    c.model.path = "checkpoints/tiny"
    c.data.prompts_per_step, c.rollout.n = 4, 2  # 8 sequences, minibatches of 4
    c.data.max_prompt_len, c.rollout.max_new_tokens = 16, 24
    c.rl.num_minibatches, c.rl.num_micro_batches = 2, 2
    c.mesh.fsdp = 2
    return c


def _setup(c):
    return memory.build_setup(RunSettings.from_config(c), CFG)


def _arg_shapes(program):
    return {k: v.shape for k, v in program.lowered.args_info[0][2].items()}


def test_plan_compiles_the_packed_programs():
    c = _config()
    c.train.pack_length = 48
    update = memory.learner_update(_setup(c))
    # 2 micro-batches of 2 sequences on 2 devices: 2 rows each of 48 tokens.
    assert _arg_shapes(update)["segment_ids"] == (4, 48)
    assert update.estimate.symbols["T"] == 48 and update.estimate.symbols["b"] == 1
    c.train.tokens_per_micro_batch = 96
    setup = _setup(c)
    shapes = _arg_shapes(memory.learner_update(setup))
    # Rows of 2 a micro-batch, up to 2 micro-batches (one sequence a row), 4 slots each.
    assert shapes["tokens"] == (4, 48) and shapes["seq_index"] == (8,)
    assert shapes["resp_span"] == (8, 3) and "resp_index" not in shapes
    logprobs = memory.learner_logprobs(setup)
    # The whole rollout's 8 sequences: up to 4 slices of 2 rows, and one index per sequence
    # (not 4 slices x 8 slots).
    args = logprobs.lowered.args_info[0][1]
    assert args["tokens"].shape == (8, 48) and args["resp_flat"].shape == (8, 24)
    assert "resp_index" not in args and "seq_index" not in args


def test_plan_and_preflight_errors_name_the_packing_fields(monkeypatch):
    c = _config()
    c.train.pack_length = 32  # < 16 + 24
    with pytest.raises(memory.PlanError, match=r"train\.pack_length=32 is shorter"):
        memory.learner_update(_setup(c))
    c.train.pack_length, c.train.tokens_per_micro_batch = 48, 40
    with pytest.raises(memory.PlanError, match=r"train\.tokens_per_micro_batch=40 is less"):
        memory.learner_logprobs(_setup(c))
    # A packed update over the limit: one line naming the packed knobs first.
    c.train.tokens_per_micro_batch = 96
    monkeypatch.setattr(memory, "PROGRAMS", {"learner_update": memory.learner_update})
    with pytest.raises(memory.MemoryPlanError) as e:
        memory.preflight(_setup(c), 1, log=lambda _: None)
    line = str(e.value)
    assert "\n" not in line
    assert "learner_update needs" in line and "change train.tokens_per_micro_batch" in line
    assert "train.pack_length" in line


def test_chain_task_lengths_compile_few_learner_programs():
    """20 steps at the chain task's shape (`configs/chain_tiny.py`: 16 prompts x 8 of 11 tokens in
    16 slots, replies of 50-107 tokens in 120, 2 minibatches, log-probs in slices of a
    minibatch): the packed learner's programs are keyed by their batch shapes, so the distinct
    shapes its packing gives are the programs it compiles. Host-side packing only."""
    from qurl_jax.learner.learner import Learner, OptimConfig
    from qurl_jax.parallel import sharding as shd
    from qurl_jax.rl.objectives import ObjectiveConfig

    learner = Learner(CFG, ObjectiveConfig(), OptimConfig(), shd.make_mesh(), packing=True)
    rng = np.random.default_rng(0)
    p, g, rows = 16, 120, 128
    shapes = {"logprobs": set(), "update": set()}
    for _ in range(20):
        replies = rng.integers(50, 108, rows)
        mask = np.concatenate([np.broadcast_to(np.arange(p) >= p - 11, (rows, p)),
                               np.arange(g)[None] < replies[:, None]], axis=1)
        batch = {"tokens": np.ones((rows, p + g), np.int32), "attn_mask": mask,
                 "resp_mask": mask[:, p:].astype(np.float32)}
        packed = learner.pack_batch(learner.shard_batch(batch), 2)  # log-prob slices of 64
        shapes["logprobs"].add(packed["tokens"].shape)
        for half in (slice(0, 64), slice(64, 128)):  # the minibatches, one micro-batch each
            mini = learner.shard_batch({k: v[half] for k, v in batch.items()})
            packed = learner.pack_batch(mini, 1)
            shapes["update"].add(packed["tokens"].shape)
    # Replies uniform in [50, 107] give 5 shapes (log-probs 112 / 120 / 128 rows, update 56 /
    # 60): the buckets' 8 sizes per doubling. The chain run itself compiled 3 learner programs
    # in 20 steps (docs/performance.md); its replies are not uniform.
    assert len(shapes["logprobs"]) + len(shapes["update"]) <= 5, shapes


@pytest.mark.slow  # 8 TPU compiles of a tiny learner (~1.5 min here)
@pytest.mark.skipif(not targets.compiler_installed("tpu"),
                    reason="libtpu not installed (pip install -e .[tpu-compile])")
def test_bench_learner_flops_counts_a_step(tmp_path):
    """`bench.learner --flops` on a tiny config for tpu:v5p-16: per-step totals are the
    per-program counts times the programs the step runs, and packing computes a larger share
    of real tokens."""
    import json

    from qurl_jax.bench import learner_flops
    from qurl_jax.models import hf

    (tmp_path / "shapes").mkdir()
    with open(tmp_path / "shapes" / "tiny.json", "w") as f:
        json.dump(hf.config_to_hf(CFG), f)
    (tmp_path / "cfg.py").write_text(
        "from qurl_jax.config.base import base_config\n"
        "def get_config():\n"
        "    c = base_config()\n"
        "    c.model.source, c.model.path, c.model.dtype = 'hf', 'checkpoints/tiny', 'bfloat16'\n"
        "    c.data.prompts_per_step, c.rollout.n = 16, 8\n"
        "    c.data.max_prompt_len, c.rollout.max_new_tokens = 64, 512\n"
        "    c.rl.num_minibatches, c.rl.num_micro_batches, c.rl.kl_coef = 4, 4, 1e-3\n"
        "    c.train.tokens_per_micro_batch = 1024\n"
        "    c.mesh.fsdp = -1\n"
        "    return c\n")
    out = learner_flops.count(str(tmp_path / "cfg.py"), "tpu:v5p-16", log=lambda _: None)
    padded, packed = out["padded"], out["packed"]
    assert out["logprob_passes"] == 2 and padded["update_programs"] == 128 // 8
    # pi_prox's pass leaves out the first of the 4 minibatches (its update's forward gives it),
    # pi_ref's covers every row.
    assert out["prox_pass_rows"] == 96
    assert padded["logprob_programs"] == 96 // 8 + 128 // 8
    assert packed["prox_logprob_programs"] < packed["logprob_programs"] / 2
    assert packed["step_flops_full_recompute"] > packed["step_flops"]
    for side in (padded, packed):
        assert side["step_flops"] == side["update_flops"] + side["logprob_flops"] > 0
    assert packed["rows_per_micro_batch"] == 8  # one 1024-token row per device, 2 hosts
    assert packed["real_token_share"] > padded["real_token_share"]
    assert out["fewer_flops"] == padded["step_flops"] / packed["step_flops"]


def test_config_validation_names_the_packing_fields():
    from qurl_jax.config.base import validate
    from qurl_jax.runtime.errors import ConfigError

    c = base_config()
    c.model.source, c.data.task = "tiny", "arithmetic"
    c.data.max_prompt_len, c.rollout.max_new_tokens, c.eval.max_new_tokens = 32, 32, 32
    c.train.pack_length = 48
    with pytest.raises(ConfigError, match=r"^config\.train\.pack_length=48 is shorter than the "
                                          r"longest sequence .* = 64"):
        validate(c)
    c.train.pack_length, c.train.tokens_per_micro_batch = 64, 32
    with pytest.raises(ConfigError, match=r"^config\.train\.tokens_per_micro_batch=32 is less "
                                          r"than one packed row of train\.pack_length=64"):
        validate(c)
    c.train.packing = False  # the padded layout reads neither
    validate(c)
