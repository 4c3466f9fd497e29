"""Sample completions for people to read: output_dir/completions.jsonl and the console sample at each evaluation.

Reward curves hide a lot (a formatting trick, a truncated answer, a grader that accepts garbage); reading a few
completions every step catches it early, as TRL's log_completions does. Rank 0 writes the first `log_completions`
rows of its own batch (the first prompt's group of num_generations completions, then the next prompt's): no
collective is involved, so logging can never put ranks out of step.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo_dist.metrics import cut_partial_tail, append_whole, drop_steps_after

FILE_NAME = "completions.jsonl"


class CompletionLog:
    """Appends one JSON row per logged completion: step, prompt, completion, reference, reward, each reward
    function's value, advantage, completion_tokens. A resumed run first drops the rows of steps after its
    checkpoint (they are redone), like metrics.jsonl."""

    def __init__(self, output_dir: str, per_step: int, enabled: bool, start_step: int = 0,
                 resuming: bool | None = None):
        self.per_step = per_step
        self._file = None
        self.failed: str | None = None  # why appending failed (full disk): the run stops on it, as for metrics
        self.path = Path(output_dir) / FILE_NAME
        if not enabled or per_step <= 0:
            return
        path = Path(output_dir) / FILE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        if start_step > 0 if resuming is None else resuming:  # as MetricsLogger (its line names metrics.jsonl)
            drop_steps_after(path, start_step)
        elif path.is_file():
            cut_partial_tail(path)
        self._file = open(path, "ab", buffering=0)  # a step's rows in one write, all or none (append_whole)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, step: int, prompts: list[str], completions: list[str], references: list[str],
              rewards: list[float], per_function: dict[str, list[float]], advantages: list[float],
              lengths: list[int]) -> None:
        """Rows 0 .. per_step - 1 of this rank's batch; `prompts` are the rendered prompts of those rows."""
        if self._file is None or self.failed is not None:
            return
        rows = []
        for i in range(min(self.per_step, len(completions))):
            row = {"step": step, "prompt": prompts[i], "completion": completions[i], "reference": references[i],
                   "reward": float(rewards[i]),
                   "rewards": {name: (None if values[i] != values[i] else float(values[i]))  # NaN: n/a
                               for name, values in per_function.items()},
                   "advantage": float(advantages[i]), "completion_tokens": int(lengths[i])}
            rows.append(json.dumps(row, ensure_ascii=False) + "\n")
        reason = append_whole(self._file.fileno(), "".join(rows).encode("utf-8"), self.path)
        if reason:
            self.failed = f"appending the completions of step {step} to {self.path} failed: {reason}"

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _clip(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f" ...[{len(text) - limit} more chars]"


def format_sample(step: int, prompt: str, completion: str, reference: str, correct: bool,
                  limit: int = 600) -> str:
    """The console block showing one evaluation completion (greedy) with its reference."""
    return (f"[grpo_dist] eval sample at step {step} ({'correct' if correct else 'wrong'}, reference "
            f"{reference!r}):\n  prompt: {_clip(prompt, limit)!r}\n  completion: {_clip(completion, limit)!r}")
