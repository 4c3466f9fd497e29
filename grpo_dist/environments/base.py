"""The environment interface: what one rollout of a prompt is.

An environment turns a batch of prompts into a RolloutBatch with the rollout engine. Two kinds:

    SingleTurnEnv   one completion per row (plain GRPO, the default): grpo_dist.rollout_engines.generate_batch,
                    exactly as without environments
    MultiTurnEnv    an episode per row: the model's turn ends at EOS or at a stop marker (a tool call); finished
                    turns go to env_response in a batch; its observation is tokenised and appended (as context:
                    tool_mask 0, never trained on); until is_completed, max_turns or the token cap

MultiTurnEnv has the shape of the `verifiers` MultiTurnEnv (and of TRL's environments built on it), so that an
environment written for them ports with little change:

    setup_state(state) -> state                       per episode; state holds prompt, answer, example, turn
    is_completed(messages, state) -> bool             after each model turn: the episode is over (no response)
    env_response(messages, state) -> (obs, state)     obs: a list of messages ({"role": "tool"|"user", "content"}),
                                                      a string, or None (no observation: the model's turn goes on,
                                                      e.g. it stopped at an opening code fence)

messages is the episode so far, without the prompt: [{"role": "assistant", "content": ...}, {"role": "tool", ...},
...]. The reward is left to the reward functions at the end (they grade the whole episode's text); an environment
may count what happened in state["tool_calls"], state["tool_errors"], state["tool_timeouts"] (summed into the
tools/* metrics). env_response_batch takes all the rows whose turn ended at once (the Python tool runs them in
parallel); by default it calls env_response row by row. An env_response that raises ends that episode with an
observation that says so, counted as tools/env_errors; the run goes on.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

State = dict[str, Any]
Messages = list[dict[str, Any]]

# the counters an environment keeps per step (summed over the rows of this rank; all-reduced by step_metrics)
COUNTERS = ("episodes", "turns", "tool_calls", "tool_errors", "tool_timeouts", "env_errors", "observation_tokens",
            "cut_max_turns", "cut_tokens", "calls_after_max_turns")


class Environment(abc.ABC):
    """What a rollout of a batch of prompts is. `rollout` has generate_batch's arguments and result."""

    multi_turn = False

    def __init__(self) -> None:
        self.counts = dict.fromkeys(COUNTERS, 0)

    @abc.abstractmethod
    def rollout(self, engine, tokenizer, prompts: Sequence, references: list[str], sampling, max_prompt_length: int,
                device):
        """sampling.n rows per prompt (grouped prompt by prompt) as a grpo_dist.rollout.RolloutBatch."""

    def take_counts(self) -> dict[str, int]:
        """This step's counters (then zeroed)."""
        out, self.counts = self.counts, dict.fromkeys(COUNTERS, 0)
        return out

    def close(self) -> None:  # noqa: B027  (optional: nothing to release by default)
        """Release what the environment holds (by default nothing)."""


class MultiTurnEnv(Environment):
    """An episode per row (module docstring). Subclasses define is_completed and env_response, and stop_strings:
    the model's turn also ends at any token whose text contains one of them (besides EOS)."""

    multi_turn = True
    stop_strings: tuple[str, ...] = ()

    def __init__(self, max_turns: int = 4, max_episode_tokens: int | None = None) -> None:
        super().__init__()
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens

    def setup_state(self, state: State) -> State:
        return state

    def turn_ended(self, messages: Messages, state: State) -> bool:
        """Whether the stop marker the model just produced ends its turn (True by default). False: the marker was
        inside the turn (the opening fence of a code block whose closing fence is the same string), and the model
        goes on without an observation."""
        return True

    @abc.abstractmethod
    def is_completed(self, messages: Messages, state: State) -> bool:
        """After a model turn that ended at a stop marker: is the episode over (no response)?"""

    @abc.abstractmethod
    def env_response(self, messages: Messages, state: State) -> tuple[Messages | str | None, State]:
        """The observation after the model's turn (module docstring), and the state."""

    def env_response_batch(self, items: list[tuple[Messages, State]]) -> list[tuple[Messages | str | None, State]]:
        """env_response of every row whose turn ended (override to run them together)."""
        return [self.env_response(messages, state) for messages, state in items]

    def render_observation(self, observation: Messages | str, tokenizer) -> str:
        """The text appended after the model's turn. Plain: the messages' contents, each on its own lines."""
        if isinstance(observation, str):
            return observation
        return "".join(f"\n{m.get('content', '')}\n" for m in observation)

    def stop_token_ids(self, tokenizer) -> tuple[int, ...]:
        """Every token id whose text contains a stop string (computed once per tokenizer)."""
        key = id(tokenizer)
        cached = getattr(self, "_stop_ids", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        ids: tuple[int, ...] = ()
        if self.stop_strings:
            vocab = tokenizer.get_vocab()
            texts = tokenizer.convert_tokens_to_string
            ids = tuple(sorted(i for tok, i in vocab.items()
                               if any(s in texts([tok]) for s in self.stop_strings)))
        self._stop_ids = (key, ids)
        return ids

    def rollout(self, engine, tokenizer, prompts, references, sampling, max_prompt_length, device):
        from grpo_dist.environments.multi_turn import run_episodes
        return run_episodes(self, engine, tokenizer, prompts, references, sampling, max_prompt_length, device)
