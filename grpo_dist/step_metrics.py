"""The step's metrics, from its StepState (learner.py), summed over ranks by name (distributed.all_reduce_sum_named:
one collective, slots in name order): rewards, lengths, loss terms, token counts, the sampler/trainer mismatch,
each reward function's mean, and the timing and model-flops figures. Every function here that all-reduces is a
collective: every rank calls it, in the same order."""

from __future__ import annotations

import time

import torch

from grpo_dist import distributed as gdist
from grpo_dist import flops
from grpo_dist.rollout import cut_off


def step_metrics(cfg, ctx, state, eos_ids, step: int, learning_rate: float, skipped_steps: int,
                 epoch: int) -> dict:
    """The step's metrics over all ranks (one all-reduce of sums by name, one of the longest completion); sets
    state.completion_tokens (per rank, for tokens/s) and state.attention_pairs (all ranks, for mfu)."""
    dev, batch, rewards, rows, sums = ctx.device, state.batch, state.rewards, state.rows, state.sums
    lengths = batch.completion_lengths.double().cpu()
    row_tokens = (batch.prompt_mask.sum(1).double().cpu() + lengths)[rows]  # s of each trained row (mfu)
    s = gdist.all_reduce_sum_named({
        "reward": float(rewards.sum()), "reward_sq": float((rewards.double() ** 2).sum()), "rows": len(rewards),
        "correct": float(state.correct.sum()), "completion_tokens": float(lengths.sum()),
        "flat_groups": float(state.flat_groups.sum()), "groups": len(state.flat_groups),
        # cut off = no EOS in the completion (the loss's mask_truncated_completions definition): a completion that
        # ends with EOS exactly at max_completion_length finished
        "truncated": float(cut_off(batch, eos_ids).sum()),
        "prompt_tokens": float(batch.prompt_mask.sum()),
        "trained_tokens": float(batch.loss_mask.sum(-1).double().cpu()[rows].sum()),  # the model's tokens only
        "attention_pairs": float((row_tokens * (row_tokens + 1)).sum()),
        "decode_processed": float(state.graded.decode[0]), "decode_useful": float(state.graded.decode[1]),
        "prompts_truncated": float(state.graded.prompts_cut),
        **{k: sums[k] for k in ("loss", "pg", "kl", "clipped", "ratio", "entropy", "dual_clipped")},
        **{f"tokens/{k}_{name}": getattr(t, k) for name, t in state.tokens.items()
           for k in ("processed", "useful", "shared")}}, dev)
    mx = gdist.all_reduce_max([float(lengths.max()) if len(lengths) else 0.0], dev)
    n, tok = s["rows"], max(float(s["trained_tokens"]), 1.0)  # tokens trained, all ranks
    tok_iters = tok * cfg.num_iterations
    mean = float(s["reward"] / n)
    state.completion_tokens = float(s["completion_tokens"]) / ctx.world_size
    state.attention_pairs = float(s["attention_pairs"])
    return {
        "step": step,
        "reward_mean": mean,
        "reward_std": float(torch.sqrt((s["reward_sq"] / n - mean ** 2).clamp(min=0))),
        "accuracy": float(s["correct"] / n),
        "completion_length_mean": float(s["completion_tokens"] / n),
        "completion_length_max": float(mx[0]),
        "truncated_fraction": float(s["truncated"] / n),
        "prompt_length_mean": float(s["prompt_tokens"] / n),  # with completion_length_mean: the length ratio
        "prompts_truncated": int(s["prompts_truncated"]),  # prompts (all ranks) cut to max_prompt_length tokens
        "zero_advantage_fraction": float(s["flat_groups"] / s["groups"]),
        "loss": float(s["loss"]),
        "policy_loss": float(s["pg"] / tok),
        "kl": float(s["kl"] / tok),
        "clip_fraction": float(s["clipped"] / tok_iters),  # the dual-clip bound counts as clipped too
        **({"dual_clip_fraction": float(s["dual_clipped"] / tok_iters)}
           if cfg.effective_dual_clip_c is not None else {}),
        "ratio_mean": float(s["ratio"] / tok_iters),
        "entropy": float(s["entropy"] / tok),
        "trained_tokens": float(s["trained_tokens"]),  # 0: no row trained (entropy, kl then read 0)
        "grad_norm": state.grad_norms[-1] if state.grad_norms else 0.0,
        "learning_rate": learning_rate,
        "skipped_steps": skipped_steps,
        # tokens each pass computed (padding and empty passes included) and the real ones it needed, all ranks and
        # iterations: their difference is the padding (padding_free, max_tokens_per_micro_batch)
        **{k: float(v) for k, v in s.items() if k.startswith("tokens/")},
        "epoch": epoch,
        # decode rows computed vs tokens generated, all ranks and rollout rounds (lean / hf: vLLM batches its own
        # way); their gap is the padding that decode_compaction_threshold removes
        **({"tokens/processed_decode": float(s["decode_processed"]),
            "tokens/useful_decode": float(s["decode_useful"])} if cfg.rollout_engine != "vllm" else {}),
    }


