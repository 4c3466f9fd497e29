"""A record of the prompts each step trains, for tests and audits, driven by one environment variable (like
faults.py) so that production runs write nothing:

    GRPO_DIST_TRAINED_PROMPTS=DIR     every trainer rank R appends to DIR/rank<R>.jsonl, per prompt batch it draws
                                      for training, one line {"step": S, "rank": R, "batch_number": B,
                                      "examples": [example indices]}

S is the 1-based step the batch trains in (a round of dynamic sampling adds a line), B the sampler's global batch
number (the per-prompt sampling noise is keyed on it), the examples are indices into the training split, in the
order of this rank's rows. Written when the batch is drawn from the trainer's cursor: in asynchronous GRPO that is
when its completions come back to train, not when its prompts went out (grpo_dist/async_rollout.py). A line is
flushed at once, so a run killed by SIGKILL keeps the lines of the steps it drew.
"""

from __future__ import annotations

import json
import os

ENV = "GRPO_DIST_TRAINED_PROMPTS"


def record(step: int, rank: int, sampler) -> None:
    """Append the batch sampler.next_batch() just drew (when ENV names a directory)."""
    where = os.environ.get(ENV, "").strip()
    if not where:
        return
    os.makedirs(where, exist_ok=True)
    line = {"step": int(step), "rank": int(rank), "batch_number": int(sampler.last_batch_number),
            "examples": [int(sampler.last_global_indices[i]) for i in sampler.last_prompt_indices]}
    with open(os.path.join(where, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")
