"""Configuration: the documented base config, validation, command-line overrides, the saved run
config, and the typed settings every layer below the command lines reads.

A command line parses a `ConfigDict` (`base_config()` and a config file's overrides) and hands it
to `resolve`, which validates it and converts it once into `RunSettings`; nothing below takes the
`ConfigDict`. This package imports nothing from `plan`, `train` or `study`."""

from qurl_jax.config.base import (
    Resolved,
    base_config,
    field_docs,
    format_config,
    load_config_file,
    resolve,
    validate,
)
from qurl_jax.config.settings import (
    DataSettings,
    LoopSettings,
    MeshSizes,
    ModelSettings,
    RewardSettings,
    RLSettings,
    RolloutSettings,
    RunSettings,
    SftSettings,
    TrainSettings,
)

__all__ = ["DataSettings", "LoopSettings", "MeshSizes", "ModelSettings", "Resolved",
           "RewardSettings", "RLSettings", "RolloutSettings", "RunSettings", "SftSettings",
           "TrainSettings", "base_config", "field_docs", "format_config", "load_config_file",
           "resolve", "validate"]
