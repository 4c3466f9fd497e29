"""The config's error type (ConfigError) and the bounded one-line messages every problem is written with.

A leaf: it imports nothing of grpo_dist, so that every module a config check calls into (the reward specs,
preflight, the data loaders) can raise and word a config problem without importing the config, which imports them.
"""

from __future__ import annotations

from typing import Any


# The longest a problem may print (the longest real one, an unknown top-level key with the allowed keys, is ~900
# characters): a hostile value (a 72 MB YAML alias expansion, a 10 MB override) never reaches the console whole.
MAX_PROBLEM_CHARS = 2000


def clip(text: Any, limit: int = 80) -> str:
    """str(text), cut to `limit` characters with a count of the rest: for values and keys shown in messages."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}...[{len(text) - limit} more chars]"


def short(value: Any, limit: int = 80) -> str:
    """repr(value), cut like clip(): every value a message shows goes through this."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit str limit
        text = f"<{type(value).__name__} too large to print>"
    return clip(text, limit)


class ConfigError(ValueError):
    """A configuration problem, always naming the key (and file) at fault. `problems` lists every problem found
    (the message shows the first and counts the rest; `python -m grpo_dist.config --check` prints them all).
    Every problem is one line of at most MAX_PROBLEM_CHARS characters."""

    def __init__(self, message: str, problems: list[str] | None = None):
        message = _one_bounded_line(message)
        super().__init__(message)
        self.problems = [_one_bounded_line(p) for p in problems] if problems else [message]


def nearest_key_value(mapping: dict[str, Any], key: str) -> Any:
    """mapping[key], else the value of the nearest enclosing dotted key ("a.b[0].c" -> "a.b[0]" -> "a.b" -> "a")
    that the mapping has; None when none has one."""
    while key:
        if key in mapping:
            return mapping[key]
        cut = max(key.rfind("."), key.rfind("["))
        key = key[:cut] if cut > 0 else ""
    return None


def _one_bounded_line(text: str) -> str:
    return clip(" ".join(str(text).split()) if "\n" in str(text) else text, MAX_PROBLEM_CHARS)


def _raise_all(problems: list[str], where: str = "") -> None:
    """Raise one ConfigError carrying every problem, if there are any."""
    if not problems:
        return
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    raise ConfigError(f"{where}{problems[0]}{more}", problems)

