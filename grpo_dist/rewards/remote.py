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
this entry out). Time limit: ``timeout_s`` seconds per request, the whole of it (connect, send, the answer's
headers and body: a server that drips its answer a byte at a time is cut at the deadline, whatever each read
takes), by default reward_timeout_s x (number of completions), like a batch function. The worst a call can take,
every attempt timing out plus the back-offs (worst_case_s), must be below distributed.timeout_s, or the other
ranks' collective would time out first: refused at start (specs.remote_time_problems). Retries: a refused or reset
connection, a timeout, HTTP 429 and 5xx are retried up to ``max_retries`` times (default 2), after 0.5 s, 1 s, 2 s, ...;
other HTTP errors (4xx) and a malformed answer (not JSON, no "rewards" list, a wrong length, a non-number) are not.
When the last attempt fails every item of the call is an error: scored 0.0, counted in reward_errors/<name>, the
first failure printed once.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

__all__ = ["RemoteScorer", "worst_case_s"]

BACKOFF_S = 0.5


def worst_case_s(request_timeout_s: float, max_retries: int) -> float:
    """The longest one call can take: every attempt cut at its deadline, plus the back-offs between them."""
    attempts = int(max_retries) + 1
    return attempts * float(request_timeout_s) + BACKOFF_S * (2 ** (attempts - 1) - 1)


class _Deadline:
    """One request's deadline: at `seconds` after start() every socket the request opened is shut down, which ends
    a blocked connect / send / read at once (a socket timeout only bounds each read on its own)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.expired = False
        self._socks: list = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def start(self) -> None:
        self._timer.start()

    def cancel(self) -> None:
        self._timer.cancel()

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def add(self, sock):
        with self._lock:
            self._socks.append(sock)
            if self.expired:
                _shut(sock)
        return sock

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._socks:
                _shut(sock)


def _shut(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _opener(deadline: _Deadline):
    """urllib's opener (proxies, redirects as usual) whose HTTP(S) connections register their sockets with the
    deadline and connect within what is left of it."""
    def connection(base):
        class Conn(base):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                real = self._create_connection

                def create(address, timeout=None, *rest, **kw):
                    left = deadline.remaining()
                    if left <= 0:
                        raise TimeoutError("timed out")
                    return deadline.add(real(address, min(left, timeout or left), *rest, **kw))
                self._create_connection = create
        return Conn

    class Http(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(connection(http.client.HTTPConnection), req)

    class Https(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(connection(http.client.HTTPSConnection), req, context=self._context)
    return urllib.request.build_opener(Http(), Https())


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
        deadline = _Deadline(timeout)
        deadline.start()
        try:
            raw = _exchange(req, timeout, deadline)
        except Exception:
            if deadline.expired:  # whatever the cut left (EOF, a reset, a partial answer) is the deadline's doing
                raise TimeoutError(f"timed out after {timeout:g} s") from None
            raise
        finally:
            deadline.cancel()
        if deadline.expired:
            raise TimeoutError(f"timed out after {timeout:g} s")
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise _Permanent(f"the answer is not JSON ({e}): {raw[:100]!r}") from None
        if not isinstance(data, dict) or "rewards" not in data:
            raise _Permanent(f'the answer has no "rewards" key; expected {{"rewards": [float | null, ...]}}, got '
                             f"{str(data)[:100]}")
        return data["rewards"]


def _exchange(req, timeout: float, deadline: _Deadline) -> bytes:
    """The answer's body; an HTTP error status is OSError (retried: 429, 5xx) or _Permanent (other 4xx)."""
    try:
        with _opener(deadline).open(req, timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:200].decode("utf-8", "replace").strip() if not deadline.expired else ""
        msg = f"HTTP {e.code} {e.reason}" + (f": {detail}" if detail else "")
        if e.code == 429 or e.code >= 500:
            raise OSError(msg) from None
        raise _Permanent(msg) from None


def _describe(e: Exception, timeout: float) -> str:
    inner = getattr(e, "reason", e)
    if isinstance(inner, (socket.timeout, TimeoutError)) or "timed out" in str(inner):
        return f"timed out after {timeout:g} s"
    return f"{type(inner).__name__}: {inner}"
