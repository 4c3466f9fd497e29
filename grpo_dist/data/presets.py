"""Data presets: which file (offline mirror) or Hugging Face Hub dataset, fields and answer format each names, and
resolve_data_config, which fills a data config's defaults from its preset.

Presets fill defaults; anything the user set explicitly wins:

======== ================================== ============== ============ ============= =========================
preset   train file                         prompt_field   answer_field answer_format eval split (no eval_path)
======== ================================== ============== ============ ============= =========================
gsm8k    gsm8k/train.jsonl (7473)           question       answer       gsm8k         gsm8k/test.jsonl (1319)
math500  math500/test.jsonl (500)           problem        answer       raw           none
math     math_test5000/test.jsonl minus the problem        solution     boxed         math500/test.jsonl (500)
         500 MATH-500 problems (4500)
arithm.  built in, no file                  -              -            raw           disjoint held-out problems
======== ================================== ============== ============ ============= =========================

"Explicitly set" means "different from the DataConfig class default" (a dataclass cannot tell a default from the same
value written by hand): e.g. with ``preset: gsm8k`` the answer format is ``gsm8k`` unless ``data.answer_format`` is set
to something other than ``raw``. To read a file with no preset logic at all, set ``data.preset: null``.
An explicit ``data.path`` replaces the preset's training file; with the ``arithmetic`` preset (the config default) it
replaces the built-in set entirely, so ``data.path=train.jsonl`` alone loads that file.

Preset data comes from the Hugging Face Hub through `datasets` (cached in HF_HOME after the first download):
gsm8k = openai/gsm8k (config main), math500 = HuggingFaceH4/MATH-500, the MATH test set =
DigitalLearningGmbH/MATH-lighteval (split test, 5000 problems). With ``$GRPO_DIST_DATA_DIR`` set, the files above
are read from that folder instead (an offline mirror; the tests use one) and the Hub is never asked.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from grpo_dist.config.schema import DataConfig
from grpo_dist.data.examples import DataError


@dataclass(frozen=True)
class _Preset:
    train: Optional[str]            # file in the offline mirror, a key of HUB_SOURCES (None: built in)
    eval: Optional[str]
    prompt_field: Optional[str] = None
    answer_field: Optional[str] = None
    answer_format: Optional[str] = None
    exclude_from_train: Optional[str] = None   # file whose prompts are removed from the training split


PRESETS: dict[str, _Preset] = {
    "gsm8k": _Preset("gsm8k/train.jsonl", "gsm8k/test.jsonl", "question", "answer", "gsm8k"),
    "math500": _Preset("math500/test.jsonl", None, "problem", "answer", "raw"),
    # MATH test (5000) has no 'answer' field: the gold answer is the last \boxed{} of 'solution'. MATH-500 is a subset
    # of it, so its 500 problems are dropped from the training split (the remaining 4500 are PRM800K's train problems).
    "math": _Preset("math_test5000/test.jsonl", "math500/test.jsonl", "problem", "solution", "boxed",
                    exclude_from_train="math500/test.jsonl"),
    "arithmetic": _Preset(None, None),
}
MATH500_EVAL_FIELDS = ("problem", "answer", "raw")  # fields of math500 when used as the eval split of `math`

# Where each preset file comes from on the Hub: (dataset, config, split). The mirror's files hold the same rows.
HUB_SOURCES: dict[str, tuple[str, Optional[str], str]] = {
    "gsm8k/train.jsonl": ("openai/gsm8k", "main", "train"),
    "gsm8k/test.jsonl": ("openai/gsm8k", "main", "test"),
    "math500/test.jsonl": ("HuggingFaceH4/MATH-500", None, "test"),
    "math_test5000/test.jsonl": ("DigitalLearningGmbH/MATH-lighteval", "default", "test"),
}
DATA_DIR_ENV = "GRPO_DIST_DATA_DIR"


def data_dir() -> Optional[Path]:
    """The offline mirror of the preset data ($GRPO_DIST_DATA_DIR), or None: presets then load from the Hub."""
    env = os.environ.get(DATA_DIR_ENV)
    if not env:
        return None
    p = Path(env)
    if not p.is_dir():
        raise DataError(f"{DATA_DIR_ENV}={env} is not a directory")
    return p


def preset_source(rel: str | None, preset: str | None) -> str:
    """The mirror's file for `rel` when $GRPO_DIST_DATA_DIR is set, else an hf:NAME:CONFIG:SPLIT spec."""
    assert rel is not None, preset  # only the built-in arithmetic preset has no file, and it never gets here
    root = data_dir()
    if root is None:
        name, config, split = HUB_SOURCES[rel]
        return f"hf:{name}:{config}:{split}" if config else f"hf:{name}:{split}"
    p = root / rel
    if not p.is_file():
        raise DataError(f"data.preset={preset}: file {p} not found; {DATA_DIR_ENV} must name a folder holding "
                        f"{rel}, or unset it to load {HUB_SOURCES[rel][0]} from the Hugging Face Hub, or set "
                        f"data.path")
    return str(p)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DataConfig) if f.default is not dataclasses.MISSING}


def resolve_data_config(cfg: DataConfig) -> DataConfig:
    """A copy of `cfg` with the preset's defaults filled in (fields left at their class default take the preset's
    value). Paths of preset files are resolved against the shared data directory only when loading."""
    if cfg.preset is None:
        return dataclasses.replace(cfg)
    if cfg.preset not in PRESETS:
        raise DataError(f"config key 'data.preset' = {cfg.preset!r} is not known; choose one of {', '.join(PRESETS)}")
    p = PRESETS[cfg.preset]
    changes = {}
    for name in ("prompt_field", "answer_field", "answer_format"):
        value = getattr(p, name)
        if value is not None and getattr(cfg, name) == _DEFAULTS[name]:
            changes[name] = value
    return dataclasses.replace(cfg, **changes)
