"""2 GRPO steps on 2 ranks scored by all three new kinds of reward entry at once (one spawn): TRL batch-form
functions unchanged (one of them reading a dataset column, in the grading workers), a tiny reward model loaded on
each rank, and a remote scorer on 127.0.0.1 that this test serves."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dist_utils import run_ranks
from helpers import save_classifier

ROOT = Path(__file__).resolve().parents[1]


class _Judge(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        data = json.dumps({"rewards": [float(len(c) % 3) / 2 for c in body["completions"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def _train(rank, world, overrides):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(str(ROOT / "configs/smoke_cpu.yaml"), overrides)
    return GRPOTrainer(cfg, init_distributed(60)).train()


@pytest.mark.slow
def test_two_ranks_train_on_trl_functions_a_reward_model_and_a_remote_scorer(tmp_path):
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b), "solution": str(a + b) if a % 2 else ""}
            for a, b in [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 9)]]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rm = save_classifier(tmp_path / "tiny_rm")
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/score"
    out = tmp_path / "run"
    rewards = (f"rewards=[{{function: 'reward_fns:trl_solution_reward'}}, "
               f"{{function: 'reward_fns:trl_length_reward', weight: 0.5}}, "
               f"{{model: '{rm}', weight: 0.1}}, {{url: '{url}', weight: 0.5, name: judge}}]")
    try:
        codes = run_ranks(_train, 2, tmp_path, [f"output_dir={out}", "max_steps=2", "save_steps=0",
                                                "save_final=false", "progress_bar=false", "reward_workers=1",
                                                "data.preset=null", f"data.path={data}", rewards])
    finally:
        srv.shutdown()
        srv.server_close()
    assert codes == [0, 0]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for name in ("trl_solution_reward", "trl_length_reward", "tiny_rm", "judge"):
            assert m[f"reward_errors/{name}"] == 0 and m[f"reward/{name}"] == m[f"reward/{name}"], (name, m)
    # one request per rank and step, each with the rank's 2 prompts x 4 completions and the dataset's columns
    assert len(_Judge.seen) == 4
    for body in _Judge.seen:
        assert len(body["completions"]) == len(body["completion_ids"]) == len(body["solution"]) == 8
        assert {r["question"] for r in rows} >= set(body["prompts"])
