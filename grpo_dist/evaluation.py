"""Accuracy of a model on a prompt set: greedy pass@1 and pass@k from K samples per problem (``evaluate``), and
the greedy accuracy of a problem set (``evaluate_accuracy``), and the trainer's two evaluation tiers (``eval_tiers``,
``run_tier``): a light one on the first data.eval_limit problems every eval_steps, a full one on the whole set every
full_eval_steps (001 section 4.1), each under its own metric names, pass@k optional on either. The command line is
grpo_dist.tools.evaluate.

A completion counts as correct when the first reward function gives it full marks (>= 1). Ranks split the problems
(rank r takes every world_size-th) and sum their counts, so the result does not depend on the number of ranks.
pass@k uses the unbiased estimator from n = K samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021),
averaged over problems.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from grpo_dist import distributed as gdist
from grpo_dist.data import render_prompt
from grpo_dist.rewards.batch import rollout_context
from grpo_dist.rollout import cut_off, eos_token_ids
from grpo_dist.rollout_engines import ReplicaRolloutEngine, RolloutEngine, SamplingSpec, generate_batch
from grpo_dist.sampling_noise import EVAL_STREAM, row_seeds


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples is correct) from n samples of which c are correct:
    1 - C(n-c, k) / C(n, k), computed as a product to stay exact-ish for large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def k_values(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def _correct_flags(rewards, completions, references, lengths=None, max_len=None, context=None) -> list[bool]:
    """Full marks from the first reward function (the verifier); shaping rewards never make an answer correct.
    context: prompts, completion_ids and columns for batch scorers (grpo_dist.rewards.batch.rollout_context)."""
    totals, per_function = rewards(completions, references, lengths, max_len, **(context or {}))
    first = next(iter(per_function.values()), totals) if per_function else totals
    return [float(r) >= 1.0 for r in first]


class ProgressLines:
    """A bar for logs (update(n), close()): one line "<label>: done/total problems (t s)" when the pass ends, and
    before that when another tenth of the problems is done (generation batches at a time) and at least `quiet_s`
    seconds have passed since the last line, through say (print, or the trainer's console). A pass of a few seconds
    says one line; a pass of minutes says where it is about every `quiet_s`, at most ten times."""

    def __init__(self, total: int, label: str, say: Callable[[str], None] = print, quiet_s: float = 10.0,
                 clock: Callable[[], float] = time.perf_counter):
        self.total, self.label, self.say, self.quiet_s, self.clock = total, label, say, quiet_s, clock
        self.done = self.shown = self.every = 0
        self.t0 = self.last = 0.0
        self.reset(total)

    def update(self, n: int) -> None:
        self.done += n
        now = self.clock()
        tenth = self.done - self.shown >= self.every and now - self.last >= self.quiet_s
        if tenth or self.done >= self.total:
            self.shown, self.last = self.done, now
            self.say(f"[grpo_dist] {self.label}: {self.done}/{self.total} problems ({now - self.t0:.1f} s)")

    def reset(self, total: int) -> None:
        self.total, self.done, self.shown, self.every = total, 0, 0, max(1, total // 10)
        self.t0 = self.last = self.clock()

    def set_description(self, label: str) -> None:
        self.label = label

    def close(self) -> None:
        pass


def as_rollout_engine(model, cfg, tokenizer) -> RolloutEngine:
    """A rollout engine as is; a plain model -> the lean / hf sampling loop on it (config key rollout_engine)."""
    if isinstance(model, RolloutEngine):
        return model
    from grpo_dist.config import lean_cuda_graphs_on
    model.eval()  # no dropout while generating
    return ReplicaRolloutEngine(model, cfg.rollout_engine != "hf", tokenizer.pad_token_id, cfg.generation_batch_size,
                                cfg.decode_compaction_threshold,
                                lean_cuda_graphs_on(cfg, next(model.parameters()).device), cfg.lean_compile)


def _score_examples(model, tokenizer, examples, cfg, rewards, num_samples: int, do_sample: bool,
                    batch_size: int = 64, bar=None, records: list | None = None,
                    sample_out: list | None = None, step: int = 0) -> list[int]:
    """Per example, how many of its num_samples completions are correct. model: a RolloutEngine or a model.
    With `records`, one dict per completion (problem, reference, completion, correct, cut off) is appended to it;
    sample_out, if given and empty, receives (prompt, completion, reference, correct) of the first completion.
    Sampled (sampling_noise=per_prompt): each completion's noise is keyed on (seed, step, the example's index,
    completion index), so pass@k does not depend on the number of ranks or on batch_size."""
    engine = as_rollout_engine(model, cfg, tokenizer)
    sampling = SamplingSpec(n=num_samples, max_tokens=cfg.max_completion_length,
                            eos_ids=tuple(eos_token_ids(engine.model, tokenizer)),
                            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, greedy=not do_sample)
    counts: list[int] = []
    starts = range(0, len(examples), batch_size)
    # The ranks of a vLLM tensor-parallel group generate together (each call is collective in the group): they
    # agree on the number of calls first, and a rank whose share ran out (or had none) makes empty ones.
    for i in range(engine.generate_calls(len(starts))):
        if i >= len(starts):
            engine.generate([], sampling)
            continue
        chunk = examples[starts[i]:starts[i] + batch_size]
        prompts = [render_prompt(e, cfg.data, tokenizer) for e in chunk]
        if do_sample and cfg.sampling_noise == "per_prompt":
            sampling = dataclasses.replace(sampling, row_seeds=tuple(row_seeds(
                cfg.seed, step, [e.index for e in chunk], num_samples, EVAL_STREAM)))
        batch = generate_batch(engine, tokenizer, prompts, [e.answer for e in chunk], sampling,
                               cfg.data.max_prompt_length, "cpu")
        flags = _correct_flags(rewards, batch.completions, batch.references, batch.completion_lengths.tolist(),
                               cfg.max_completion_length, rollout_context(chunk, batch))
        if sample_out is not None and not sample_out and batch.completions:
            sample_out.append((prompts[0].text, batch.completions[0], batch.references[0], flags[0]))
        counts += [sum(flags[i * num_samples:(i + 1) * num_samples]) for i in range(len(chunk))]
        if records is not None:
            cut = cut_off(batch, sampling.eos_ids).tolist()
            records += [{"index": chunk[i // num_samples].index, "problem": chunk[i // num_samples].prompt,
                         "reference": batch.references[i], "completion": batch.completions[i],
                         "correct": flags[i], "truncated": cut[i],
                         "num_tokens": int(batch.completion_mask[i].sum())} for i in range(len(flags))]
        if bar is not None:
            bar.update(len(chunk))
    return counts


@torch.no_grad()
def evaluate_accuracy(model, tokenizer, examples, cfg, ctx, rewards, batch_size: int = 64,
                      sample_out: list | None = None, say: Callable[[str], None] | None = None,
                      label: str = "eval") -> float:
    """Greedy accuracy over `examples`, split across ranks (rank r takes every world_size-th example). Every rank
    must call it (one all-reduce). model: a RolloutEngine, or a model (sampled with the lean / hf loop).
    sample_out: see _score_examples (this rank's first completion). say: rank 0 reports its progress through it
    (ProgressLines, `label`)."""
    was_training = isinstance(model, torch.nn.Module) and model.training
    mine = examples[ctx.rank::ctx.world_size]
    bar = ProgressLines(len(mine), f"{label} (rank 0's share)", say) if say is not None and ctx.is_main else None
    counts = _score_examples(model, tokenizer, mine, cfg, rewards, 1, False, batch_size, bar,
                             sample_out=sample_out)  # also with no examples: its group's calls (vLLM TP)
    total = gdist.all_reduce_sum([float(sum(counts)), float(len(mine))], ctx.device)
    if isinstance(model, torch.nn.Module):
        model.train(was_training)
    return float(total[0] / max(float(total[1]), 1.0))


@torch.no_grad()
def evaluate(model, tokenizer, examples, cfg, ctx, rewards, num_samples: int = 0, batch_size: int = 64,
             progress: bool = False, records: list | None = None, sample_out: list | None = None,
             say: Callable[[str], None] | None = None, label: str = "eval", step: int = 0) -> dict:
    """Greedy pass@1, the fraction of greedy completions cut off at max_completion_length (no EOS) and, with
    num_samples = n > 0, sampled pass@k for k in k_values(n). All ranks must call it. model: a RolloutEngine, or a
    model (sampled with the lean / hf loop). With `records`, this rank's greedy completions are appended to it;
    sample_out: see _score_examples. say: rank 0 reports its progress through it (ProgressLines, `label`) instead
    of `progress`'s stderr bar. step keys the sampling noise of pass@k (_score_examples)."""
    mine = examples[ctx.rank::ctx.world_size]
    bar: Any = None
    if say is not None:
        bar = ProgressLines(len(mine), f"{label} (rank 0's share)", say) if ctx.is_main else None
    elif progress and ctx.is_main and sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=len(mine), desc="greedy (rank 0)", unit="problem")  # one pass over the problems each
    elif progress and ctx.is_main:  # a log, not a terminal: a line per tenth of the problems
        bar = ProgressLines(len(mine), "greedy (rank 0)", lambda line: print(line, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    mine_records: list[dict] = []
    # also with no examples: the calls of its vLLM tensor-parallel group (_score_examples)
    greedy = _score_examples(model, tokenizer, mine, cfg, rewards, 1, False, batch_size, bar, mine_records,
                             sample_out)
    sums = [float(sum(greedy)), float(len(mine)), float(sum(r["truncated"] for r in mine_records))]
    ks = k_values(num_samples) if num_samples > 0 else []
    if ks:
        if bar is not None:
            bar.reset(total=len(mine))
            bar.set_description(f"{label}, {num_samples} samples (rank 0's share)" if say is not None
                                else f"{num_samples} samples (rank 0)")
        sampled = _score_examples(model, tokenizer, mine, cfg, rewards, num_samples, True,
                                  max(1, batch_size // num_samples), bar, step=step)
        sums += [sum(pass_at_k(num_samples, c, k) for c in sampled) for k in ks]
    if records is not None:
        records += mine_records
    if bar is not None:
        bar.close()
    total = gdist.all_reduce_sum(sums, ctx.device)
    n = max(float(total[1]), 1.0)
    result = {"accuracy": float(total[0] / n), "num_examples": int(total[1]),
              "truncated_fraction": float(total[2] / n)}
    for i, k in enumerate(ks):
        result[f"pass@{k}"] = float(total[3 + i] / n)
    if ks:
        result["num_samples"] = num_samples
        result["temperature"] = cfg.temperature
    result["eval_time_s"] = time.perf_counter() - t0
    return result


# ------------------------------------------------------------------------------- the trainer's evaluation tiers

@dataclass(frozen=True)
class EvalTier:
    """One evaluation tier of the trainer: every `every` steps (and after the last), the first `limit` problems of
    the eval split (None: all of them), pass@k from `num_samples` samples per problem (0: greedy only); its
    metrics are named `prefix` + accuracy / truncated_fraction / pass@k / num_examples."""

    name: str
    prefix: str
    every: int
    limit: int | None
    num_samples: int


def eval_tiers(cfg) -> list[EvalTier]:
    """The configured tiers: light (eval_steps, data.eval_limit, eval_num_samples; metrics eval_*) and full
    (full_eval_steps, the whole set, full_eval_num_samples; metrics eval_full_*)."""
    tiers = []
    if cfg.eval_steps:
        tiers.append(EvalTier("light", "eval_", cfg.eval_steps, cfg.data.eval_limit, cfg.eval_num_samples))
    if cfg.full_eval_steps:
        tiers.append(EvalTier("full", "eval_full_", cfg.full_eval_steps, None, cfg.full_eval_num_samples))
    return tiers


def due_tiers(cfg, step: int) -> list[EvalTier]:
    """The tiers due after optimizer step `step`: at their multiples and after the last step (the same on every
    rank: a function of the config and the step)."""
    return [t for t in eval_tiers(cfg) if step % t.every == 0 or step == cfg.max_steps]


def run_tier(engine, tokenizer, examples, cfg, ctx, rewards, tier: EvalTier, step: int,
             say: Callable[[str], None] | None = None, sample_out: list | None = None) -> dict:
    """The metrics of one tier at `step` (every rank calls it: ranks split the problems, counts are summed).
    Sampling (pass@k) draws from a torch RNG stream of its own, seeded by (seed, step, rank, tier), and the
    training streams are put back afterwards: the training run is the same with and without pass@k."""
    chosen = examples[:tier.limit] if tier.limit is not None else examples
    seed = int(np.random.SeedSequence([cfg.seed, step, ctx.rank, int(tier.name == "full")]).generate_state(1)[0])
    devices = [ctx.device] if ctx.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        label = f"{'full eval' if tier.name == 'full' else 'eval'} at step {step}"
        result = evaluate(engine, tokenizer, chosen, cfg, ctx, rewards, num_samples=tier.num_samples,
                          say=say, label=label, sample_out=sample_out, step=step)
    out = {f"{tier.prefix}accuracy": result["accuracy"],
           f"{tier.prefix}truncated_fraction": result["truncated_fraction"],
           f"{tier.prefix}num_examples": result["num_examples"]}
    out.update({f"{tier.prefix}{k}": v for k, v in result.items() if k.startswith("pass@")})
    return out
