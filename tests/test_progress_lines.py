"""Long silent phases say what they do: model loading (a line before, one after with the time), the evaluations
(when not in a terminal: a line when a pass ends, and one per tenth of rank 0's problems at least 10 s apart before
that; one line with the accuracy and the time), and the
demo's base-model build (a line per tenth of its warm-start steps). One CPU process, the tiny model, a few
seconds."""

from helpers import RESUME_BASE

LOAD = "[grpo_dist] loading model tiny qwen2 (random weights) ..."


def test_trainer_says_model_loading_and_each_evaluation_with_times(tmp_path, capsys):
    from grpo_dist.config import load_config
    from grpo_dist.distributed import init_distributed
    from grpo_dist.evaluation import evaluate
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, RESUME_BASE + [f"output_dir={tmp_path}/run", "max_steps=2", "eval_steps=1",
                                           "data.eval_limit=20", "num_iterations=1", "save_final=false"])
    tr = GRPOTrainer(cfg, init_distributed(60))
    printed = capsys.readouterr().out.splitlines()
    for what in ("model", "reference model"):  # beta > 0: the reference is loaded too
        name = f"[grpo_dist] loading {what} tiny qwen2 (random weights) ..."
        assert name in printed
        assert any(line.startswith(f"{name} done in ") and line.endswith(" s") for line in printed), printed

    # the evaluation tool's evaluate(progress=True), not in a terminal: lines on stderr; a pass of a few seconds says
    # one line (test_progress_lines_are_per_tenth_and_at_least_quiet_s_apart has the rule)
    result = evaluate(tr.rollout_engine, tr.tokenizer, tr.eval_examples[:20], cfg, tr.ctx, tr.rewards,
                      num_samples=2, batch_size=4, progress=True)
    err = capsys.readouterr().err.splitlines()
    greedy = [line for line in err if line.startswith("[grpo_dist] greedy (rank 0): ")]
    assert greedy[-1].startswith("[grpo_dist] greedy (rank 0): 20/20 problems (") and len(greedy) == 1, err
    assert any(line.startswith("[grpo_dist] 2 samples (rank 0): 20/20 problems (") for line in err), err
    assert result["num_examples"] == 20

    assert tr.train() == 0
    printed = capsys.readouterr().out.splitlines()
    for step in (1, 2):
        lines = [line for line in printed if line.startswith(f"[grpo_dist] eval at step {step}")]
        assert lines[-2].startswith(f"[grpo_dist] eval at step {step} (rank 0's share): 20/20 problems ("), lines
        assert lines[-1].startswith(f"[grpo_dist] eval at step {step}: eval_accuracy ") and \
            " on 20 problems in " in lines[-1] and lines[-1].endswith(" s"), lines


def test_demo_base_build_prints_a_line_per_tenth_of_its_steps(tmp_path):
    from grpo_dist.tools.demo import BaseSettings, build_base
    s = BaseSettings(hidden_size=16, num_hidden_layers=1, intermediate_size=32, max_operand=3, sft_steps=20,
                     sft_batch_size=4)
    lines: list[str] = []
    build_base(tmp_path / "base", s, log=lines.append)
    steps = [line for line in lines if line.startswith("[demo] warm start: step ")]
    assert [line.split()[4].rstrip(",") for line in steps] == [f"{i}/20" for i in range(2, 21, 2)], lines
    assert all(", loss " in line and line.endswith(" s)") for line in steps)


def test_progress_lines_are_per_tenth_and_at_least_quiet_s_apart():
    """ProgressLines (evaluation's log lines): the end of a pass always says a line; before it, a line when another
    tenth of the problems is done and quiet_s seconds have passed since the last line. The clock is injected."""
    from grpo_dist.evaluation import ProgressLines
    now = [0.0]
    lines: list[str] = []
    bar = ProgressLines(100, "greedy", lines.append, quiet_s=10.0, clock=lambda: now[0])
    for _ in range(10):  # 10 problems a second: a tenth each second, a line at most every 10 s
        now[0] += 1.0
        bar.update(10)
    assert lines == ["[grpo_dist] greedy: 100/100 problems (10.0 s)"]
    lines.clear()
    bar.reset(100)
    for _ in range(20):  # 5 problems every 6 s: a tenth each 12 s, so a line at each tenth, 10 in all
        now[0] += 6.0
        bar.update(5)
    assert [line.split()[2] for line in lines] == [f"{10 * i}/100" for i in range(1, 11)], lines
