"""The typed settings: converted from a config once, with the config's defaults and values."""

import dataclasses

from qurl_jax.config.base import base_config
from qurl_jax.config.settings import (
    DataSettings,
    ModelSettings,
    RunSettings,
    SftSettings,
    TinyShape,
)
from qurl_jax.train import warm_start


def test_the_sections_defaults_are_the_configs():
    c = base_config()
    c.data.train_files = ()  # the dataclass names no file of this repository
    assert RunSettings.from_config(c) == RunSettings()


def test_the_converters_carry_every_value():
    c = base_config()
    c.seed = 3
    c.model.update(dict(source="tiny", dtype="bfloat16", attention="dense"))
    c.model.tiny.num_layers = 5
    c.data.update(dict(task="chain", chain_max_steps=7, split_seed=2, arith_ops="*"))
    c.sft.bug_rate = 0.25
    c.reward.workers = 2
    c.eval.files = ("a.json",)
    s = RunSettings.from_config(c)
    assert (s.seed, s.model.source, s.model.dtype, s.model.attention) == (
        3, "tiny", "bfloat16", "dense")
    assert s.model.tiny == TinyShape(num_layers=5)
    assert s.data.chain.max_steps == 7 and s.data.arithmetic.operators == ("*",)
    assert (s.data.split_seed_of(3), DataSettings().split_seed_of(3)) == (2, 3)
    assert s.sft == SftSettings(bug_rate=0.25) and s.reward.workers == 2
    assert s.eval.files == ("a.json",)
    c.rollout.max_concurrent_rows, c.rl.num_minibatches, c.mesh.fsdp = 16, 2, -1
    s = RunSettings.from_config(c)
    assert s.rollout_rows == s.rollout.sampler.rows_per_step == 64 and s.rollout.sampler.refills
    assert s.train.micro_batch_rows(s.rollout_rows) == 32 and s.mesh.fsdp == -1
    # Hashable and frozen: a section can key a cache and cannot drift after the conversion.
    assert hash(s)
    assert dataclasses.is_dataclass(s) and s.__dataclass_params__.frozen


def test_the_warm_start_cache_key_is_the_configs_sections():
    c = base_config()
    c.model.source = "tiny"
    s = RunSettings.from_config(c)
    key = warm_start._warm_start_key(s.model, s.data, s.sft, s.seed)
    assert key["tiny"] == c.model.tiny.to_dict() and key["sft"] == c.sft.to_dict()
    assert warm_start.tiny_model_config(ModelSettings(dtype="bfloat16")).dtype == "bfloat16"
