"""Environments: what a rollout is (grpo_dist/environments/base.py has the interface). The config's `environment`
section chooses one (build_environment); without it, SingleTurnEnv, plain GRPO as before.

    base.py          Environment, MultiTurnEnv (the `verifiers` shape)
    single_turn.py   SingleTurnEnv: generate_batch, bitwise the plain rollout
    multi_turn.py    run_episodes: the multi-turn driver over any rollout engine (lean, hf, vllm)
    python_tool.py   PythonToolEnv: `tools: [python]`, code in the model's turn runs in the sandbox
    sandbox.py       the sandbox (own session, limits, no network, audit hook, scrubbed env, output limit)
"""

from __future__ import annotations

from typing import Any

from grpo_dist.environments.base import COUNTERS, Environment, MultiTurnEnv
from grpo_dist.environments.python_tool import PythonToolEnv
from grpo_dist.environments.sandbox import SandboxLimits, ToolResult, run_python
from grpo_dist.environments.single_turn import SingleTurnEnv

__all__ = ["Environment", "MultiTurnEnv", "SingleTurnEnv", "PythonToolEnv", "SandboxLimits", "ToolResult",
           "run_python", "build_environment", "step_metrics"]


def build_environment(cfg, tokenizer) -> Environment:
    """The environment of config section `environment`: `class` (module:Class, called with tokenizer, max_turns,
    max_episode_tokens and the section's `args`), `tools: [python]` (PythonToolEnv), else SingleTurnEnv."""
    e = getattr(cfg, "environment", None)
    if e is None or (not e.tools and not e.env_class):
        return SingleTurnEnv()
    cap = e.max_episode_tokens or cfg.max_completion_length
    if e.env_class:
        from grpo_dist.config import ConfigError
        from grpo_dist.rewards.grading import resolve_reward_function
        try:
            cls: Any = resolve_reward_function(e.env_class)  # the same "module:attr" resolution (and messages)
        except ValueError as err:
            raise ConfigError(f"config key 'environment.env_class': {err}") from None
        env = cls(tokenizer=tokenizer, max_turns=e.max_turns, max_episode_tokens=cap, **(e.args or {}))
        if not isinstance(env, Environment):
            raise ConfigError(f"config key 'environment.env_class' = {e.env_class} made a {type(env).__name__}, not a "
                            f"grpo_dist.environments.Environment")
        return env
    limits = SandboxLimits(timeout_s=e.tool_timeout_s, cpu_s=max(1, int(e.tool_timeout_s + 0.999)),
                           memory_mb=e.tool_memory_mb, max_output_chars=e.max_tool_output_chars,
                           workers=e.tool_workers)
    return PythonToolEnv(tokenizer, e.max_turns, cap, limits, e.episode_timeout_s, e.tool_format)


def step_metrics(env: Environment, device) -> dict:
    """The tools/* metrics of this step, all ranks (one all-reduce; collective whenever the environment is
    multi-turn, which the config makes the same on every rank); {} for a single-turn environment."""
    if not env.multi_turn:
        return {}
    from grpo_dist import distributed as gdist
    s = gdist.all_reduce_sum_named(dict(env.take_counts()), device)
    c = {k: float(s[k]) for k in COUNTERS}
    per = max(c["episodes"], 1.0)
    return {"tools/calls_per_episode": c["tool_calls"] / per, "tools/turns_per_episode": c["turns"] / per,
            "tools/calls": c["tool_calls"], "tools/errors": c["tool_errors"], "tools/timeouts": c["tool_timeouts"],
            "tools/env_errors": c["env_errors"], "tools/observation_tokens": c["observation_tokens"],
            "tools/cut_by_max_turns": c["cut_max_turns"], "tools/cut_by_tokens": c["cut_tokens"],
            "tools/calls_after_max_turns": c["calls_after_max_turns"]}
