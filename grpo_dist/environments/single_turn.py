"""The 1-turn environment: plain GRPO, one completion per row. Its rollout is generate_batch itself, so a run
without an environment section computes bitwise what it did before environments existed
(tests/test_environments.py, and the golden trajectories)."""

from __future__ import annotations

from grpo_dist.environments.base import Environment
from grpo_dist.rollout_engines import generate_batch


class SingleTurnEnv(Environment):
    """Prompt -> one completion, ended by EOS or max_completion_length."""

    def rollout(self, engine, tokenizer, prompts, references, sampling, max_prompt_length, device):
        return generate_batch(engine, tokenizer, prompts, references, sampling, max_prompt_length, device)
