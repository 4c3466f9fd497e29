"""SFT + RL (config keys sft_coef, sft_field, sft_path, sft_batch_size; grpo_dist/sft.py).

The fixed one-step rollout of the equivalence tests (helpers.fixed_rollout) plus a micro-batch of reference
solutions: the step's gradient must be the GRPO gradient plus sft_coef x the gradient of the token-mean NLL written
out here on a plain copy of the model, 2 ranks must take the same step as 1 process, and a resumed run must continue
the solutions' order (and so the weights) exactly.
"""

import json

import pytest
import torch

from helpers import in_process, EQUIV_BASE, G, PROMPTS, fixed_rollout

from grpo_dist.config import ConfigError, load_config

COEF = 0.5


def write_data(tmp_path, n=8, name="train.jsonl", column="solution"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"question": f"{a}+{a}=", "answer": str(2 * a),
                                        column: f"={2 * a}" + " so" * a}) + "\n" for a in range(n)))
    return path


def sft_overrides(tmp_path, *extra):
    return EQUIV_BASE + ["data.preset=null", f"data.path={write_data(tmp_path)}", f"sft_coef={COEF}",
                         "sft_field=solution", "sft_batch_size=2", f"output_dir={tmp_path / 'out'}",
                         "distributed.timeout_s=60", *extra]


