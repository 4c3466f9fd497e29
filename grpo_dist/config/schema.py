"""The config's schema: GRPOConfig and its sections as dataclasses, every key with its type, default, help
(`metadata["help"]`, printed by `python -m grpo_dist.config`) and, where the key takes one of a few values, its
choices (grpo_dist/config/choices.py).

One `GRPOConfig` holds everything. Algorithm knobs sit at the top level with TRL's names (num_generations, beta,
epsilon, ...); model, data, rewards and distributed settings live in sub-sections and are overridden with dotted
keys, e.g. `model.dtype=bfloat16 data.path=train.jsonl beta=0`. Building one validates it: problems() lists every
problem (grpo_dist/config/checks.py) and validate() raises them as one ConfigError.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

import grpo_dist.config.checks as checks
import grpo_dist.config.choices as C
from grpo_dist.config.errors import _raise_all

DEFAULT_ASYNC_DUAL_CLIP_C = 3.0  # dual-clip with stale rollouts when dual_clip_c is unset (verl's clip_ratio_c)


def _f(default: Any = dataclasses.MISSING, help: str = "", choices: tuple | None = None, factory=None):
    """A field with its help string (and its choices: the values _check_choices allows)."""
    meta: dict[str, Any] = {"help": help}
    if choices:
        meta["choices"] = choices
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


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
                    C.DTYPES)
    attn_implementation: Optional[str] = _f(None, "sdpa | eager | flash_attention_2 (None: transformers' default)")
    trust_remote_code: bool = _f(False, "passed to from_pretrained")
    init_seed: int = _f(0, "seed of the random init for `tiny` models (same on every rank)")


@dataclass
class DistributedConfig:
    backend: str = _f("fsdp", "training engine: fsdp (FSDP1, use_orig_params) | fsdp2 (fully_shard: per-parameter "
                      "DTensor shards, meta-device init on ranks != 0; docs/design.md says which to pick) | deepspeed",
                      C.TRAINING_BACKENDS)
    sharding_strategy: str = _f("FULL_SHARD", "FSDP sharding strategy (fsdp2: FULL_SHARD = reshard after forward, "
                                "SHARD_GRAD_OP = keep unsharded until backward)",
                                C.SHARDING_STRATEGIES)
    fsdp_wrap: str = _f("auto", "FSDP units: layer (one per decoder layer) | model (the whole model is one unit: one "
                        "all-gather per pass instead of one per layer) | auto (model below 100M parameters, where "
                        "per-layer collectives and hooks cost more than they save; layer above)",
                        C.FSDP_WRAPS)
    mixed_precision: Optional[str] = _f(None, "FSDP compute dtype: bf16 | fp16 | None (full precision)",
                                        C.MIXED_PRECISIONS)
    activation_checkpointing: bool = _f(False, "recompute decoder layers in the backward pass")
    timeout_s: int = _f(600, "collective timeout: a mismatched or dead peer fails the job after this long")
    num_threads: Optional[int] = _f(None, "torch threads per rank on CPU (None: OMP_NUM_THREADS or 1 under torchrun)")
    deepspeed_config: Optional[str] = _f(None, "DeepSpeed JSON/YAML config (backend=deepspeed)")
    zero_stage: int = _f(2, "DeepSpeed ZeRO stage when no deepspeed_config is given", C.ZERO_STAGES)
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
                       f"of {', '.join(C.HEALTH_CONDITIONS)}; the default is the one that cannot false-alarm on a run "
                       "that learns (docs/troubleshooting.md#health-monitor); [] never stops")
    reward_constant_min_completions: int = _f(459, "reward_constant stops the run (stop_on) only once this many "
                                              "completions in a row scored the same (its line comes after patience "
                                              "steps): a config whose completions succeed 1 % of the time shows 459 "
                                              "failures in a row with probability 0.99^459 < 1 %")



@dataclass
class CurriculumConfig:
    mode: str = _f("none", "difficulty-aware prompt sampling (grpo_dist/curriculum.py, docs/curriculum.md): none "
                   "(the epoch permutations) | static (easiest first by difficulty_field, the pool unlocked by a "
                   "pacing schedule) | online (prompts whose last `window` groups were all solved or all failed are "
                   "drawn with weight retire_weight)", C.CURRICULUM_MODES)
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
class DataConfig:
    preset: Optional[str] = _f("arithmetic", "gsm8k | math500 | math | arithmetic (built in) | None: fills path, "
                               "fields and answer format",
                               C.DATA_PRESETS)
    path: Optional[str] = _f(None, "training prompts: .jsonl, .json or .parquet file, or hf:NAME[:SPLIT]")
    prompt_field: str = _f("question", "field holding the problem text")
    answer_field: str = _f("answer", "field holding the reference answer")
    answer_format: str = _f("raw", "how to read the reference: raw | gsm8k ('#### n') | boxed (last \\boxed{})",
                            C.ANSWER_FORMATS)
    prompt_template: str = _f("{prompt}", "template with {prompt}; used when use_chat_template is false")
    use_chat_template: bool = _f(False, "render prompts with the tokenizer's chat template")
    system_prompt: Optional[str] = _f(None, "system message for the chat template")
    max_prompt_length: int = _f(512, "prompts longer than this many tokens are truncated from the left (counted "
                                "per step as prompts_truncated; see max_truncated_prompt_fraction)")
    max_truncated_prompt_fraction: float = _f(0.05, "refuse to start (exit 2) when more than this fraction of the "
                                              "training prompts is longer than max_prompt_length tokens, so would "
                                              "lose its beginning while its reference answer stays; up to it, one "
                                              "warning at start. In [0, 1]: 0 refuses any cut, 1 never refuses")
    limit: Optional[int] = _f(None, "use only the first N rows (after loading, before shuffling)")
    eval_path: Optional[str] = _f(None, "held-out prompts for periodic evaluation (same fields)")
    eval_limit: Optional[int] = _f(64, "the light evaluation tier: the first N held-out prompts, evaluated every "
                                   "eval_steps (null: all of them; full_eval_steps is the tier of the whole set)")
    arithmetic: dict = _f(factory=dict, help="options of the built-in arithmetic set: {num_examples, max_operand, "
                          "num_operands, ops, seed}")


@dataclass
class EnvironmentConfig:
    """Multi-turn rollouts with tools (grpo_dist/environments/, docs/tools.md). Empty (the default): plain
    single-turn GRPO, exactly as without the section."""
    tools: list = _f(factory=list, help="built-in tools of a multi-turn episode: [python] (code in the model's turn "
                     "runs in a sandbox, its output is the next turn); []: single-turn")
    env_class: Optional[str] = _f(None, "module:Class of your own environment (grpo_dist.environments.MultiTurnEnv; "
                                  "called with tokenizer, max_turns, max_episode_tokens and `args`)")
    args: dict = _f(factory=dict, help="keyword arguments of env_class")
    max_turns: int = _f(4, "model turns per episode at most; a tool call in the last one is not run (counted)")
    max_episode_tokens: Optional[int] = _f(None, "model and observation tokens of an episode together, at most "
                                           "(None: max_completion_length, which it may not exceed)")
    tool_format: str = _f("auto", "how the model calls the tool: auto (qwen where the chat template has <tool_call>, "
                          "else markdown) | qwen | markdown (```python blocks, ```output answers)",
                          C.TOOL_FORMATS)
    tool_timeout_s: float = _f(5.0, "wall time of one tool call (its CPU time limit too)")
    episode_timeout_s: float = _f(20.0, "tool wall time of one episode in all; later calls are refused (counted)")
    tool_memory_mb: int = _f(1024, "address-space limit of a tool call's process")
    max_tool_output_chars: int = _f(1024, "the end of a call's output kept for the model (more is cut, saying so)")
    tool_workers: int = _f(4, "tool calls run at once")


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
                             C.SAVE_BEST_MODES)
    save_format: str = _f("auto", "checkpoint format: full (HF safetensors + optimizer gathered on rank 0) | sharded "
                          "(torch.distributed.checkpoint, every rank writes its shards; export_checkpoint makes "
                          "an HF directory) | auto (full up to 4B parameters, sharded above)",
                          C.SAVE_FORMATS)
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
                             C.SAMPLING_NOISES)
    rollout_engine: str = _f("lean", "what samples the rollouts: lean (grpo_dist.decoder's preallocated-cache "
                             "decoder for Qwen2/Qwen3/Llama/Mistral, else the transformers forward) | hf (the "
                             "model's own transformers forward) | vllm (one in-process vLLM engine per rank, "
                             "section vllm; pip install 'grpo_dist[vllm]')", C.ROLLOUT_ENGINES)
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
                                 C.SAMPLER_CORRECTIONS)
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
                            C.SCALE_REWARDS)
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
                        C.LOSS_TYPES)
    num_iterations: int = _f(1, "updates per rollout batch (PPO epochs); >1 stores old log-probs")
    importance_sampling_level: str = _f("token", "ratio pi / pi_old per token (GRPO) or per sequence (GSPO: the "
                                        "geometric mean of the token ratios)", C.IMPORTANCE_SAMPLING_LEVELS)
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
                           "exp(-log ratio) + log ratio - 1", C.KL_ESTIMATORS)
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
                        "refused with deepspeed; docs/optimizers.md)", C.OPTIMIZERS)
    learning_rate: float = _f(1e-6, "AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon")
    max_grad_norm: float = _f(1.0, "gradient clipping (0: off)")
    warmup_steps: int = _f(0, "linear warmup steps")
    lr_scheduler_type: str = _f("constant", "schedule after warmup", C.LR_SCHEDULERS)
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
        return checks.async_problems(self, world_size)

    def problems(self) -> list[str]:
        """Every problem of this config, in the order of the checks (validate raises one ConfigError with all of
        them; `python -m grpo_dist.config --check` prints them all)."""
        return checks.config_problems(self)

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


def key_type(parts: list[str]):
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


def lean_cuda_graphs_on(cfg, device) -> bool:
    """Whether the lean engine replays its decode steps from CUDA graphs on `device` (config key lean_cuda_graphs:
    true, false, or auto = where the device is CUDA and the engine lean)."""
    if cfg.lean_cuda_graphs == "auto":
        return cfg.rollout_engine == "lean" and getattr(device, "type", str(device)).startswith("cuda")
    return cfg.lean_cuda_graphs is True

