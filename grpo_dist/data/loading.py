"""load_examples: the train or eval split a data config names (data.path, a preset's file or Hub dataset, or the
built-in arithmetic set) as a list of PromptExample; data_config_problems (from the config section,
grpo_dist/config/data_checks.py): what is wrong with a data config before any file is read."""

from __future__ import annotations

import dataclasses

from grpo_dist.config.data_checks import data_config_problems
from grpo_dist.config.schema import DataConfig
from grpo_dist.data.arithmetic import arithmetic_from_config
from grpo_dist.data.examples import DataError, PromptExample
from grpo_dist.data.files import load_file
from grpo_dist.data.presets import MATH500_EVAL_FIELDS, PRESETS, preset_source, resolve_data_config


def load_examples(cfg: DataConfig, split: str = "train") -> list[PromptExample]:
    """The examples of a split (_load_split), refused at load when chat-message rows meet a setting that applies to
    text prompts only (conversational.conversation_problems)."""
    from grpo_dist.data.conversational import conversation_problems
    examples = _load_split(cfg, split)
    bad = conversation_problems(examples, cfg)
    if bad:
        raise DataError(bad[0])
    return examples


def _load_split(cfg: DataConfig, split: str = "train") -> list[PromptExample]:
    """Load the `train` split (data.path or the preset's file, first data.limit rows) or the `eval` split
    (data.eval_path, else the preset's held-out set, else []). data.eval_limit is not applied here: all eval rows are
    returned and the evaluator picks its subset."""
    if split not in ("train", "eval"):
        raise DataError(f"split must be 'train' or 'eval', got {split!r}")
    bad = data_config_problems(cfg)
    if bad:
        raise DataError(bad[0])
    rcfg = resolve_data_config(cfg)
    preset = PRESETS.get(cfg.preset) if cfg.preset else None
    limit = cfg.limit if split == "train" else None

    if split == "train":
        if cfg.path is not None:
            return load_file(cfg.path, rcfg.prompt_field, rcfg.answer_field, rcfg.answer_format, limit)
        if cfg.preset == "arithmetic":
            return arithmetic_from_config(cfg, "train", limit)
        if preset is None:
            raise DataError("config key 'data.path' (or 'data.preset') must be set")
        path = preset_source(preset.train, cfg.preset)
        if not preset.exclude_from_train:
            return load_file(path, rcfg.prompt_field, rcfg.answer_field, rcfg.answer_format, limit)
        ex_path = preset_source(preset.exclude_from_train, cfg.preset)
        exclude = {_normalise(e.prompt) for e in load_file(ex_path, *MATH500_EVAL_FIELDS, None)}
        rows = load_file(path, rcfg.prompt_field, rcfg.answer_field, rcfg.answer_format, None)
        kept = [e for e in rows if _normalise(e.prompt) not in exclude]
        found = len(exclude & {_normalise(e.prompt) for e in rows})
        if found != len(exclude):  # else training and evaluation would share problems
            raise DataError(f"data.preset={cfg.preset}: {path} holds {found} of the {len(exclude)} problems of "
                            f"{ex_path} that must leave the training split; is it the MATH test set?")
        kept = [dataclasses.replace(e, index=i) for i, e in enumerate(kept)]
        return kept[:limit] if limit is not None else kept

    # eval
    if cfg.eval_path is not None:
        return load_file(cfg.eval_path, rcfg.prompt_field, rcfg.answer_field, rcfg.answer_format, None)
    if cfg.preset == "arithmetic":
        return [] if cfg.path is not None else arithmetic_from_config(cfg, "eval", None)
    if preset is None or preset.eval is None:
        return []
    path = preset_source(preset.eval, cfg.preset)
    if cfg.preset == "math":  # eval set is MATH-500, whose fields differ from the training file's
        return load_file(path, *MATH500_EVAL_FIELDS, None)
    return load_file(path, rcfg.prompt_field, rcfg.answer_field, rcfg.answer_format, None)


def _normalise(text: str) -> str:
    """Whitespace-insensitive key: MATH copies on the Hub and in mirrors differ in spacing, not in content."""
    return " ".join(text.split())