@pytest.mark.fast
@pytest.mark.parametrize("overrides, key", [
    (["sft_coef=0.5"], "sft_coef"),                         # no source of solutions
    (["sft_field=solution"], "sft_field"),                  # a source, no weight
    (["sft_path=x.jsonl"], "sft_path"),
    (["sft_coef=-1", "sft_field=s"], "sft_coef"),
    (["sft_coef=1", "sft_field=s", "sft_batch_size=0"], "sft_batch_size"),
])
def test_sft_settings_that_cannot_apply_are_refused_with_one_line(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert f"'{key}'" in str(e.value) and len(e.value.problems) == 1, e.value.problems


def _trainer(overrides):
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    cfg = load_config(None, overrides)
    return GRPOTrainer(cfg, init_distributed(cfg.distributed.timeout_s))


def test_a_missing_solution_column_is_refused_before_the_model_loads(tmp_path, capsys):
    data = write_data(tmp_path, name="no_solutions.jsonl", column="other")
    with pytest.raises(ConfigError, match="config key 'sft_field' = solution: 8 of 8 training rows"):
        in_process(lambda: _trainer(sft_overrides(tmp_path, f"data.path={data}", "prompts_per_rank=4")))
    assert "loading model" not in capsys.readouterr().out


def _grads_of_step(tr):
    """learn() on the fixed rollout; the gradients the optimizer step gets (before clipping), by plain name."""
    from grpo_dist.engines import clean_name
    grads = {}
    real_step = tr.engine.step

    def recording_step(skip=False):
        for name, p in tr.engine.module.named_parameters():
            if p.grad is not None:
                grads[clean_name(name)] = p.grad.detach().clone()
        return real_step(skip=skip)
    tr.engine.step = recording_step
    batch, rewards = fixed_rollout()
    metrics = tr.learn(batch, rewards)
    return grads, metrics


def _hand_nll(cfg, examples):
    """sum over solution tokens of -log p(token | prompt, earlier solution tokens) / their number, on a fresh
    copy of the model (the same init), with autograd: (the mean NLL, its gradient by name). The solution + EOS is
    cut at max_completion_length tokens."""
    from grpo_dist.data import render_prompt
    from grpo_dist.models import load_model, load_tokenizer
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok)
    total, n = 0.0, 0
    for e in examples:
        prompt = tok(render_prompt(e, cfg.data, tok).text, add_special_tokens=False)["input_ids"]
        target = (tok(e.columns["solution"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        target = target[:cfg.max_completion_length]
        ids = torch.tensor([prompt + target])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        # position i predicts token i + 1: the solution's tokens are predicted from len(prompt) - 1 on
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(target))
        total = total - logp[positions, torch.tensor(target)].sum()
        n += len(target)
    nll = total / n
    (COEF * nll).backward()
    return float(nll.detach()), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def test_gradient_is_the_sum_of_the_grpo_and_sft_gradients(tmp_path, one_thread):
    from grpo_dist.data import PromptSampler
    overrides = sft_overrides(tmp_path, f"prompts_per_rank={PROMPTS}")

    def go():
        tr = _trainer(overrides)
        drawn = PromptSampler(list(tr.sft.sampler.examples), 2, 0, 1, tr.cfg.seed + 1).next_batch()
        both, metrics = _grads_of_step(tr)
        plain = _trainer([o for o in overrides if not o.startswith(("sft_coef", "sft_field"))])
        assert plain.sft is None
        rl, _ = _grads_of_step(plain)
        return drawn, both, metrics, rl, tr.cfg
    drawn, both, metrics, rl, cfg = in_process(go)
    nll, sft = _hand_nll(cfg, drawn)
    assert metrics["sft_loss"] == pytest.approx(nll, rel=1e-5)
    cut = cfg.max_completion_length
    assert metrics["sft_tokens"] == sum(min(len(e.columns["solution"]) + 1, cut) for e in drawn)  # chars + EOS
    assert metrics["sft_truncated_fraction"] == sum(len(e.columns["solution"]) + 1 > cut for e in drawn) / 2
    assert set(both) == set(rl) == set(sft)
    for k in both:
        torch.testing.assert_close(both[k], rl[k] + sft[k], rtol=1e-4, atol=1e-6, msg=k)
    assert max((sft[k].abs().max().item()) for k in sft) > 1e-3  # the SFT term is not negligible here


def _step_on_ranks(rank, world, tmp_path):
    from grpo_dist.distributed import init_distributed
    from grpo_dist.trainer import GRPOTrainer
    per_rank = PROMPTS // world
    cfg = load_config(None, sft_overrides(tmp_path, f"prompts_per_rank={per_rank}", f"sft_batch_size={2 // world}",
                                          "micro_batch_size=3"))
    tr = GRPOTrainer(cfg, init_distributed(60))
    batch, rewards = fixed_rollout()
    rows = list(range(rank * per_rank * G, (rank + 1) * per_rank * G))
    metrics = tr.learn(batch.rows(rows), rewards[rows])
    sd, _ = tr.engine.gather_full_state()
    return ({k: v.clone() for k, v in sd.items()}, metrics) if rank == 0 else None


@pytest.mark.slow  # 2 spawned gloo ranks, then 1: ~25 s
def test_two_ranks_take_the_same_step_as_one_process(tmp_path):
    """Each rank trains half the groups and 1 of the 2 solutions; the NLL is normalised on the tokens of both."""
    from dist_utils import run_ranks
    two_sd, two_m = run_ranks(_step_on_ranks, 2, tmp_path, tmp_path)[0]
    one_sd, one_m = run_ranks(_step_on_ranks, 1, tmp_path, tmp_path)[0]
    assert max((two_sd[k] - one_sd[k]).abs().max().item() for k in one_sd) < 1e-5
    assert two_m["sft_loss"] == pytest.approx(one_m["sft_loss"], rel=1e-6)
    assert two_m["sft_tokens"] == one_m["sft_tokens"]
    assert two_m["loss"] == pytest.approx(one_m["loss"], abs=1e-6)


def test_resume_continues_the_solutions_order_and_the_weights_exactly(tmp_path, one_thread):
    """4 steps straight vs 2 steps, a checkpoint, and 2 more from it: the same weights bit for bit (the SFT order
    is checkpointed; 8 rows, 2 per step: the resumed steps take rows the first two did not)."""
    from safetensors.torch import load_file
    straight = ["max_steps=4", "save_steps=2", "prompts_per_rank=2", "num_generations=4", "save_format=full",
                "rewards=[{function: 'reward_fns:odd_length', weight: 1.0}]", "report_to=[jsonl]",
                "max_completion_length=6"]

    def go():
        assert _trainer(sft_overrides(tmp_path, *straight, f"output_dir={tmp_path / 'a'}")).train() == 0
        resumed = _trainer(sft_overrides(tmp_path, *straight, f"output_dir={tmp_path / 'b'}",
                                         f"resume_from_checkpoint={tmp_path / 'a' / 'checkpoint-2'}"))
        assert resumed.sft.sampler.step_in_epoch == 2  # restored, not restarted
        assert resumed.train() == 0
    in_process(go)
    state = json.loads((tmp_path / "a" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["sft_sampler"]["step_in_epoch"] == 2 and state["sft_sampler"]["seed"] == 43
    a = load_file(str(tmp_path / "a" / "checkpoint-4" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "checkpoint-4" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    first = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["sft_loss"] for r in rows] == [r["sft_loss"] for r in first[2:]]


def test_solutions_from_a_file_of_their_own(tmp_path):
    """sft_path: the file's rows (data.prompt_field + sft_field) are the solutions, not the RL rows' column."""
    sols = write_data(tmp_path, n=5, name="solutions.jsonl", column="worked")

    def go():
        tr = _trainer(sft_overrides(tmp_path, f"sft_path={sols}", "sft_field=worked", "prompts_per_rank=4"))
        return [(e.prompt, e.answer) for e in tr.sft.sampler.examples]
    rows = [json.loads(line) for line in sols.read_text().splitlines()]
    assert in_process(go) == [(r["question"], r["worked"]) for r in rows]
