"""The allowed values of the config, one source each: every list of choices a key takes, the keys (with defaults) of
the free-form mappings model.tiny and data.arithmetic, and the bounds other modules check against too.

A leaf: it imports nothing of grpo_dist. The schema (grpo_dist/config/schema.py) names these in its fields, the checks
in their messages, and the code that acts on a value (losses, advantages, data files, models, engines) tests against
the same tuple, so that a new choice is added in one place and tests/test_config_choices.py finds a user that
forgot it.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------------------------------- model
DTYPES = ("float32", "bfloat16", "float16", "float64")  # model.dtype (models.DTYPES maps them to torch dtypes)
# model.tiny: the keys a tiny random model takes, with their defaults (models.build_tiny_model), and its architectures
TINY_DEFAULTS = dict(architecture="qwen2", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=256, vocab_size=None, tokenizer="char",
                     max_position_embeddings=1024, tie_word_embeddings=False, rope_theta=10000.0)
TINY_ARCHITECTURES = ("qwen2", "llama", "qwen3")

# ------------------------------------------------------------------------------------------------- distributed
TRAINING_BACKENDS = ("fsdp", "fsdp2", "deepspeed")  # distributed.backend: the training engines (engines.build_engine)
FSDP_BACKENDS = ("fsdp", "fsdp2")  # the backends that shard with torch's FSDP (sharding_strategy applies)
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
FSDP2_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")  # what fully_shard's reshard_after_forward can say
FSDP_WRAPS = ("auto", "layer", "model")
MIXED_PRECISIONS = ("bf16", "fp16")  # distributed.mixed_precision (models.MIXED_PRECISION_DTYPES)
ZERO_STAGES = (2, 3)

# ---------------------------------------------------------------------------------------------- rollout, loss
ROLLOUT_ENGINES = ("lean", "hf", "vllm")
SAMPLING_NOISES = ("per_prompt", "rank")
SAMPLER_CORRECTIONS = ("none", "token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")  # advantages.group_advantages
LOSS_TYPES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo")  # losses.grpo_loss
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")  # losses.kl_estimate
OPTIMIZERS = ("adamw", "adamw_8bit")
LR_SCHEDULERS = ("constant", "linear", "cosine")  # engines.lr_lambda

# ----------------------------------------------------------------------------------- checkpoints, logging, eval
SAVE_FORMATS = ("auto", "full", "sharded")
SAVE_BEST_MODES = ("max", "min")
# The metrics an evaluation logs (trainer.evaluate), what save_best can judge by, and the key of their tier.
EVAL_METRICS = {"eval_accuracy": "eval_steps", "eval_full_accuracy": "full_eval_steps"}
REPORT_TO = ("jsonl", "tensorboard", "wandb")  # metrics.MetricsLogger's sinks
LEAN_CUDA_GRAPHS = (True, False, "auto")

# ------------------------------------------------------------------------------------------------------ data
DATA_PRESETS = ("gsm8k", "math500", "math", "arithmetic")  # data.presets.PRESETS
ANSWER_FORMATS = ("raw", "gsm8k", "boxed")  # data.files.load_file
# data.arithmetic: the arguments of grpo_dist.data.arithmetic.synthetic_arithmetic, with its defaults
ARITHMETIC_DEFAULTS = dict(num_examples=10000, max_operand=19, num_operands=2, ops="+", seed=0)

# ------------------------------------------------------------------------------------------ health, curriculum
# health.*: the training-health monitor (grpo_dist/health.py, whose CONDITIONS say what each means). Defaults from
# the seed documents' monitoring tables and peers' reports: 000 section 11-12 (loss always 0 = every group has one
# reward; reward_avg stuck at 0 or 1; avg_response_len suddenly below 10 = only EOS), 001 section 4.3 (token entropy
# below 1.0 predicts mode collapse, healthy 1.5-3.0; a sudden grad-norm rise predicts instability) and TRL's
# 256-token default that cut off 97-99% of completions while the run silently learned nothing (truncated_max).
HEALTH_CONDITIONS = ("reward_constant", "zero_advantage", "truncated", "length_collapse", "entropy_collapse",
                     "grad_norm_jump", "kl_high", "nonfinite")
CURRICULUM_MODES = ("none", "static", "online")

# ---------------------------------------------------------------------------------------------------- rewards
# A grader that needs more than a day per completion is hung; past ~9.2e9 s (int64 nanoseconds) the grading
# pool's select() raises OverflowError.
MAX_REWARD_TIMEOUT_S = 86400.0
# Reward weights say how much each function counts against the others. Rewards are O(1) to O(100); summed in fp32
# (advantages, group std: squares), |w| <= 1e6 keeps w * reward and its square far below fp32's 3.4e38, and no mix
# needs a ratio beyond 1e6 between weights (past 2^24 ~ 1.7e7 the smaller term is under fp32 rounding anyway).
MAX_REWARD_WEIGHT = 1e6

# environment section (grpo_dist/environments/, docs/tools.md)
TOOLS = ("python",)  # environment.tools: the built-in tools
TOOL_FORMATS = ("auto", "qwen", "markdown")  # environment.tool_format
