"""The two types every data module shares: PromptExample (one problem and its reference answer) and DataError
(a data problem, naming the file and line or the config key at fault)."""

from __future__ import annotations

from dataclasses import dataclass, field


class DataError(ValueError):
    """A data problem, naming the file and line (or the config key) at fault."""


@dataclass
class PromptExample:
    prompt: str   # the problem text (not rendered)
    answer: str   # the reference answer, already extracted
    index: int    # 0-based position in the loaded split (stable: same data config -> same index)
    # every other field of the row (the answer field as written included), by name: batch reward functions,
    # reward models and remote scorers get them (grpo_dist.rewards.batch); not part of equality
    columns: dict = field(default_factory=dict, compare=False, repr=False)
    # TRL's conversational format: the row's prompt is a list of {role, content} messages, rendered with the
    # tokenizer's chat template (prompt then holds the last user message, for logs and evaluation records)
    messages: list[dict] | None = field(default=None, compare=False)
