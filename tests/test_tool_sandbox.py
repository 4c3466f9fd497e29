"""Hostile code in the Python tool's sandbox (grpo_dist/environments/sandbox.py), run directly: each case ends that
call with a counted error and an output that says so, leaves no process behind and changes nothing outside the
sandbox folder; the calls beside it run normally."""

import os
from pathlib import Path

import pytest

from grpo_dist.environments import PythonToolEnv, SandboxLimits, run_python

LIMITS = SandboxLimits(timeout_s=1.5, cpu_s=2, memory_mb=512, max_output_chars=300, workers=4)
OUTSIDE = Path("/tmp/grpo_tool_sandbox_test_outside")

CASES = {  # name: (code, expected error, a phrase the output must hold)
    "infinite_loop": ("while True:\n    pass", "timeout", "time limit"),
    "sleep_forever": ("import time\ntime.sleep(1000)", "timeout", "time limit"),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", "exception", "os.fork is not allowed"),
    "posix_spawn": ("import os\nos.posix_spawn('/bin/sh', ['sh'], {})", "exception", "not allowed"),
    "subprocess": ("import subprocess\nsubprocess.run(['sleep', '100'])", "exception", "not allowed"),
    "memory_bomb": ("x = bytearray(4 * 1024 ** 3)", "exception", "MemoryError"),
    "print_100mb": ("print('x' * 100_000_000)", "output_limit", "stopped"),
    "endless_output": ("while True:\n    print('y' * 100)", "output_limit", "stopped"),
    "read_file_outside": ("print(open('/etc/hostname').read())", "exception", "not allowed"),
    "read_proc_environ": ("print(open(f'/proc/{__import__(\"os\").getppid()}/environ').read())", "exception",
                          "not allowed"),
    "write_outside": (f"open('{OUTSIDE}', 'w').write('x')", "exception", "not allowed"),
    "remove_outside": (f"import os\nos.remove('{OUTSIDE}.keep')", "exception", "not allowed"),
    "socket": ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", "exception", "not allowed"),
    "os_exit": ("import os\nos._exit(0)", "exception", "not allowed"),
    "posix_exit": ("import posix\nposix._exit(0)", "exception", "not allowed"),
    "kill_parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "exception", "os.kill is not allowed"),
    "ctypes_call": ("import ctypes\nctypes.CDLL(None).exit(0)", "exception", "not allowed"),
    "syntax_error": ("def (", "exception", "SyntaxError"),
}


def _gone(pid):
    """No process of the sandbox's session (it leads it) is left."""
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        assert int(fields[3]) != pid, f"process {stat.parent.name} of the sandbox's session is alive"


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_code_ends_its_call_with_a_counted_error(case, monkeypatch):
    code, error, phrase = CASES[case]
    OUTSIDE.unlink(missing_ok=True)
    keep = Path(f"{OUTSIDE}.keep")
    keep.write_text("keep")
    monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")
    hostile, fine = run_python([code, "print(6 * 7)"], LIMITS)
    assert hostile.error == error, (hostile.error, hostile.output)
    assert phrase in hostile.output and "hunter2" not in hostile.output
    assert len(hostile.output) < LIMITS.max_output_chars + 200
    assert fine.error is None and fine.output == "42\n"  # the call beside it ran normally
    _gone(hostile.pid)
    _gone(fine.pid)
    assert not OUTSIDE.exists() and keep.read_text() == "keep"
    keep.unlink()


@pytest.mark.fast
def test_no_secrets_in_the_environment(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")
    res, = run_python(["import os\nprint(sorted(os.environ))"], LIMITS)
    assert res.error is None and "GRPO_TEST_SECRET" not in res.output and "HOME" in res.output


def test_math_libraries_work_and_the_last_expression_is_shown():
    res = run_python(["import sympy\nsympy.factor('x**2 - 1')", "import math\nmath.comb(10, 3)",
                      "open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())"], LIMITS)
    assert [r.output for r in res] == ["(x - 1)*(x + 1)\n", "120\n", "ok\n"]
    assert all(r.error is None for r in res)


def test_malformed_tool_calls_are_counted_errors_with_an_observation_that_says_so():
    env = PythonToolEnv(None, limits=LIMITS, tool_format="qwen")
    turns = ['<tool_call>\n{"name": "python", "arguments": {"code": "print(1+1)"}}\n</tool_call>',
             "<tool_call>\nnot json\n</tool_call>",
             '<tool_call>\n{"name": "bash", "arguments": {"code": "ls"}}\n</tool_call>',
             "no call at all </tool_call>"]
    items = [([{"role": "assistant", "content": t}], {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0,
                                                      "tool_seconds": 0.0}) for t in turns]
    out = env.env_response_batch(items)
    texts = [obs[0]["content"] for obs, _ in out]
    assert texts[0] == "2\n" and all("malformed tool call" in t for t in texts[1:])
    assert [s["tool_errors"] for _, s in out] == [0, 1, 1, 1] and [s["tool_calls"] for _, s in out] == [1, 0, 0, 0]
    md = PythonToolEnv(None, limits=LIMITS, tool_format="markdown")
    (obs, state), = md.env_response_batch([([{"role": "assistant", "content": "```\nls\n```"}],
                                            dict(items[0][1], tool_errors=0))])
    assert "malformed tool call" in obs[0]["content"] and state["tool_errors"] == 1
    assert "```output\n" in md.render_observation(obs, None)
    assert "<tool_response>" in env.render_observation(obs, None)


def test_the_episode_tool_time_budget_refuses_later_calls():
    env = PythonToolEnv(None, limits=LIMITS, tool_format="markdown", episode_timeout_s=1.0)
    state = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_seconds": 0.0}
    msg = [{"role": "assistant", "content": "```python\nimport time\ntime.sleep(5)\n```"}]
    (obs, state), = env.env_response_batch([(msg, state)])
    assert state["tool_timeouts"] == 1 and state["tool_seconds"] >= 1.0
    (obs, state), = env.env_response_batch([(msg, state)])
    assert "tool time (1 s) is used up" in obs[0]["content"] and state["tool_errors"] == 2


@pytest.mark.fast
def test_ran_python_rewards_a_tool_answer_that_is_not_an_error():
    from grpo_dist.environments.python_tool import ran_python
    assert ran_python("```python\nprint(6*7)\n```\n```output\n42\n```\nThe final answer is 42.", "42") == 1.0
    assert ran_python("<tool_response>\n42\n</tool_response>", "42") == 1.0
    for bad in ("```output\n[tool error: malformed tool call: no closed ```python block]\n```",
                "```output\nTraceback (most recent call last):\nNameError\n```", "```output\n\n```", "42"):
        assert ran_python(bad, "42") == 0.0


@pytest.mark.fast
def test_answer_after_tool_reads_the_last_number_the_model_writes_after_the_tool():
    from grpo_dist.environments.python_tool import answer_after_tool
    ran = "```python\nprint(28 * 19)\n```\n```output\n532\n```\n"
    assert answer_after_tool(ran + "The output is 532.", "532") == 1.0
    assert answer_after_tool(ran + "It prints 28 * 19, which is 474.", "532") == 0.0   # the model's own number counts
    assert answer_after_tool(ran, "532") == 0.0                                          # the tool's alone does not
    assert answer_after_tool(ran + "The final answer is 532.\n", "532") == 1.0
    assert answer_after_tool("28 * 19 = 532", "532") == 1.0                                # no tool: the whole text
    assert answer_after_tool("<tool_response>\n6975\n</tool_response>The answer is 6,975.", "6975") == 1.0
    assert answer_after_tool("I don't know.", "532") == 0.0
