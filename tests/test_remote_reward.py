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
        if self.path == "/drip":  # the whole answer, headers included, one byte every 0.3 s (never 1 s apart)
            reply = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 29\r\n\r\n"
                     b'{"rewards": [1.0, 1.0, 1.0]}\n')
            try:
                for i in range(len(reply)):
                    self.wfile.write(reply[i:i + 1])
                    self.wfile.flush()
                    time.sleep(0.3)
            except OSError:  # the client hung up: done
                pass
            self.close_connection = True
            return
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


def test_a_dripping_server_is_cut_at_the_request_deadline(server, capfd):
    """timeout_s bounds the whole request, not each socket read: a server sending a byte every 0.3 s (each read
    well within 1 s) held the call for the whole ~26 s answer on the code before; now it is cut at 1 s."""
    t0 = time.monotonic()
    rc, totals, per_fn = _score(server + "/drip", timeout_s=1, max_retries=0)
    took = time.monotonic() - t0
    assert took < 3.0, took
    assert rc.last_errors["judge"] == 3 and per_fn["judge"] == [0.0] * 3
    err = capfd.readouterr().err
    assert "timed out after 1 s" in err, err


def test_a_request_bound_beyond_the_collective_timeout_is_refused_at_start():
    """reward_timeout_s x completions per rank (the default request bound), x attempts, must end before a waiting
    rank's collective times out (5 s x 16 x 8 = 640 s > 600 s): refused naming the keys, before any model loads."""
    from grpo_dist.config import ConfigError, load_config
    base = ["model.tiny={architecture: qwen2, hidden_size: 32, num_hidden_layers: 1}", "num_generations=8",
            "rewards=[{url: 'http://127.0.0.1:9/score', name: judge, max_retries: 0}]"]
    with pytest.raises(ConfigError) as err:
        load_config(None, base + ["prompts_per_rank=16"])
    msg = str(err.value)
    assert "config key 'rewards[0].timeout_s'" in msg and "640" in msg and "distributed.timeout_s = 600" in msg, msg
    load_config(None, base + ["prompts_per_rank=14"])  # 560 s: fits
    with pytest.raises(ConfigError, match=r"3 attempts"):  # retries wait too: 3 x 280 s + backoff
        load_config(None, base[:2] + ["prompts_per_rank=7", "rewards=[{url: 'http://127.0.0.1:9/score'}]"])
    load_config(None, base[:2] + ["prompts_per_rank=7", "distributed.timeout_s=900",
                                  "rewards=[{url: 'http://127.0.0.1:9/score'}]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.timeout_s"):  # an explicit per-request bound likewise
        load_config(None, base[:2] + ["rewards=[{url: 'http://127.0.0.1:9/score', timeout_s: 700, max_retries: 0}]"])
