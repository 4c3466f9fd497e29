"""Remote scorers (grpo_dist.rewards.remote) against an HTTP server this test starts on 127.0.0.1: the batch goes
out as JSON, the rewards come back; a 500 is retried, a timeout, a malformed answer, a wrong length and an
unreachable server make every item an error, counted and printed once."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_dist.rewards import RewardComputer

pytestmark = pytest.mark.fast


class Scorer(BaseHTTPRequestHandler):
    """POST /ok: rewards = len(completion) (None when the row's 'solution' column is empty); /flaky: 500 on the first
    request, then /ok; /slow: answers after 2 s; /bad: not JSON; /short: one reward too few."""
    requests: list = []
    flaky_left = 1

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        if self.path == "/flaky" and type(self).flaky_left > 0:
            type(self).flaky_left -= 1
            return self._send(500, b"busy")
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/bad":
            return self._send(200, b"{rewards: oops")
        rewards = [None if body.get("solution", ["x"] * len(body["completions"]))[i] == "" else float(len(c))
                   for i, c in enumerate(body["completions"])]
        if self.path == "/short":
            rewards = rewards[:-1]
        self._send(200, json.dumps({"rewards": rewards}).encode())

    def _send(self, code, data):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Scorer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    import grpo_dist.rewards.remote as remote
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    Scorer.requests.clear()


def _score(url, **spec):
    with RewardComputer([{"url": url, "name": "judge", **spec}, "reward_fns:odd_length"], num_workers=0,
                        timeout_s=5) as rc:
        totals, per_fn = rc(["a", "bb", "ccc"], ["1", "2", "3"], prompts=["p1", "p2", "p3"],
                            completion_ids=[[4], [5, 5], [6, 6, 6]], columns={"solution": ["1", "", "3"]})
    return rc, totals, per_fn


def test_success_schema_and_null(server):
    rc, totals, per_fn = _score(server + "/ok", weight=0.5)
    assert rc.last_errors == {"judge": 0, "odd_length": 0}
    assert per_fn["judge"][0] == 1.0 and per_fn["judge"][2] == 3.0 and per_fn["judge"][1] != per_fn["judge"][1]
    assert totals == [0.5 + 1, 0.0, 1.5 + 1]  # null: left out of the row's total
    (path, body), = Scorer.requests
    assert path == "/ok" and body == {"prompts": ["p1", "p2", "p3"], "completions": ["a", "bb", "ccc"],
                                      "completion_ids": [[4], [5, 5], [6, 6, 6]], "references": ["1", "2", "3"],
                                      "solution": ["1", "", "3"]}


def test_500_then_success_is_retried(server):
    Scorer.flaky_left = 1
    rc, _, per_fn = _score(server + "/flaky")
    assert rc.last_errors["judge"] == 0 and per_fn["judge"][0] == 1.0
    assert [p for p, _ in Scorer.requests] == ["/flaky", "/flaky"]


@pytest.mark.parametrize("path, spec, message", [
    ("/slow", {"timeout_s": 0.3, "max_retries": 1}, "timed out after 0.3 s (after 2 attempts)"),
    ("/bad", {}, "the answer is not JSON"),
    ("/short", {}, "answered 2 scores for 3 completions"),
])
def test_failures_make_every_item_an_error(server, path, spec, message, capfd):
    rc, totals, per_fn = _score(server + path, **spec)
    assert rc.last_errors == {"judge": 3, "odd_length": 0}
    assert per_fn["judge"] == [0.0] * 3 and totals == [1.0, 0.0, 1.0]
    err = capfd.readouterr().err
    assert err.count("reward function 'judge'") == 1 and message in err, err
    # retried only what a retry can fix: the timeout, not a malformed answer
    assert len(Scorer.requests) == (2 if path == "/slow" else 1)


def test_unreachable_server(capfd):
    from dist_utils import free_port
    rc, _, _ = _score(f"http://127.0.0.1:{free_port()}/score", max_retries=2)
    assert rc.last_errors["judge"] == 3
    err = capfd.readouterr().err
    assert "Connection refused" in err and "(after 3 attempts)" in err, err
