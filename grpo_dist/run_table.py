"""The run table rank 0 prints once, after the model loaded and before the first step: what one step does, in the
config's own arithmetic (run_numbers), and which engines do it."""

from __future__ import annotations

import math

from grpo_dist.config.choices import FSDP_BACKENDS


def run_numbers(cfg, world_size: int) -> dict:
    """The per-step sizes of this config on world_size ranks."""
    prompts = cfg.prompts_per_rank * world_size
    completions = prompts * cfg.num_generations
    rows_per_rank = cfg.prompts_per_rank * cfg.num_generations
    return {
        "prompts_per_step": prompts,
        "completions_per_step": completions,
        "rows_per_micro_batch": cfg.micro_batch_size,
        "micro_batches_per_rank": math.ceil(rows_per_rank / cfg.micro_batch_size),
        "updates_per_rollout_batch": cfg.num_iterations,
        "tokens_per_step_at_cap": completions * (cfg.data.max_prompt_length + cfg.max_completion_length),
        "completion_tokens_per_step_at_cap": completions * cfg.max_completion_length,
    }


def training_engine(cfg) -> str:
    d = cfg.distributed
    sharding = d.sharding_strategy if d.backend in FSDP_BACKENDS else f"ZeRO-{d.zero_stage}"
    if d.backend == "deepspeed" and d.deepspeed_config:
        sharding += f" (or as {d.deepspeed_config} says)"
    precision = f"mixed precision {d.mixed_precision}" if d.mixed_precision else "full precision"
    offload = ", cpu_offload" if d.cpu_offload else ""
    lora = f", LoRA r={cfg.lora.r}" if cfg.lora.r else ""
    return f"{d.backend} {sharding}, {precision} (weights {cfg.model.dtype}){offload}{lora}"


def run_table(cfg, world_size: int, has_reference: bool) -> list[str]:
    """The table's lines."""
    n = run_numbers(cfg, world_size)
    gen = f", generation_batch_size {cfg.generation_batch_size}" if cfg.generation_batch_size else ""
    if has_reference:
        ref = f"yes: beta {cfg.beta:g}, KL {'in the reward' if cfg.kl_in_reward else 'in the loss'} " \
              f"(kl_in_reward={str(cfg.kl_in_reward).lower()})"
    else:
        ref = "no (beta 0: not built, not run)"
    rows = [
        ("prompts per step", f"{n['prompts_per_step']} ({world_size} rank(s) x prompts_per_rank "
                             f"{cfg.prompts_per_rank})"),
        ("completions per step", f"{n['completions_per_step']} (x num_generations {cfg.num_generations})"),
        ("micro-batches per step", f"{n['micro_batches_per_rank']} per rank of {n['rows_per_micro_batch']} rows "
                                   f"(micro_batch_size)" if cfg.max_tokens_per_micro_batch is None else
                                   f"by token count: at most {cfg.max_tokens_per_micro_batch} tokens computed "
                                   f"(max_tokens_per_micro_batch) and {cfg.micro_batch_size} rows each"
                                   + (", rows balanced between ranks by tokens" if world_size > 1 else "")),
        ("log-prob passes", "packed rows where the model can pack (padding_free)" if cfg.padding_free else
                            "padded rows (padding_free=false)"),
        ("updates per rollout", f"{n['updates_per_rollout_batch']} (num_iterations)"),
        ("tokens per step at cap", f"{n['tokens_per_step_at_cap']} ({n['completions_per_step']} x "
                                   f"(max_prompt_length {cfg.data.max_prompt_length} + max_completion_length "
                                   f"{cfg.max_completion_length}))"),
        ("rollout engine", f"{cfg.rollout_engine}{gen}"),
        ("training engine", training_engine(cfg)),
        ("reference model", ref),
    ]
    return ["[grpo_dist] run table:"] + [f"[grpo_dist]   {k:<23} {v}" for k, v in rows]
