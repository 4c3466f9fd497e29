"""Remote scorers (an LLM judge, a code sandbox): ``rewards: [{url: http://host:port/score, weight: w, timeout_s,
max_retries}]``.

Each reward call sends this rank's batch in one HTTP request (standard library only)::

    POST <url>   Content-Type: application/json
    {"prompts":        [str, ...],          # the problem text of each row (message lists in conversational mode)
     "completions":    [str, ...],          # (message lists in conversational mode)
     "completion_ids": [[int, ...], ...],
     "references":     [str, ...],          # the reference answers
     "<column>":       [value, ...], ...}   # every other dataset column, by name

    200 OK   {"rewards": [float | null, ...]}   # one per completion, in order; null: does not apply

``null`` is "not applicable", as None from a batch function (grpo_dist.rewards.batch: the completion's total leaves
this entry out). Time limit: ``timeout_s`` seconds per request (the socket timeout of each connect / read), by
default reward_timeout_s x (number of completions), like a batch function. Retries: a refused or reset connection,
a timeout, HTTP 429 and 5xx are retried up to ``max_retries`` times (default 2), after 0.5 s, 1 s, 2 s, ...;
other HTTP errors (4xx) and a malformed answer (not JSON, no "rewards" list, a wrong length, a non-number) are not.
When the last attempt fails every item of the call is an error: scored 0.0, counted in reward_errors/<name>, the
first failure printed once.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request

__all__ = ["RemoteScorer"]

BACKOFF_S = 0.5


class _Permanent(Exception):
    """A failure that a retry would not fix (4xx, a malformed answer)."""


class RemoteScorer:
    def __init__(self, url: str, timeout_s: float, request_timeout_s: float | None = None, max_retries: int = 2):
        self.url = url
        self.timeout_s = float(timeout_s)            # per completion, when request_timeout_s is not set
        self.request_timeout_s = request_timeout_s
        self.max_retries = int(max_retries)
        self.stats = {"requests": 0, "retries": 0}

    def _timeout(self, n: int) -> float:
        return float(self.request_timeout_s) if self.request_timeout_s else self.timeout_s * max(1, n)

    def score(self, batch) -> tuple[list, list]:
        from grpo_dist.rewards.batch import check_batch_result
        n = len(batch)
        if n == 0:
            return [], []
        try:
            body = json.dumps(batch.arguments(), allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            return [0.0] * n, [f"the batch cannot be sent as JSON ({e}): dataset columns must be JSON values"] * n
        timeout = self._timeout(n)
        attempts = self.max_retries + 1
        reason = ""
        for attempt in range(attempts):
            if attempt:
                self.stats["retries"] += 1
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                rewards = self._post(body, timeout)
            except _Permanent as e:
                reason = str(e)
                break
            except (TimeoutError, urllib.error.URLError, OSError, http.client.HTTPException) as e:  # transient
                reason = _describe(e, timeout)
                continue
            return check_batch_result(rewards, n, what=f"POST {self.url} answered")
        tries = f" (after {attempt + 1} attempts)" if attempt else ""
        return [0.0] * n, [f"POST {self.url}: {reason}{tries}"] * n

    def close(self) -> None:
        pass

    def _post(self, body: bytes, timeout: float):
        self.stats["requests"] += 1
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:200].decode("utf-8", "replace").strip()
            msg = f"HTTP {e.code} {e.reason}" + (f": {detail}" if detail else "")
            if e.code == 429 or e.code >= 500:
                raise OSError(msg) from None
            raise _Permanent(msg) from None
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise _Permanent(f"the answer is not JSON ({e}): {raw[:100]!r}") from None
        if not isinstance(data, dict) or "rewards" not in data:
            raise _Permanent(f'the answer has no "rewards" key; expected {{"rewards": [float | null, ...]}}, got '
                             f"{str(data)[:100]}")
        return data["rewards"]


def _describe(e: Exception, timeout: float) -> str:
    inner = getattr(e, "reason", e)
    if isinstance(inner, (socket.timeout, TimeoutError)) or "timed out" in str(inner):
        return f"timed out after {timeout:g} s"
    return f"{type(inner).__name__}: {inner}"
