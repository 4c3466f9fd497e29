"""The built-in Python tool for math (`environment.tools: [python]`): the model writes code, a sandbox runs it
(grpo_dist/environments/sandbox.py), the output comes back as the next turn.

Two call formats, chosen from the tokenizer (environment.tool_format: auto):

    qwen      the chat template knows tool calls (Qwen2.5 / Qwen3: `<tool_call>` and `</tool_call>` are tokens):
              <tool_call>\n{"name": "python", "arguments": {"code": "..."}}\n</tool_call>
              answered as a tool message in the template's own form: <|im_end|>\n<|im_start|>user\n<tool_response>
              \n...\n</tool_response><|im_end|>\n<|im_start|>assistant\n
    markdown  any other model (SmolLM2): a ```python code block, answered by a ```output block after it (ToRL's
              form). The closing fence and the opening one are the same string, so a stop at an opening fence
              does not end the turn (turn_ended).

Every call that fails ends with an observation that says why and is counted: malformed markup (tool_errors), an
exception, a timeout (tool_errors and tool_timeouts), output past the limit, the episode's tool time used up.
"""

from __future__ import annotations

import json
import re

from grpo_dist.environments.base import Messages, MultiTurnEnv, State
from grpo_dist.environments.sandbox import SandboxLimits, ToolResult, run_python

FENCE = "```"
_PY_BLOCK = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)
_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def chat_tool_format(tokenizer) -> str:
    """qwen where the tokenizer has <tool_call> / </tool_call> as single tokens and its chat template uses them,
    else markdown."""
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab()
    if "<tool_call>" in str(template) and "<tool_call>" in vocab and "</tool_call>" in vocab:
        return "qwen"
    return "markdown"


class PythonToolEnv(MultiTurnEnv):
    """Math with a Python interpreter: every tool call runs in a fresh sandbox (calls of one segment run in
    parallel, limits.workers at a time); episode_timeout_s bounds one episode's tool time in all."""

    def __init__(self, tokenizer, max_turns: int = 4, max_episode_tokens: int | None = None,
                 limits: SandboxLimits | None = None, episode_timeout_s: float = 20.0, tool_format: str = "auto"):
        super().__init__(max_turns, max_episode_tokens)
        self.limits = limits or SandboxLimits()
        self.episode_timeout_s = episode_timeout_s
        self.format = chat_tool_format(tokenizer) if tool_format == "auto" else tool_format
        self.stop_strings = ("</tool_call>",) if self.format == "qwen" else (FENCE,)

    def is_completed(self, messages: Messages, state: State) -> bool:
        return False  # the episode ends at EOS or a limit

    def turn_ended(self, messages: Messages, state: State) -> bool:
        if self.format == "qwen":
            return True
        text = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""
        return text.count(FENCE) % 2 == 0  # an odd count: the model just opened a block

    def parse_call(self, text: str) -> tuple[str | None, str | None]:
        """(code, None) for the turn's last tool call, or (None, what is wrong with it)."""
        if self.format == "qwen":
            calls = _QWEN_CALL.findall(text)
            if not calls:
                return None, "malformed tool call: no <tool_call>...</tool_call> in the turn"
            try:
                call = json.loads(calls[-1].strip())
            except ValueError as e:
                return None, f"malformed tool call: not JSON ({e})"
            args = call.get("arguments") if isinstance(call, dict) else None
            if isinstance(args, str):  # some models send the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    args = None
            if not isinstance(call, dict) or call.get("name") != "python" or not isinstance(args, dict) \
                    or not isinstance(args.get("code"), str):
                return None, 'malformed tool call: expected {"name": "python", "arguments": {"code": "..."}}'
            return args["code"], None
        blocks = _PY_BLOCK.findall(text)
        if not blocks:
            return None, "malformed tool call: no closed ```python block"
        lang, code = blocks[-1]
        if not lang:
            return None, "malformed tool call: a code block without ```python (only Python runs)"
        return code, None

    def env_response_batch(self, items: list[tuple[Messages, State]]
                           ) -> list[tuple[Messages | str | None, State]]:
        codes: list[str] = []
        where: list[tuple[int, float]] = []
        results: list[str] = []
        for i, (messages, state) in enumerate(items):
            code, problem = self.parse_call(messages[-1]["content"] if messages else "")
            left = self.episode_timeout_s - state["tool_seconds"]
            if problem is None and left <= 0:
                problem = f"the episode's tool time ({self.episode_timeout_s:g} s) is used up: the call was not run"
            if problem is not None or code is None:
                state["tool_errors"] += 1
                results.append(f"[tool error: {problem}]")
            else:
                codes.append(code)
                where.append((i, left))
                results.append("")
        ran = run_python(codes, self.limits, [left for _, left in where]) if codes else []
        for (i, _), res in zip(where, ran):
            results[i] = self._account(items[i][1], res)
        return [([{"role": "tool", "content": text}], state) for text, (_, state) in zip(results, items)]

    def env_response(self, messages: Messages, state: State) -> tuple[Messages | str | None, State]:
        return self.env_response_batch([(messages, state)])[0]

    @staticmethod
    def _account(state: State, res: ToolResult) -> str:
        state["tool_calls"] += 1
        state["tool_seconds"] += res.seconds
        if res.error is not None:
            state["tool_errors"] += 1
            state["tool_timeouts"] += res.error == "timeout"
        return res.output if res.output.strip() else "[no output: print() what you need]"

    def render_observation(self, observation: Messages | str, tokenizer) -> str:
        text = observation if isinstance(observation, str) else "\n".join(m["content"] for m in observation)
        if self.format == "qwen":
            return (f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n"
                    f"<|im_start|>assistant\n")
        return f"\n{FENCE}output\n{text.rstrip()}\n{FENCE}\n"


def ran_python(completion: str, reference: str) -> float:
    """A shaping reward for tool use (`grpo_dist.environments.python_tool:ran_python`): 1.0 when the episode holds
    a tool's answer that is not an error (a ```output or <tool_response> block without '[tool error' or a
    traceback), else 0.0. With a small weight it gives a model that rarely calls the tool a learning signal."""
    for block in re.findall(r"```output\n(.*?)```|<tool_response>(.*?)</tool_response>", completion, re.DOTALL):
        text = block[0] or block[1]
        if text.strip() and "[tool error" not in text and "Traceback" not in text and "[stopped" not in text:
            return 1.0
    return 0.0


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_TOOL_ANSWER_END = re.compile(r"```output\n.*?```|</tool_response>", re.DOTALL)


def answer_after_tool(completion: str, reference: str) -> float:
    """The CPU tool recipe's grader (`grpo_dist.environments.python_tool:answer_after_tool`, in
    configs/tool_math_cpu.yaml): 1.0 when the last number the model writes after the last tool output (the whole
    text where no tool ran) equals the integer reference, else 0.0. The number must be in the model's own text: a
    tool output alone, with nothing after it, scores 0. Looser than math_reward (which wants "The final answer is
    N"), so it is only this recipe's; bench/tool_math.py reports both."""
    ends = [m.end() for m in _TOOL_ANSWER_END.finditer(completion)]
    numbers = _NUMBER.findall(completion[ends[-1]:] if ends else completion)
    if not numbers:
        return 0.0
    try:
        return float(float(numbers[-1].replace(",", "")) == float(reference.strip().replace(",", "")))
    except ValueError:
        return 0.0
