"""Environments for tests (importable as tool_envs:NAME when tests/ is on sys.path, like reward_fns)."""

from grpo_dist.environments import MultiTurnEnv, PythonToolEnv, SandboxLimits


class ScriptedPythonEnv(PythonToolEnv):
    """A random tiny model never writes a tool call: here every token id in stop_ids ends a turn and every turn
    'calls' print(6*7) in the real sandbox, so episodes have executed tool calls from the first step."""

    def __init__(self, tokenizer, max_turns=3, max_episode_tokens=None, stop_ids=tuple(range(4, 40)), code=None):
        super().__init__(tokenizer, max_turns, max_episode_tokens, SandboxLimits(timeout_s=5, workers=4),
                         tool_format="markdown")
        self.stop_ids, self.code = tuple(stop_ids), code or "print(6*7)"

    def stop_token_ids(self, tokenizer):
        return self.stop_ids

    def turn_ended(self, messages, state):
        return True

    def parse_call(self, text):
        return self.code, None


class FixedObservationEnv(MultiTurnEnv):
    """Turns end at stop_ids; the observation is a fixed text (no sandbox): the driver and the masks alone."""

    def __init__(self, tokenizer, max_turns=3, max_episode_tokens=None, stop_ids=tuple(range(4, 40)),
                 observation=" obs! "):
        super().__init__(max_turns, max_episode_tokens)
        self.stop_ids, self.observation = tuple(stop_ids), observation

    def stop_token_ids(self, tokenizer):
        return self.stop_ids

    def is_completed(self, messages, state):
        return False

    def env_response(self, messages, state):
        return [{"role": "tool", "content": self.observation}], state


class RaisingEnv(FixedObservationEnv):
    """env_response raises on every other episode (by the prompt's answer): those end with a counted error."""

    def env_response(self, messages, state):
        if state["answer"] == "boom":
            raise RuntimeError("environment bug")
        return super().env_response(messages, state)
