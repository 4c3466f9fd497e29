"""The non-finite guard names what went non-finite (grpo_dist/nonfinite.py), each cause forced on the tiny model:
reward (finite but enormous scores), advantage (a group spread that overflows float32), loss (NaN fault),
gradient (NaN gradients with a finite loss), parameters (learning_rate=1e10: a finite loss, a diverged update,
stopped before any checkpoint saves it). The message names the newest checkpoint, or says there is none."""

import pytest

from helpers import EQUIV_BASE as BASE


def _trainer(tmp_path, *extra):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, BASE + ["prompts_per_rank=2", "data.limit=8", f"output_dir={tmp_path / 'run'}",
                                    "max_consecutive_nonfinite=1", "save_steps=1", "max_steps=2", *extra])
    return GRPOTrainer(cfg, init_distributed(60))


def _stop_message(tr):
    from grpo_dist.trainer import NonFiniteError
    with pytest.raises(NonFiniteError) as err:
        tr.train()
    return str(err.value)


@pytest.mark.parametrize("reward, extra, cause, words", [
    ("huge", [], "reward", ["from reward function 'huge'", "1e+200", "rewards must be finite and of moderate size",
                            "Fix the reward function"]),
    ("near_float32_max", ["scale_rewards=none"], "advantage", ["non-finite advantages", "scale_rewards=none"]),
])
def test_enormous_rewards_are_named(reward, extra, cause, words, tmp_path):
    tr = _trainer(tmp_path, f"rewards=[{{function: 'reward_fns:{reward}'}}]", *extra)
    msg = _stop_message(tr)
    assert msg.startswith(f"{cause}: 1 consecutive steps had "), msg
    for w in words:
        assert w in msg, msg
    assert "learning_rate" not in msg and f"There is no checkpoint in {tmp_path / 'run'}" in msg, msg


@pytest.mark.parametrize("fault, cause, words", [("nan", "loss", "a NaN/inf loss"),
                                                 ("nan_grad", "gradient", "a NaN/inf gradient norm")])
def test_loss_and_gradient_are_named_with_the_newest_checkpoint(fault, cause, words, tmp_path, monkeypatch):
    """With async_save (the default) step 1's checkpoint is still being written when step 2 stops: the message
    waits for it. The write is slowed so that the race is always lost without that wait (CI found it once)."""
    import time

    from grpo_dist import checkpoint
    slow_run = checkpoint._SaveJob.run
    monkeypatch.setattr(checkpoint._SaveJob, "run", lambda job: (time.sleep(1.0), slow_run(job))[1])
    monkeypatch.setenv("GRPO_DIST_FAULT", f"{fault}@step2")
    tr = _trainer(tmp_path, "rewards=[{function: 'reward_fns:odd_length'}]")
    msg = _stop_message(tr)
    assert msg.startswith(f"{cause}: 1 consecutive steps had {words}") and "(the last: step 2)" in msg, msg
    assert f"The newest checkpoint, {tmp_path / 'run' / 'checkpoint-1'}, holds" in msg, msg
    assert "Lower learning_rate" in msg


def test_diverged_update_stops_before_any_checkpoint(tmp_path):
    tr = _trainer(tmp_path, "rewards=[{function: 'reward_fns:odd_length'}]", "learning_rate=1e10")
    msg = _stop_message(tr)
    assert msg.startswith("parameters: the parameters' norm grew") and "at step 1" in msg, msg
    assert f"There is no checkpoint in {tmp_path / 'run'}" in msg and "Lower learning_rate" in msg, msg
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_a_remote_scorers_enormous_rewards_are_named_not_the_learning_rate(tmp_path, capfd):
    """A remote scorer answering +-1e300: the step is skipped, and the health line of that step names the scorer
    and the cause, as the stop message does; on the code before it said "numerical blow-up ... lower
    learning_rate"."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Huge(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            data = json.dumps({"rewards": [1e300 if i % 2 else -1e300
                                           for i in range(len(body["completions"]))]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Huge)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        tr = _trainer(tmp_path, f"rewards=[{{url: 'http://127.0.0.1:{srv.server_address[1]}/', name: judge}}]",
                      "max_consecutive_nonfinite=2", "health.enabled=true")
        msg = _stop_message(tr)
    finally:
        srv.shutdown()
        srv.server_close()
    assert "from reward function 'judge'" in msg and "learning_rate" not in msg, msg
    captured = capfd.readouterr()
    health = [ln for ln in (captured.out + captured.err).splitlines() if "health: nonfinite" in ln]
    assert len(health) == 1, health
    assert "non-finite rewards from reward function 'judge' (|weight x reward| up to 1e+300)" in health[0], health
    assert "learning_rate" not in health[0] and "fix the reward function" in health[0], health
