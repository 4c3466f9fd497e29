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
