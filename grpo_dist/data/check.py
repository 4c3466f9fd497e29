"""data_file_problems: what `python -m grpo_dist.config --check` can tell about the data files a config names
without loading them: each local file (data.path, data.eval_path) exists, is a readable file of a supported type,
and its first row has the fields the config names (data.prompt_field, data.answer_field) with a reference answer
data.answer_format can read. hf: datasets are not fetched here (no network at check time); preset files are
resolved when the run starts."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_dist.config.schema import DataConfig
from grpo_dist.data.conversational import conversation_problems
from grpo_dist.data.examples import DataError
from grpo_dist.data.files import load_file
from grpo_dist.data.presets import resolve_data_config

SUFFIXES = (".jsonl", ".json", ".parquet")


def data_file_problems(cfg: DataConfig) -> list[str]:
    """One line per problem, each naming the config key (data.path / data.eval_path) and the file."""
    rcfg = resolve_data_config(cfg)
    bad = []
    for key in ("path", "eval_path"):
        value = getattr(cfg, key)
        if not value or value.startswith("hf:"):
            continue
        p = Path(value)
        what = f"config key 'data.{key}' = {value}"
        if not p.exists():
            bad.append(f"{what}: no such file")
        elif not p.is_file():
            bad.append(f"{what} is a directory, not a data file")
        elif p.suffix.lower() not in SUFFIXES:
            bad.append(f"{what}: unsupported data file type {p.suffix or '(no suffix)'!r}; use .jsonl, .json, "
                       f".parquet or hf:NAME[:SPLIT]")
        elif not os.access(p, os.R_OK):
            bad.append(f"{what} cannot be read (permission denied)")
        else:
            try:  # the first row only (the whole file for .json, whose list is parsed at once)
                first = load_file(value, rcfg.prompt_field, rcfg.answer_field, rcfg.answer_format, 1)
                bad += [f"{what}: {b}" for b in conversation_problems(first, cfg)]
            except DataError as e:
                bad.append(f"{what}: {e}")
            except OSError as e:
                bad.append(f"{what} cannot be read: {e.strerror}")
    return bad
