"""One round of sampling and grading, the code every rank that samples runs: a colocated trainer rank
(batch_source.ColocatedSource) and a rollout rank of asynchronous GRPO (async_rollout.serve) call the same
sample_and_grade with the same arguments, so a rollout rank draws and grades exactly what a colocated rank would
(bitwise at max_staleness 0). Nothing here is a collective, and nothing reads the trainer: what a round needs is
passed in."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

from grpo_dist.data import render_prompt
from grpo_dist.rewards.batch import rollout_context
from grpo_dist.rollout import RolloutBatch
from grpo_dist.rollout_engines import SamplingSpec, generate_batch
from grpo_dist.sampling_noise import row_seed, row_seeds


@dataclass
class Graded:
    """One graded round of this rank's prompts: the rollout batch, the total and per-function rewards of each row,
    and what it cost."""
    batch: RolloutBatch
    rewards: list[float]
    per_function: dict[str, list[float]]
    errors: dict[str, int] = field(default_factory=dict)  # completions each reward function failed on (this rank)
    decode: tuple[int, int] = (0, 0)  # decode row-steps computed, tokens generated (lean / hf; vLLM: not counted)


def sampling_spec(cfg, eos_ids, greedy: bool = False, n: int | None = None,
                  seeds: tuple[int, ...] | None = None) -> SamplingSpec:
    """The configured sampling settings; with stale rollouts (max_staleness > 0) the sampler's log-probs are those
    of the full distribution (decoupled PPO's behaviour policy), not of the top-k / top-p filtered one."""
    return SamplingSpec(n=n or cfg.num_generations, max_tokens=cfg.max_completion_length, eos_ids=tuple(eos_ids),
                        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, greedy=greedy,
                        row_seeds=seeds, full_logprobs=cfg.max_staleness > 0)


def round_seeds(cfg, batch_number: int, prompt_indices: list[int],
                group_sizes: list[int] | None) -> tuple[int, ...] | None:
    """sampling_noise=per_prompt: each row's noise from (seed, global batch number, place of its prompt in the
    global batch, completion index), so that no rank, batch or chunk changes what a prompt draws; completion j of a
    prompt draws the same noise whatever its group size. None: the process RNG (vLLM samples its own way)."""
    if cfg.sampling_noise != "per_prompt" or cfg.rollout_engine == "vllm":
        return None
    if group_sizes is not None:
        return tuple(row_seed(cfg.seed, batch_number, p, j) for p, g in zip(prompt_indices, group_sizes)
                     for j in range(g))
    return tuple(row_seeds(cfg.seed, batch_number, prompt_indices, cfg.num_generations))


def sample_and_grade(cfg, engine, tokenizer, rewards, examples: list, *, batch_number: int,
                     prompt_indices: list[int], eos_ids, device,
                     group_sizes: list[int] | None = None, stage=None, generate=generate_batch) -> Graded:
    """G completions of each example (group_sizes: each prompt's own number of them, its prompt repeated, one each)
    on the engine's current weights, graded by `rewards` (a RewardComputer). batch_number and prompt_indices: where
    the examples sit in the global batch order (the data sampler's last batch), which keys the sampling noise.
    stage(name): a context manager around the "rollout" and "reward" parts (the trainer's Timer), or None.
    generate: generate_batch's signature; a multi-turn environment's rollout (grpo_dist/environments/) in its place."""
    stage = stage or (lambda name: nullcontext())
    if len(prompt_indices) != len(examples):
        raise ValueError(f"rollout of {len(examples)} prompts, but the data sampler's last batch had "
                         f"{len(prompt_indices)}")
    prompts = [render_prompt(e, cfg.data, tokenizer) for e in examples]
    answers = [e.answer for e in examples]
    row_examples, n = examples, None
    if group_sizes is not None:
        prompts = [p for p, g in zip(prompts, group_sizes) for _ in range(g)]
        answers = [a for a, g in zip(answers, group_sizes) for _ in range(g)]
        row_examples = [e for e, g in zip(examples, group_sizes) for _ in range(g)]
        n = 1
    spec = sampling_spec(cfg, eos_ids, n=n, seeds=round_seeds(cfg, batch_number, prompt_indices, group_sizes))
    with stage("rollout"):
        batch = generate(engine, tokenizer, prompts, answers, spec, cfg.data.max_prompt_length, device)
    with stage("reward"):
        return grade(cfg, rewards, row_examples, batch)


def grade(cfg, rewards, row_examples: list, batch: RolloutBatch) -> Graded:
    """Grade a rollout batch whose rows are each of row_examples' completions in turn (also for benches and tests
    that generate their own way)."""
    total, per_function = rewards(batch.completions, batch.references, batch.completion_lengths.tolist(),
                                  cfg.max_completion_length, **rollout_context(row_examples, batch))
    # decode row-steps computed, and the tokens the model generated (multi-turn: observations are not generated)
    decode = (batch.decode_row_steps, int(batch.loss_mask.sum())) if batch.decode_row_steps is not None else (0, 0)
    return Graded(batch, list(total), per_function, dict(rewards.last_errors), decode)
