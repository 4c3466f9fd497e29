"""SFT + RL (001 section 6.2, mixed training): every optimizer step adds sft_coef x the token-mean negative
log-likelihood of a micro-batch of reference solutions to the GRPO loss,

    loss = grpo_loss + sft_coef * sum_{solution tokens t, all ranks} -log p(t | prompt, t_<) / N_sft

where N_sft is the number of solution tokens of the step's SFT micro-batches over all ranks (their own count, not
the GRPO normaliser), so the gradient is the sum of the two losses' gradients and does not depend on the number
of ranks. The NLL is of the model at temperature 1 (the policy loss divides by the sampling temperature; SFT
targets the model itself). A solution is the rendered prompt followed by the solution text and EOS; a solution
longer than max_completion_length tokens is cut there (counted in sft_truncated_fraction).

Solutions come from a column of the RL data (config key sft_field) or from a file of their own (sft_path, rows
with data.prompt_field and sft_field). Their order is a PromptSampler of its own (seed + 1, sft_batch_size per
rank): rank-sharded, identical on every rank, checkpointed in trainer_state.json as `sft_sampler`.
"""

from __future__ import annotations

import dataclasses

import torch

from grpo_dist import distributed as gdist
from grpo_dist.config import ConfigError
from grpo_dist.data import PromptExample, PromptSampler, render_prompt, truncate_long_prompts
from grpo_dist.logprobs import selective_log_probs
from grpo_dist.rollout import RolloutBatch, completion_logits


def load_sft_examples(cfg, train_examples: list[PromptExample], warn: bool = False) -> list[PromptExample]:
    """The reference solutions as PromptExamples whose `answer` is the solution text: the rows of sft_path, else
    the sft_field column of the training rows. A row without a non-empty text solution is refused, by index."""
    if cfg.sft_path:
        from grpo_dist.data.files import load_file
        from grpo_dist.data.presets import resolve_data_config
        rows = load_file(cfg.sft_path, resolve_data_config(cfg.data).prompt_field, cfg.sft_field, "raw", None)
        return truncate_long_prompts(rows, cfg.data.max_prompt_length, cfg.sft_path, warn=warn)
    bad = [e.index for e in train_examples if not isinstance(e.columns.get(cfg.sft_field), str)
           or not e.columns[cfg.sft_field].strip()]
    if bad:
        raise ConfigError(f"config key 'sft_field' = {cfg.sft_field}: {len(bad)} of {len(train_examples)} training "
                          f"rows have no text in that column (the first: row {bad[0]}, 0-based); fill it, or give "
                          f"the solutions a file of their own with sft_path")
    return [dataclasses.replace(e, answer=e.columns[cfg.sft_field]) for e in train_examples]


@dataclasses.dataclass
class SFTBatch:
    batch: RolloutBatch  # the prompt, and the solution + EOS as the "completion" (its mask: the tokens learned)
    tokens: float        # N_sft: solution tokens of this step over all ranks
    truncated: float     # solutions cut at max_completion_length, all ranks
    rows: float          # solutions, all ranks


class SFTMixer:
    """The SFT half of the step: next_batch() once per step (one all-reduce), backward() once per optimizer step
    on every rank (every rank has sft_batch_size rows: the same passes everywhere), metrics() once per step."""

    def __init__(self, cfg, ctx, tokenizer, examples: list[PromptExample]):
        self.cfg, self.ctx, self.tokenizer = cfg, ctx, tokenizer
        self.sampler = PromptSampler(examples, cfg.sft_batch_size, ctx.rank, ctx.world_size, cfg.seed + 1)
        self.nll_sum = 0.0  # this rank's summed NLL of the step's first optimizer step (the metric)

    def next_batch(self) -> SFTBatch:
        cfg, tok = self.cfg, self.tokenizer
        from grpo_dist.rollout_engines import left_pad, prompt_token_ids
        examples = self.sampler.next_batch()
        prompts = prompt_token_ids(tok, [render_prompt(e, cfg.data, tok) for e in examples],
                                   cfg.data.max_prompt_length)
        # the solution is row text: a special-token string in it is ordinary text, as in prompts
        solutions = tok([e.answer for e in examples], add_special_tokens=False,
                        split_special_tokens=True)["input_ids"]
        full = [list(s) + [tok.eos_token_id] for s in solutions]
        cut = [s[:cfg.max_completion_length] for s in full]
        ids, mask = left_pad(prompts, tok.pad_token_id, "cpu")
        width = max(len(s) for s in cut)
        sol_ids = torch.full((len(cut), width), tok.pad_token_id, dtype=torch.long)
        sol_mask = torch.zeros((len(cut), width), dtype=torch.long)
        for i, s in enumerate(cut):
            sol_ids[i, :len(s)] = torch.as_tensor(s, dtype=torch.long)
            sol_mask[i, :len(s)] = 1
        batch = RolloutBatch(ids, mask, sol_ids, sol_mask, 1, references=[e.answer for e in examples])
        sums = gdist.all_reduce_sum([float(sol_mask.sum()), float(sum(len(c) < len(f) for c, f in zip(cut, full))),
                                     float(len(cut))], self.ctx.device)
        self.nll_sum = 0.0
        return SFTBatch(batch.to(self.ctx.device), float(sums[0]), float(sums[1]), float(sums[2]))

    def backward(self, engine, sft: SFTBatch, first: bool) -> bool:
        """Forward and backward of sft_coef x this rank's share of the token-mean NLL. Returns whether it was
        finite."""
        mb = sft.batch
        logp = selective_log_probs(completion_logits(engine.module, mb), mb.completion_ids,
                                   self.cfg.logprob_chunk_size, 1.0, overwrite_logits=True)
        nll_sum = -(logp * mb.completion_mask.to(logp.dtype)).sum()
        # FSDP / DeepSpeed average gradients over ranks; the loss is a global mean already, so undo the average
        loss = self.cfg.sft_coef * nll_sum / max(sft.tokens, 1.0) * self.ctx.world_size
        finite = bool(torch.isfinite(loss.detach()))
        engine.backward(loss)
        if first:
            self.nll_sum += float(nll_sum.detach())
        return finite

    def metrics(self, sft: SFTBatch) -> dict:
        """sft_loss: the token-mean NLL of the step's solutions over all ranks (before the update, unweighted by
        sft_coef); sft_tokens; sft_truncated_fraction. One all-reduce."""
        nll = float(gdist.all_reduce_sum([self.nll_sum], self.ctx.device)[0])
        return {"sft_loss": nll / max(sft.tokens, 1.0), "sft_tokens": sft.tokens,
                "sft_truncated_fraction": sft.truncated / max(sft.rows, 1.0)}
