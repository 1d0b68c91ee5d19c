"""Learner memory grows linearly with the sequence: a regression to materialised [T, T] attention
scores or whole [tokens, vocab] logits fails here. Programs are compiled, never run."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.config.base import base_config
from qurl_jax.config.settings import RunSettings
from qurl_jax.learner.learner import Learner, OptimConfig
from qurl_jax.models import ModelConfig, hf, init_params
from qurl_jax.parallel import sharding as shd
from qurl_jax.plan import memory_plan as memory
from qurl_jax.rl.objectives import ObjectiveConfig

# A vocabulary 512x the model width, as in real LMs (152K / 1.5K-3.5K), so whole logits would
# stand out against activations.
CFG = ModelConfig(model_type="qwen2", vocab_size=32768, hidden_size=64, intermediate_size=128,
                  num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True)
ROWS = 2


def _temp_bytes(learner: Learner, length: int) -> dict[str, int]:
    """Compiled temp bytes of the update and the log-prob recomputation at T = length."""
    params, opt_state = learner.abstract_state(
        jax.eval_shape(lambda: init_params(CFG, jax.random.key(0))))
    g = 3 * length // 4

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype,
                                    sharding=shd.batch_sharding(learner.mesh, len(shape)))

    batch = {"tokens": spec((ROWS, length), jnp.int32),
             "positions": spec((ROWS, length), jnp.int32),
             "attn_mask": spec((ROWS, length), jnp.bool_),
             "resp_mask": spec((ROWS, g), jnp.float32), "logp_behav": spec((ROWS, g), jnp.float32)}
    logprobs = learner.logprobs_fn(params, batch).lower(params, batch, None).compile()
    batch.update(logp_prox=spec((ROWS, g), jnp.float32), advantages=spec((ROWS,), jnp.float32))
    update = learner.update_fn(params, opt_state, batch).lower(
        params, opt_state, batch, None).compile()
    return {"update": memory.compiled_memory(update)["temp_bytes"],
            "logprobs": memory.compiled_memory(logprobs)["temp_bytes"]}


def test_the_plan_counts_saved_activations_for_every_remat_policy():
    from qurl_jax.models import Remat

    assert set(memory._SAVED) == {r.value for r in Remat}
    assert memory._SAVED["projections"] == memory._SAVED["dots"]  # the same values, by name


@pytest.mark.parametrize("remat", ["full", "none"])
@pytest.mark.slow  # long; in the 15-minute budget its cousins cover the path
def test_temp_memory_grows_linearly_with_length(remat):
    learner = Learner(CFG, ObjectiveConfig(entropy_coef=0.01), OptimConfig(), shd.make_mesh(),
                      remat=remat, scan_layers=True, logprob_chunk=64)
    lengths = (2048, 8192)
    short, long = (_temp_bytes(learner, t) for t in lengths)
    added_positions = 3 * (lengths[1] - lengths[0]) // 4  # response positions G = 3T/4
    for program in ("update", "logprobs"):
        # 4x the length: linear growth is at most 4x; materialised [T, T] attention scores would
        # grow 16x (2 GB of f32 scores per layer at T = 8192 against ~0.1 GB here).
        growth = long[program] / short[program]
        assert growth < 5.0, f"{program}: temp grew {growth:.1f}x for 4x the length: {short} {long}"
        # Whole f32 logits would add ROWS * V * 4 = 262 KB per response position (per array);
        # chunked, only activations O(E + M) per token grow.
        per_position = (long[program] - short[program]) / added_positions
        assert per_position < ROWS * CFG.vocab_size * 4 / 4, (program, per_position)


def _shape_config(tmp_path, prompts: int, prompt_len: int, new_tokens: int):
    """A run config on a tiny model shape (a config.json in tmp_path, as under configs/shapes/)."""
    with open(tmp_path / "tiny.json", "w") as f:
        json.dump(hf.config_to_hf(CFG.replace(vocab_size=512)), f)
    c = base_config()
    c.model.path = "checkpoints/tiny"
    c.data.prompts_per_step, c.rollout.n = prompts, 2
    c.data.max_prompt_len, c.rollout.max_new_tokens = prompt_len, new_tokens
    return c


def test_memory_report_of_a_small_config(tmp_path):
    # The report end to end on a tiny model shape on a 2-way FSDP mesh: every program compiles and
    # reports its bytes.
    c = _shape_config(tmp_path, 4, 16, 24)
    c.rl.num_minibatches, c.rl.num_micro_batches = 2, 2
    c.mesh.fsdp = 2
    c.train.remat, c.train.scan_layers = "full", True
    lines = []
    figures = memory.report(RunSettings.from_config(c), str(tmp_path), log=lines.append)
    assert figures["devices"] == 2 and set(figures["programs"]) == set(memory.PROGRAMS)
    for program in figures["programs"].values():
        assert program["peak_bytes"] >= program["temp_bytes"] > 0
        assert set(program) == {"argument_bytes", "output_bytes", "temp_bytes", "peak_bytes"}
    assert any("estimate" in line for line in lines)
    # The decode program's KV cache per device, for `bench.memory --kv_capacity`.
    kv = figures["decode_kv"]
    assert kv["cache_bytes"] == kv["rows"] * kv["cache_len"] * kv["token_bytes"] > 0
    assert kv["cache_bytes"] < figures["programs"]["rollout_decode"]["peak_bytes"]
    # The decode loop's collectives per token on this learner (fsdp) layout: read and printed.
    moved = figures["decode_collectives"]
    assert moved["count"] == sum(k["count"] for k in moved["by_kind"].values()) > 0
    assert moved["bytes"] >= moved["first_buffer_bytes"] > 0
    assert any(line.startswith("  decode loop, per token per device: "
                               f"{moved['count']} collectives") for line in lines)


def test_rollout_chunk_bounds_decode_memory(tmp_path):
    # The sampler's decode program holds one chunk's KV cache: half the rows, about half the
    # cache (the actor's parameters are the same).
    c = _shape_config(tmp_path, 8, 64, 448)
    c.mesh.fsdp = 2
    kv_row = 2 * CFG.num_layers * 512 * CFG.num_kv_heads * CFG.head_dim * 4  # f32, T = 512

    def decode_bytes(rows: int, kind: str = "peak_bytes") -> int:
        c.rollout.max_concurrent_rows = rows
        setup = memory.build_setup(RunSettings.from_config(c), CFG.replace(vocab_size=512))
        compiled = memory.rollout_decode(setup).lowered.compile()
        return memory.compiled_memory(compiled)[kind]

    whole, half = decode_bytes(0), decode_bytes(8)  # 8 of 16 rows: refill (rollout.refill auto)
    # 8 of 16 rows fewer, over 2 devices: 4 rows' caches per device, counted in and out.
    assert whole - half >= 4 * kv_row, (whole, half, kv_row)
    # The refilling sampler's decode (what the run uses here) also holds every row's outputs:
    # more than the static sampler's 8-row chunk by at least tokens, log-probs and mask of the 8
    # rows that wait. (Its outputs, not its peak: on CPU the static decode program makes the
    # int8 LM head's compute-dtype copy among its temporaries, the refilling one takes it as an
    # argument, `Engine.prepare`.)
    half = decode_bytes(8, "output_bytes")
    c.rollout.refill = "off"
    static = decode_bytes(8, "output_bytes")
    assert half - static >= 8 // 2 * 448 * 13, (half, static)


def test_evaluation_programs_plan_the_full_precision_replica(tmp_path):
    # The evaluation samples the full-precision actor (the compute dtype) on the rollout's
    # replicas, with its own response length: more actor bytes than an int8 rollout's decode.
    c = _shape_config(tmp_path, 8, 16, 32)
    c.mesh.fsdp = 2
    c.model.dtype, c.rollout.precision = "bfloat16", "int8"
    c.eval.max_new_tokens, c.eval.k = 64, 4
    c.rollout.max_concurrent_rows = 8
    setup = memory.build_setup(RunSettings.from_config(c),
                               CFG.replace(vocab_size=512, dtype="bfloat16"))
    assert {x.dtype for x in jax.tree.leaves(setup.eval_actor)} == {jnp.dtype(jnp.bfloat16)}
    ev, ro = memory.eval_decode(setup), memory.rollout_decode(setup)
    # The refilling sampler's 8 concurrent rows (slots) for a call of 8 problems x 4 samples.
    assert ev.estimate.symbols["G"] == 64 and ev.estimate.symbols["slots"] == 8
    assert ev.estimate.symbols["rows per call"] == 32
    ev_mem, ro_mem = (memory.compiled_memory(p.lowered.compile()) for p in (ev, ro))
    actor = {name: p.estimate.parts[0] for name, p in (("eval", ev), ("rollout", ro))}
    assert actor["eval"][0] == actor["rollout"][0] == "actor parameters"
    # bf16 kernels against int8 codes (the embedding and LM head are bf16 in both).
    assert actor["eval"][2] > actor["rollout"][2]
    assert ev_mem["argument_bytes"] > ro_mem["argument_bytes"]


def test_preflight_names_the_knob_before_anything_is_written(tmp_path):
    from qurl_jax.train.trainer import Trainer

    c = base_config()
    c.model.source, c.data.task = "tiny", "arithmetic"
    c.model.tiny.update(dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=16))
    c.data.prompts_per_step, c.rollout.n, c.rl.num_minibatches = 2, 4, 2
    c.data.max_prompt_len, c.rollout.max_new_tokens, c.eval.max_new_tokens = 32, 4, 4
    c.train.preflight, c.train.memory_limit_gib = "on", 1e-6
    with pytest.raises(memory.MemoryPlanError, match=r"rollout_decode needs .*"
                       r"rollout\.max_concurrent_rows"):
        Trainer(c, str(tmp_path / "run"))
    assert not [p for p in (tmp_path / "run").glob("**/*") if p.is_file()]
    # With room, the preflight returns every program's figures.
    setup = memory.build_setup(RunSettings.from_config(c), CFG.replace(vocab_size=64))
    figures = memory.preflight(setup, 1 << 30, log=lambda _: None)
    assert set(figures) == set(memory.PROGRAMS)
    # One minibatch, no reference policy: pi_prox comes from the update's forward and the
    # log-prob pass is neither run nor compiled; with rl.kl_coef > 0 it is (pi_ref).
    c.rl.num_minibatches = 1
    assert memory.run_programs(RunSettings.from_config(c)) == tuple(
        n for n in memory.PROGRAMS if n != "learner_logprobs")
    c.rl.kl_coef = 0.1
    assert memory.run_programs(RunSettings.from_config(c)) == tuple(memory.PROGRAMS)


@pytest.mark.slow  # long; in the 15-minute budget its cousins cover the path
def test_accelerator_bench_learner_runs_its_default_precisions(tmp_path):
    """`bench.accelerator --parts=learner` trains with the training precisions (fp, fp8_block),
    not the rollout actors' (int8 is no training precision; it used to stop the run)."""
    from qurl_jax.bench import accelerator

    out = tmp_path / "acc.json"
    accelerator.main(["--parts=learner", "--tiny", "--rounds=1", f"--json={out}"])
    rows = json.loads(out.read_text())["learner"]
    assert [r["precision"] for r in rows] == ["fp", "fp8_block"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and jnp.isfinite(r["loss"]), r


def test_accelerator_bench_attention_times_every_cache(tmp_path):
    """`bench.accelerator --parts=attention` times the dense cache (XLA and the platform's kernel)
    and a paged pool in each KV precision asked for, with the live bytes each call reads (8-bit
    pages: codes and scales)."""
    from qurl_jax.bench import accelerator

    out = tmp_path / "acc.json"
    accelerator.main(["--parts=attention", "--tiny", "--rounds=1", "--attention_calls=2",
                      "--kv_precisions=bf16,int8", "--prompt_len=32", "--new_tokens=32",
                      f"--json={out}"])
    rows = json.loads(out.read_text())["attention"]
    assert [(r["cache"], r["kv_precision"]) for r in rows] == [
        ("dense", "bf16"), ("dense", "bf16"), ("paged", "bf16"), ("paged", "int8")]
    assert all(r["us_per_call"] > 0 and r["live_slots"] == 48 for r in rows)
    d = 64  # --tiny's head_dim: an int8 code per element and an f32 scale per token and head
    assert rows[3]["live_kv_mib"] / rows[2]["live_kv_mib"] == pytest.approx((d + 4) / (2 * d))
    # --paged_tiles' sweep: the GPU paged kernel (here in Pallas' interpreter) at a tiling, the
    # library's own choice back afterwards.
    from qurl_jax.models import decode_attention as da

    q, pages = jnp.ones((2, 4, 16)), jax.random.normal(jax.random.key(0), (2, 8, 4, 16))
    table, lengths = jnp.arange(8, dtype=jnp.int32).reshape(2, 4), jnp.array([10, 16])
    want = da.paged_decode_attention(q, pages, pages, table, lengths, impl="xla")
    with accelerator._paged_tiling(2, 1):
        assert (da.gpu_paged_splits(4), da.pages_per_compute_block(4, 2)) == (2, 1)
        got = da.paged_decode_attention(q, pages, pages, table, lengths, impl="pallas",
                                        platform="gpu", interpret=True)
    assert da.gpu_paged_splits(4) == 4
    np.testing.assert_allclose(got, want, atol=1e-5)
