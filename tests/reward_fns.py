"""Reward functions for tests (importable as reward_fns:NAME when tests/ is on sys.path)."""


def odd_length(completion: str, reference: str) -> float:
    """Cheap, text-dependent reward so that groups have different rewards."""
    return float(len(completion) % 2)


def exact(completion: str, reference: str) -> float:
    return float(completion.strip() == reference.strip())


def char_parity(completion: str, reference: str) -> float:
    """Varies from completion to completion of random text (so groups are not flat)."""
    return float(sum(map(ord, completion)) % 2)


def broken(completion: str, reference: str) -> float:
    raise KeyError("no such field")


def returns_none(completion: str, reference: str):
    return None


def returns_bad(completion: str, reference: str):
    """A different wrong value per completion: NaN, inf, a string, a list; a number for a quarter of them."""
    return [float("nan"), float("inf"), "1.0", [1.0, 0.0], 1.0][len(completion) % 5]


def slow(completion: str, reference: str) -> float:
    import time
    time.sleep(30)
    return 1.0


def broken_on_rank0(completion: str, reference: str) -> float:
    """Fails where BROKEN_RANK names this rank (or 'all'); scores 1 elsewhere."""
    import os
    which = os.environ.get("BROKEN_RANK", "")
    if which == "all" or which == os.environ.get("RANK"):
        raise RuntimeError("broken here")
    return 1.0


def always_one(completion: str, reference: str) -> float:
    return 1.0


# ------------------------------------------------------------- TRL's batch contract (grpo_dist.rewards.batch)
# Written with the signature TRL's documentation gives reward functions: called once per batch with keyword
# arguments, every dataset column by name as a list, one float (or None: does not apply) per completion.

def trl_length_reward(completions, **kwargs):
    """A length-based reward in TRL's form: the closer to 6 characters, the better."""
    return [-abs(6 - len(completion)) / 6 for completion in completions]


def trl_solution_reward(prompts, completions, completion_ids, solution, **kwargs) -> list:
    """1.0 when the completion contains the row's `solution` column; None (does not apply) where it is empty."""
    return [None if not s else float(str(s) in c) for c, s in zip(completions, solution)]


def trl_format_reward(completions, **kwargs):
    """A format reward for conversational completions ([{"role": "assistant", "content": ...}])."""
    import re
    return [1.0 if re.fullmatch(r"<think>.*</think>.*", c[0]["content"], re.S) else 0.0 for c in completions]


def batch_echo(prompts, completions, completion_ids, references, **kwargs):
    """What it was given, folded into numbers: len(prompt) + 100 * len(ids) + 10000 * (reference == column 'gold')."""
    gold = kwargs.get("gold") or [None] * len(completions)
    return [len(p) + 100 * len(i) + 10000 * (r == g) for p, i, r, g in zip(prompts, completion_ids, references, gold)]


def batch_raises(completions, **kwargs):
    raise ValueError("judge exploded")


def batch_short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def batch_mixed(completions, **kwargs):
    """None (n/a), a number, NaN, a string, in turn."""
    return [[None, 1.0, float("nan"), "x"][i % 4] for i in range(len(completions))]


def batch_slow(completions, **kwargs):
    import time
    time.sleep(30)
    return [1.0] * len(completions)


def batch_by_config(references, completions):
    """Not detected as batch form (first parameter 'references', no **kwargs): `batch: true` declares it."""
    return [float(r in c) for r, c in zip(references, completions)]


def per_item_with_kwargs(completion, reference, **kwargs):
    """Looks batch-form (**kwargs): `batch: false` declares it per completion."""
    return float(reference in completion)


def batch_crash(completions, **kwargs):
    """Kills its worker process when a completion says CRASH."""
    import os
    if any("CRASH" in c for c in completions):
        os._exit(3)
    return [1.0] * len(completions)


def calls_sys_exit(completion: str, reference: str) -> float:
    """sys.exit(0) where EXIT_RANK names this rank (or is unset): must be a reward error, not the end of the run."""
    import os
    import sys
    if os.environ.get("EXIT_RANK", os.environ.get("RANK")) == os.environ.get("RANK"):
        sys.exit(0)
    return float(len(completion) % 2)


def calls_os_exit(completion: str, reference: str) -> float:
    """os._exit(0) where EXIT_RANK names this rank (or is unset): the process would end at once, code 0."""
    import os
    if os.environ.get("EXIT_RANK", os.environ.get("RANK")) == os.environ.get("RANK"):
        os._exit(0)
    return float(len(completion) % 2)


def forks_sleeper(completion: str, reference: str) -> float:
    """Forks a grandchild that sleeps for 10 minutes and writes its pid into SLEEPER_DIR; then does what
    SLEEPER_THEN says: 'return' (score 1), 'hang' (sleep past the time limit) or 'crash' (os._exit(1))."""
    import os
    import time
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    with open(os.path.join(os.environ["SLEEPER_DIR"], str(pid)), "w"):
        pass
    then = os.environ.get("SLEEPER_THEN", "return")
    if then == "hang":
        time.sleep(600)
    elif then == "crash":
        os._exit(1)
    return 1.0


def huge(completion: str, reference: str) -> float:
    """Finite, so no reward error, but 1e200 overflows float32 (and its square float64)."""
    return 1e200 if len(completion) % 2 else -1e200


def near_float32_max(completion: str, reference: str) -> float:
    """Finite in float32, but r - mean of a group overflows it (with scale_rewards=none)."""
    return 3.3e38 if len(completion) % 2 else -3.3e38


def batch_calls_sys_exit(completions, **kwargs):
    """The batch form (TRL's contract) of calls_sys_exit."""
    import sys
    sys.exit(0)


def batch_calls_os_exit(completions, **kwargs):
    """The batch form of calls_os_exit."""
    import os
    os._exit(0)


def batch_forks_sleeper(completions, **kwargs):
    """The batch form of forks_sleeper: one grandchild per call, then what SLEEPER_THEN says."""
    return [forks_sleeper(c, "") for c in completions[:1]] * len(completions)


def hangs_once(completion: str, reference: str) -> float:
    """Hangs (10 minutes) on the first completion it grades in the run, then scores odd length: one timeout per
    run, whatever the sampled text. The run's marker file is named by GRPO_DIST_TEST_HANG_ONCE."""
    import os
    import time
    try:
        os.close(os.open(os.environ["GRPO_DIST_TEST_HANG_ONCE"], os.O_CREAT | os.O_EXCL))
        time.sleep(600)
    except FileExistsError:
        pass
    return float(len(completion) % 2)


def calls_posix_exit(completion: str, reference: str) -> float:
    """posix._exit(0): the same C function as os._exit, reached through the posix module."""
    import posix
    posix._exit(0)
    return 0.0


def calls_os_abort(completion: str, reference: str) -> float:
    """os.abort(): SIGABRT, no cleanup, no checkpoint."""
    import os
    os.abort()
    return 0.0


def calls_raise_signal(completion: str, reference: str) -> float:
    """signal.raise_signal(SIGKILL) on the trainer process."""
    import signal
    signal.raise_signal(signal.SIGKILL)
    return 0.0


def kills_itself(completion: str, reference: str) -> float:
    """os.kill(os.getpid(), SIGKILL)."""
    import os
    import signal
    os.kill(os.getpid(), signal.SIGKILL)
    return 0.0
