"""A resumed run logs each step once: steps logged after the checkpoint by the crashed run are dropped."""

import json

import pytest

from grpo_dist.metrics import MetricsLogger

pytestmark = pytest.mark.fast  # the `make fast` tier


def test_resumed_logger_drops_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i}) + "\n" for i in range(1, 6)) + '{"step": 6, "cut sh')
    log = MetricsLogger(str(tmp_path), True, ["jsonl"], progress_bar=False, start_step=3)
    log.log({"step": 4, "reward_mean": 0.5})
    log.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]
    # a fresh run (start_step 0) never deletes what is there
    MetricsLogger(str(tmp_path), True, ["jsonl"], progress_bar=False, start_step=0).close()
    assert len(path.read_text().splitlines()) == 4
