"""Typed trainer configuration: a package with one job per module (docs/design.md, "config").

    errors       ConfigError and the bounded one-line problem messages. A leaf: imports nothing of grpo_dist
    choices      every list of allowed values (loss types, KL estimators, engines, save formats, ...) and the bounds
                 other modules share. A leaf
    schema       GRPOConfig and its section dataclasses: each key's type, default, help and choices
    checks       every problem of a config found without a model or a data file (GRPOConfig.problems())
    data_checks  the data section's checks, which grpo_dist.data runs too
    trl_names    TRL / transformers key names and what they map to here
    yaml_text    bounded YAML reading and the line of each key
    compose      `defaults:` chains, `+exp=NAME` files, where each value came from
    overrides    `key=value` and `--key value` words
    loading      load_config: compose, override, type-check, build
    cli          `python -m grpo_dist.config [--check CONFIG ...]`

Imports go down this list and never up, and the modules a check calls into (grpo_dist.rewards.specs, preflight,
grpo_dist.data) import only the leaves, so there is no import circle through the config (tests/test_import_rules.py).
Everything the single module grpo_dist.config used to offer is re-exported here: `from grpo_dist.config import
load_config, GRPOConfig, ConfigError` keeps working.
"""

from grpo_dist.config.errors import MAX_PROBLEM_CHARS, ConfigError, clip, nearest_key_value, short  # isort: skip
from grpo_dist.config.choices import (CURRICULUM_MODES, EVAL_METRICS, HEALTH_CONDITIONS, MAX_REWARD_TIMEOUT_S,
                                      MAX_REWARD_WEIGHT, TINY_ARCHITECTURES, TINY_DEFAULTS)
from grpo_dist.config.checks import K1_IN_LOSS, context_problems, tiny_problems
from grpo_dist.config.data_checks import data_config_problems
from grpo_dist.config.schema import (DEFAULT_ASYNC_DUAL_CLIP_C, CurriculumConfig, DataConfig, DistributedConfig,
                                     GRPOConfig, HealthConfig, LoraConfig, ModelConfig, VLLMConfig, _f, key_type,
                                     lean_cuda_graphs_on)
from grpo_dist.config.yaml_text import YAML_MAX_DEPTH, YAML_MAX_VALUES, key_line, load_yaml, yaml_key_lines
from grpo_dist.config.overrides import apply_overrides, expand_flags
from grpo_dist.config.loading import load_config
from grpo_dist.config.cli import describe, main

__all__ = ["MAX_PROBLEM_CHARS", "ConfigError", "clip", "nearest_key_value", "short",
           "CURRICULUM_MODES", "EVAL_METRICS", "HEALTH_CONDITIONS", "MAX_REWARD_TIMEOUT_S", "MAX_REWARD_WEIGHT",
           "TINY_ARCHITECTURES", "TINY_DEFAULTS",
           "K1_IN_LOSS", "context_problems", "tiny_problems", "data_config_problems",
           "DEFAULT_ASYNC_DUAL_CLIP_C", "CurriculumConfig", "DataConfig", "DistributedConfig", "GRPOConfig",
           "HealthConfig", "LoraConfig", "ModelConfig", "VLLMConfig", "_f", "key_type", "lean_cuda_graphs_on",
           "YAML_MAX_DEPTH", "YAML_MAX_VALUES", "key_line", "load_yaml", "yaml_key_lines",
           "apply_overrides", "expand_flags", "load_config", "describe", "main"]
