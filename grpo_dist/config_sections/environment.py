"""The `environment` section: multi-turn rollouts with tools (grpo_dist/environments/, docs/tools.md), and every
check of it. Empty (the default): plain single-turn GRPO, exactly as without the section. A leaf (imports nothing
of grpo_dist): the config hooks it in with two lines, the field in GRPOConfig and environment_problems in its
checks."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any, Optional


def _f(default: Any = MISSING, help: str = "", choices: tuple | None = None, factory=None):
    """A field with its help string (and choices), as the config's other sections declare theirs."""
    meta: dict[str, Any] = {"help": help, **({"choices": choices} if choices else {})}
    return field(default_factory=factory, metadata=meta) if factory is not None else \
        field(default=default, metadata=meta)


def short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...[{len(text) - limit} more chars]"

TOOLS = ("python",)


@dataclass
class EnvironmentConfig:
    tools: list = _f(factory=list, help="built-in tools of a multi-turn episode: [python] (code in the model's turn "
                     "runs in a sandbox, its output is the next turn); []: single-turn")
    env_class: Optional[str] = _f(None, "module:Class of your own environment (grpo_dist.environments.MultiTurnEnv; "
                                  "called with tokenizer, max_turns, max_episode_tokens and `args`)")
    args: dict = _f(factory=dict, help="keyword arguments of env_class")
    max_turns: int = _f(4, "model turns per episode at most; a tool call in the last one is not run (counted)")
    max_episode_tokens: Optional[int] = _f(None, "model and observation tokens of an episode together, at most "
                                           "(None: max_completion_length, which it may not exceed)")
    tool_format: str = _f("auto", "how the model calls the tool: auto (qwen where the chat template has <tool_call>, "
                          "else markdown) | qwen | markdown (```python blocks, ```output answers)",
                          ("auto", "qwen", "markdown"))
    tool_timeout_s: float = _f(5.0, "wall time of one tool call (its CPU time limit too)")
    episode_timeout_s: float = _f(20.0, "tool wall time of one episode in all; later calls are refused (counted)")
    tool_memory_mb: int = _f(1024, "address-space limit of a tool call's process")
    max_tool_output_chars: int = _f(1024, "the end of a call's output kept for the model (more is cut, saying so)")
    tool_workers: int = _f(4, "tool calls run at once")


def environment_problems(cfg) -> list[str]:
    """Every problem of the environment section (cfg: the whole GRPOConfig)."""
    e, bad = cfg.environment, []
    for t in e.tools or []:
        if t not in TOOLS:
            bad.append(f"config key 'environment.tools' has {short(t)}; built in: {', '.join(TOOLS)}")
    if e.tools and e.env_class:
        bad.append("config keys 'environment.tools' and 'environment.env_class' exclude each other")
    if not (e.tools or e.env_class):
        return bad
    if e.max_turns < 1:
        bad.append(f"config key 'environment.max_turns' must be >= 1, got {e.max_turns}")
    if e.max_episode_tokens is not None and not 1 <= e.max_episode_tokens <= cfg.max_completion_length:
        bad.append(f"config key 'environment.max_episode_tokens' = {e.max_episode_tokens} must be in [1, "
                   f"max_completion_length = {cfg.max_completion_length}] (the engines are sized for it)")
    for k in ("tool_timeout_s", "episode_timeout_s"):
        if not getattr(e, k) > 0:
            bad.append(f"config key 'environment.{k}' must be > 0, got {getattr(e, k)}")
    for k in ("tool_memory_mb", "max_tool_output_chars", "tool_workers"):
        if getattr(e, k) < 1:
            bad.append(f"config key 'environment.{k}' must be >= 1, got {getattr(e, k)}")
    for key, on in (("rollout_ranks", cfg.rollout_ranks > 0), ("max_tokens_per_micro_batch",
                                                              cfg.max_tokens_per_micro_batch is not None)):
        if on:
            bad.append(f"config key '{key}' is not supported with a multi-turn environment yet (docs/tools.md)")
    return bad