def sampler_metrics(cfg, ctx, state, behaviour_ratio: bool) -> dict:
    """sampler_logprob_diff: mean |logp_trainer - logp_sampler|, sampler_kl: k3 estimate of KL(sampler ||
    trainer), over the completion tokens trained on (all ranks); is_weight_mean with a sampler correction."""
    sums, rows = state.sums, state.rows
    tokens = float(state.batch.loss_mask[rows].sum()) if rows else 0.0
    s = gdist.all_reduce_sum_named({"sampler_diff": sums["sampler_diff"], "sampler_kl": sums["sampler_kl"],
                                    "is_weight": sums["is_weight"], "tokens": tokens}, ctx.device)
    tok = max(float(s["tokens"]), 1.0)
    out = {"sampler_logprob_diff": float(s["sampler_diff"] / tok), "sampler_kl": float(s["sampler_kl"] / tok)}
    if cfg.sampler_correction != "none" or behaviour_ratio:
        out["is_weight_mean"] = float(s["is_weight"] / tok)
    return out


def reward_means(per_function: dict, device) -> dict:
    """reward/<name>: each function's mean over the completions of all ranks (every rank has the same functions,
    so the all-reduce matches; a rank with no rows adds zeros)."""
    # a score that does not apply (NaN: a batch function's None) is left out of its function's mean
    s = gdist.all_reduce_sum_named({**{f"sum/{k}": float(sum(x for x in v if x == x)) for k, v in
                                       per_function.items()},
                                    **{f"rows/{k}": float(sum(1 for x in v if x == x)) for k, v in
                                       per_function.items()}}, device)
    return {f"reward/{name}": float(s[f"sum/{name}"] / max(float(s[f"rows/{name}"]), 1.0)) for name in per_function}


def timing_metrics(times: dict, t0: float, completion_tokens: float, weight_sync_s: float) -> dict:
    """step_time_s, time_<stage>_s, this rank's sampling throughput and the weight sync's part of the rollout."""
    return {"step_time_s": time.perf_counter() - t0, **{f"time_{k}_s": v for k, v in times.items()},
            "completion_tokens_per_s": completion_tokens / max(times.get("rollout", 0.0), 1e-9),
            "time_weight_sync_s": weight_sync_s}  # part of time_rollout_s


def flops_metrics(cfg, shape: tuple, peak_flops, metrics: dict, times: dict, attention_pairs: float) -> dict:
    """mfu, mfu_update, mfu_logprobs, tokens_per_s_update, tokens_per_s_logprobs, model_flops (flops.py)."""
    n, layers, d_q = shape
    update, no_grad = flops.step_flops(n, layers, d_q, metrics, attention_pairs, cfg.num_iterations)
    return flops.metrics(update, no_grad, metrics, {**times, "step": metrics["step_time_s"]}, peak_flops,
                         gdist.group_size())
