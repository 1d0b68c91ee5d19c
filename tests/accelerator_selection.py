"""Which tests the accelerator runner (`python -m tests.accelerator`) runs, in one place.

`FILES`: the test files that exercise numerics an accelerator can change (model parity, sampling
static / refill / compressed KV, quantized products and requantization, FP8 training, objectives,
the learner, the attention kernels, sharding). Every test in them runs unless `EXCLUDE` names it;
new tests in these files are selected automatically.

`EXCLUDE`: node-id prefixes deselected with the reason (host-only code paths, whole training runs
that would not fit the runner's time budget). `NEEDS_DEVICES`: node-id prefixes that build a mesh of
that many devices; they are skipped, with the reason, where JAX sees fewer. Keys are a file, or a
file and a test function's exact name; tests/test_accelerator_runner.py checks that each names an
existing test, and a run lists a key that matched nothing in its selection.txt.
"""

from __future__ import annotations

FILES: tuple[str, ...] = (  # in order of priority: the first run first when the budget is short
    "tests/test_model_parity.py",
    "tests/test_attention.py",
    "tests/test_decode_attention.py",
    "tests/test_gpu_kernel.py",
    "tests/test_quant.py",
    "tests/test_fp8_train.py",
    "tests/test_sampler.py",
    "tests/test_refill.py",
    "tests/test_sparse_sampler.py",
    "tests/test_kv_cache.py",
    "tests/test_learner.py",
    "tests/test_objectives.py",
    "tests/test_sharding.py",
)

EXCLUDE: dict[str, str] = {
    "tests/test_sampler.py::test_cpu_only_decode_work_follows_the_platform":
        "checks the CPU platform choice on host devices",
    "tests/test_refill.py::test_trainer_switch": "a trainer config switch, no device numerics",
    "tests/test_refill.py::test_trainer_rollout_refills_by_default_with_the_static_result":
        "a whole trainer run: covered by the sampler tests, too long for the runner's budget",
    "tests/test_sparse_sampler.py::test_rl_step_on_sparse_rollouts":
        "whole trainer RL steps: covered by the sampler and learner tests, too long for the budget",
    "tests/test_sparse_sampler.py::test_config_builds_the_policy_and_rejects_bad_fields":
        "config validation, no device numerics",
    "tests/test_objectives.py::test_import_stays_light": "an import-time check in a subprocess",
    "tests/test_objectives.py::test_bad_config_raises": "config validation, no device numerics",
    "tests/test_quant.py::test_unknown_recipe_names_it_and_the_known_ones":
        "recipe-name validation, no device numerics",
    "tests/test_quant.py::test_recipe_with_unknown_layer_names_it":
        "recipe validation, no device numerics",
    "tests/test_quant.py::test_bench_functions_run_on_tiny_config":
        "benchmark plumbing; the products it times are tested above",
}

NEEDS_DEVICES: dict[str, int] = {
    "tests/test_decode_attention.py::test_kernels_under_shard_map_with_rows_split_over_devices": 2,
    "tests/test_gpu_kernel.py::test_fused_decode_applies_only_to_what_it_takes": 2,
    "tests/test_gpu_kernel.py::test_the_sampler_runs_the_fused_products_per_batch_shard": 2,
    "tests/test_sampler.py::test_sharded_chunked_greedy_matches_single_device": 8,
    "tests/test_refill.py::test_mesh_each_shard_refills_its_own_slots": 8,
    "tests/test_refill.py::test_lower_programs_are_the_programs_sample_runs": 8,
    "tests/test_refill.py::test_each_program_compiles_once_on_a_mesh": 8,
    "tests/test_refill.py::test_bad_arguments_raise": 4,
    "tests/test_refill.py::test_prompt_pass_keeps_each_device_to_its_own_prompts": 8,
    "tests/test_sparse_sampler.py::test_sharded_compressed_sampler_matches_single_device": 8,
    "tests/test_sparse_sampler.py::test_decode_program_holds_budget_plus_interval_slots": 2,
    "tests/test_quant.py::test_requantize_sharded_keeps_each_leaf_sharding": 8,
    "tests/test_quant.py::test_blocks_straddling_fsdp_shards_move_scales_not_weights": 8,
    "tests/test_fp8_train.py::test_sharded_product_matches_single_device": 8,
    "tests/test_fp8_train.py::test_sharded_loss_grad_matches_single_device": 8,
    "tests/test_fp8_train.py::test_fp8_learner_step_sharded_matches_single_device": 8,
    "tests/test_learner.py::test_sharded_update_matches_single_device": 8,
}
