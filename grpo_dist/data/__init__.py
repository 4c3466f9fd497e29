"""Prompt data, one job per module:

* :mod:`~grpo_dist.data.loading`: ``load_examples``, the train / eval split a data config names, and
  ``data_config_problems`` (grpo_dist/config/data_checks.py), the config's problems
  found without reading a file;
* :mod:`~grpo_dist.data.presets`: the presets (gsm8k, math500, math, arithmetic), their Hub datasets and offline
  mirror ($GRPO_DIST_DATA_DIR), ``resolve_data_config``;
* :mod:`~grpo_dist.data.files`: reading .jsonl / .json / .parquet / hf: rows, ``extract_reference``;
* :mod:`~grpo_dist.data.arithmetic`: the built-in arithmetic set, ``synthetic_arithmetic``;
* :mod:`~grpo_dist.data.prompts`: ``render_prompt`` (template, chat template) -> ``RenderedPrompt``, whose row
  text ``encode_prompts`` keeps as text; ``truncate_long_prompts``;
* :mod:`~grpo_dist.data.sampler`: ``PromptSampler``, the resumable rank-sharded prompt order;
* :mod:`~grpo_dist.data.examples`: ``PromptExample`` and ``DataError``.
"""

from grpo_dist.data.arithmetic import synthetic_arithmetic
from grpo_dist.data.examples import DataError, PromptExample
from grpo_dist.data.files import extract_reference
from grpo_dist.data.loading import data_config_problems, load_examples
from grpo_dist.data.presets import data_dir, resolve_data_config
from grpo_dist.data.prompts import (CHARS_PER_TOKEN_BOUND, RenderedPrompt, encode_prompts, prompt_length_check,
                                    render_prompt, truncate_long_prompts)
from grpo_dist.data.sampler import PromptSampler

__all__ = ["CHARS_PER_TOKEN_BOUND", "DataError", "PromptExample", "PromptSampler", "RenderedPrompt",
           "data_config_problems", "data_dir", "encode_prompts", "extract_reference", "load_examples",
           "prompt_length_check", "render_prompt", "resolve_data_config", "synthetic_arithmetic",
           "truncate_long_prompts"]
