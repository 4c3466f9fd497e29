"""Uneven work across ranks must not hang: one rank's completions all end at the first token (and all its groups
have zero advantage, so it has nothing to train on) while the other's run to max_completion_length."""

import json
import os

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from dist_utils import run_ranks

TINY = ["model.tiny={architecture: qwen2, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
        "num_key_value_heads: 2, intermediate_size: 64}"]


class _Force(LogitsProcessor):
    """Rank 0: EOS is the only possible token. Rank 1: EOS is impossible."""

    def __init__(self, eos: int, force: bool):
        self.eos, self.force = eos, force

    def __call__(self, input_ids, scores):
        if self.force:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.eos] = 0.0
        else:
            scores[:, self.eos] = -float("inf")
        return scores


def _uneven_run(rank, world_size, out_dir, skip_zero):
    from grpo_dist.config import load_config
    from grpo_dist.data import render_prompt
    from grpo_dist.distributed import init_distributed
    from grpo_dist.rollout import generate_rollouts
    from grpo_dist.trainer import GRPOTrainer

    ctx = init_distributed(timeout_s=60)  # a collective mismatch fails within a minute instead of hanging
    cfg = load_config(None, TINY + [
        "rewards=[{function: 'reward_fns:char_parity', weight: 1.0}]", "reward_workers=0", "beta=0.04",
        f"skip_zero_advantage_groups={skip_zero}", "max_steps=2", "prompts_per_rank=2", "num_generations=4",
        "max_completion_length=12", "micro_batch_size=3", "learning_rate=1e-3", f"output_dir={out_dir}",
        "progress_bar=false"])
    trainer = GRPOTrainer(cfg, ctx)
    force = _Force(trainer.tokenizer.eos_token_id, force=(rank == 0))

    def rollout(examples, timer=None):  # the source synced the weights into gen_model before its first round
        from grpo_dist.graded import grade
        prompts = [render_prompt(e, cfg.data, trainer.tokenizer) for e in examples]
        batch = generate_rollouts(trainer.gen_model, trainer.tokenizer, prompts, [e.answer for e in examples],
                                  num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
                                  logits_processor=LogitsProcessorList([force]))
        return grade(cfg, trainer.rewards, examples, batch)

    trainer.source.rollout = rollout
    before = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters()}
    code = trainer.train()
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in trainer.engine.module.named_parameters()
                if p.numel())
    return code, moved


def test_early_eos_rank_and_zero_advantage_rank_do_not_hang(tmp_path):
    for skip_zero in ("true", "false"):
        out = tmp_path / f"skip_{skip_zero}"
        results = run_ranks(_uneven_run, 2, tmp_path, str(out), skip_zero, timeout=240)
        assert [code for code, _ in results] == [0, 0]
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in lines] == [1, 2]
        for m in lines:
            assert m["completion_length_max"] == 12          # rank 1 ran to the limit
            assert m["zero_advantage_fraction"] >= 0.5       # all of rank 0's groups are flat
            assert m["completion_length_mean"] < 12          # rank 0's completions are 1 token (just EOS)
        assert os.path.isdir(out / "checkpoint-2")
        assert max(moved for _, moved in results) > 0, "rank 1's groups should still have trained the policy"
