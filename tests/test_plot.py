"""grpo_dist.tools.plot: metrics.jsonl -> readable PNG panels (in-process, no subprocess)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.fast  # the `make fast` tier

pytest.importorskip("matplotlib")

from grpo_dist.tools.plot import PANELS, ema, plot, read_metrics  # noqa: E402


def test_ema_is_debiased_exponential_average():
    w = 0.5
    xs = [4.0, 0.0, 2.0]
    # s1 = 0.5*4 = 2 -> /(1-0.5) = 4; s2 = 0.5*2 + 0 = 1 -> /(1-0.25) = 4/3; s3 = 0.5*1 + 0.5*2 = 1.5 -> /(0.875)
    assert ema(xs, w) == pytest.approx([4.0, 4 / 3, 1.5 / 0.875])
    assert ema(xs, 0.0) == xs


@pytest.mark.heavy  # imports matplotlib and renders: ~2 s; out of `make fast`
def test_plot_writes_every_panel(tmp_path):
    rows = []
    for step in range(1, 41):
        # no "kl" (beta = 0 runs still log it; here it stands for any metric a run never logged)
        row = {"step": step, "reward_mean": step / 40, "accuracy": step / 45, "completion_length_mean": 3.0,
               "completion_length_max": 4.0, "entropy": 0.7 - step / 100, "clip_fraction": 0.0,
               "grad_norm": 1.0 + (step % 3), "completion_tokens_per_s": 900.0 + step}
        if step % 10 == 0:
            row["eval_accuracy"] = 0.3 + step / 100
        rows.append(row)
    lines = [json.dumps(r) for r in rows]
    lines.insert(5, '{"step": 6, "reward_m')                      # a line cut off by a crash: skipped
    lines.append(json.dumps({"step": 40, "reward_mean": 0.99}))   # a resumed run re-logged step 40: last wins
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    got = read_metrics(tmp_path)
    assert [r["step"] for r in got] == list(range(1, 41))
    assert got[-1]["reward_mean"] == 0.99 and got[-1]["eval_accuracy"] == pytest.approx(0.7)

    paths = plot(tmp_path)
    assert [p.name for p in paths] == ["training_curves.png"] + [p.file for p in PANELS]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, p


def test_plot_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="no rows"):
        plot(tmp_path)
