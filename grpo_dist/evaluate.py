"""Accuracy of a model on a prompt set: greedy pass@1 (and pass@K with sampling).

    python -m grpo_dist.evaluate --model DIR --data FILE [--num-samples K]
    torchrun --nproc_per_node 2 -m grpo_dist.evaluate --model DIR --data FILE

Ranks split the examples and sum their counts; the last line printed is one JSON object with "accuracy".
"""

from __future__ import annotations

import torch

from grpo_dist import distributed as gdist
from grpo_dist.data import render_prompt
from grpo_dist.rollout import generate_rollouts


def _score_examples(model, tokenizer, examples, cfg, rewards, num_samples: int, do_sample: bool,
                    batch_size: int = 64) -> list[list[float]]:
    """Per example, the rewards of its num_samples completions."""
    scores = []
    for s in range(0, len(examples), batch_size):
        chunk = examples[s:s + batch_size]
        prompts = [render_prompt(e, cfg.data, tokenizer) for e in chunk]
        batch = generate_rollouts(model, tokenizer, prompts, [e.answer for e in chunk], num_samples,
                                  cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k,
                                  cfg.data.max_prompt_length, do_sample=do_sample)
        r, _ = rewards(batch.completions, batch.references)
        scores += [r[i * num_samples:(i + 1) * num_samples] for i in range(len(chunk))]
    return scores


@torch.no_grad()
def evaluate_accuracy(model, tokenizer, examples, cfg, ctx, rewards) -> float:
    """Greedy accuracy over `examples`, split across ranks (rank r takes every world_size-th example)."""
    mine = examples[ctx.rank::ctx.world_size]
    scores = _score_examples(model, tokenizer, mine, cfg, rewards, 1, do_sample=False) if mine else []
    correct = sum(1.0 for s in scores if s[0] >= 1.0)
    total = gdist.all_reduce_sum([correct, len(mine)], ctx.device)
    return float(total[0] / max(float(total[1]), 1.0))
