"""TRL's GRPOConfig / transformers' TrainingArguments (and TRL's script arguments) key names that are not keys here,
with what each maps to, so that a TRL user's `--per_device_train_batch_size 16` is answered with the settings to use
instead of a guess. Keys with the same name and meaning here (learning_rate, num_generations, beta, epsilon,
epsilon_high, max_completion_length, num_iterations, logging_steps, save_steps, max_steps, temperature, top_p,
top_k, loss_type, scale_rewards, importance_sampling_level, mask_truncated_completions, warmup_steps, weight_decay,
max_grad_norm, lr_scheduler_type, seed, output_dir, report_to, save_total_limit, resume_from_checkpoint,
eval_steps, log_completions, ...) are config keys and are accepted as they are; their values are checked like any
other (TRL's loss_type values grpo / bnpo / dapo are not this trainer's: the refusal names the value to use,
TRL_VALUES).

One name is shared with another meaning: generation_batch_size is TRL's completions per generation round over all
processes, and here the sequences one rank generates at once (None: all of its prompts_per_rank x num_generations).

unknown_key_message builds the message for a key that is not a config key: the TRL mapping when the key is (or is a
likely typo of) a TRL name, else a "did you mean" only for a plausible typo of a key here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from grpo_dist.config.errors import clip

Explain = Callable[[Any, dict], str]  # (the user's value, the config mapping at that level) -> the advice


def _num(d: dict, key: str, default: int) -> int:
    v = d.get(key, default)
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _per_device_batch(value, d: dict) -> str:
    g, gas = _num(d, "num_generations", 8), _num(d, "gradient_accumulation_steps", 1)
    head = ("it counts completions per device per forward/backward (x gradient_accumulation_steps per "
            "optimizer step); here each rank trains prompts_per_rank x "
            "num_generations completions per step, in micro-batches of micro_batch_size")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        return head
    total = value * gas
    if total % g:
        lo, hi = max(total // g, 1), total // g + 1
        return (f"{head}: {value} x {gas} = {total} completions is not a multiple of num_generations={g}; "
                f"prompts_per_rank={lo} gives {lo * g}, prompts_per_rank={hi} gives {hi * g} (with "
                f"micro_batch_size={value})")
    return (f"{head}: for {value} (x gradient_accumulation_steps={gas}) with num_generations={g} set "
            f"prompts_per_rank={total // g} micro_batch_size={value} ({total // g} x {g} = {total} completions per "
            f"rank per step)")


def _grad_accum(value, d: dict) -> str:
    head = ("here a step trains each rank's prompts_per_rank x num_generations completions in micro-batches of "
            "micro_batch_size: the accumulation steps are ceil(prompts_per_rank x num_generations / "
            "micro_batch_size)")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        return head
    n = _num(d, "prompts_per_rank", 4) * _num(d, "num_generations", 8)
    if n % value:
        return f"{head}; with {n} completions per rank, {value} accumulation steps need micro_batch_size=" \
               f"{math.ceil(n / value)} (the last micro-batch is shorter)"
    return f"{head}: with {n} completions per rank, gradient_accumulation_steps={value} is micro_batch_size=" \
           f"{n // value} ({n} / {value})"


def _epochs(value, d: dict) -> str:
    p = _num(d, "prompts_per_rank", 4)
    return (f"training here runs max_steps steps of prompts_per_rank x world_size prompts: {value} epoch(s) of N "
            f"prompts on W ranks is max_steps = {value} x ceil(N / ({p} x W)) (the prompt order reshuffles each "
            f"epoch)")


def _warmup_ratio(value, d: dict) -> str:
    steps = _num(d, "max_steps", 100)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"set warmup_steps={math.ceil(value * steps)} (ceil({value} x max_steps={steps}))"
    return "set warmup_steps (= warmup_ratio x max_steps)"


def _to(override: str, why: str = "") -> Explain:
    return lambda value, d: f"set {override}" + (f" ({why})" if why else "")


def _flag(override: str, off: str) -> Explain:
    """A TRL boolean: the override for true, what false means here."""
    return lambda value, d: off if value is False else f"set {override}"


def _with_value(key: str, why: str = "") -> Explain:
    def explain(value, d):
        shown = "VALUE" if value is None else str(value).lower() if isinstance(value, bool) else value
        return f"set {key}={shown}" + (f" ({why})" if why else "")
    return explain


# TRL / transformers name -> (the key or keys here, the advice for the user's value)
TRL_NAMES: dict[str, tuple[str, Explain]] = {
    "per_device_train_batch_size": ("prompts_per_rank x num_generations, micro_batch_size", _per_device_batch),
    "gradient_accumulation_steps": ("micro_batch_size", _grad_accum),
    "num_train_epochs": ("max_steps", _epochs),
    "max_prompt_length": ("data.max_prompt_length", _with_value("data.max_prompt_length",
                                                                "prompts are truncated from the left, as in TRL")),
    "bf16": ("distributed.mixed_precision", _flag("distributed.mixed_precision=bf16", "full precision is the "
                                                   "default here (distributed.mixed_precision: null)")),
    "fp16": ("distributed.mixed_precision", _flag("distributed.mixed_precision=fp16", "full precision is the "
                                                   "default here (distributed.mixed_precision: null)")),
    "gradient_checkpointing": ("distributed.activation_checkpointing",
                               _flag("distributed.activation_checkpointing=true", "set "
                                     "distributed.activation_checkpointing=false (the default)")),
    "use_vllm": ("rollout_engine", _flag("rollout_engine=vllm (one in-process, colocated vLLM engine per rank; no "
                                         "server mode)", "the default rollout_engine here is lean (or hf)")),
    "vllm_mode": ("rollout_engine", _to("rollout_engine=vllm", "colocated engines only")),
    "vllm_gpu_memory_utilization": ("vllm.gpu_memory_utilization", _with_value("vllm.gpu_memory_utilization")),
    "vllm_tensor_parallel_size": ("vllm.tensor_parallel_size", _with_value("vllm.tensor_parallel_size")),
    "vllm_importance_sampling_correction": ("sampler_correction", _to(
        "sampler_correction=token", "or sequence; the truncated importance weight of the trainer/sampler ratio")),
    "vllm_importance_sampling_cap": ("sampler_correction_cap", _with_value("sampler_correction_cap")),
    "warmup_ratio": ("warmup_steps", _warmup_ratio),
    "optim": ("(AdamW only)", lambda v, d: "the optimizer here is always AdamW (learning_rate, weight_decay, "
                                           "adam_beta1, adam_beta2, adam_epsilon)"),
    "delta": ("dual_clip_c", _with_value("dual_clip_c", "the ratio of a negative-advantage token counts at most c "
                                                        "times")),
    "reward_funcs": ("rewards", _to("rewards=[{function: module:function, weight: 1.0}, ...]")),
    "reward_weights": ("rewards[i].weight", _to("a weight in each rewards item: rewards=[{function: ..., weight: "
                                                "W}, ...]")),
    "logging_strategy": ("logging_steps", _to("logging_steps=N")),
    "save_strategy": ("save_steps", _to("save_steps=N (0: only the final checkpoint)")),
    "eval_strategy": ("eval_steps", _to("eval_steps=N with data.eval_path (0: no evaluation)")),
    "per_device_eval_batch_size": ("(none)", lambda v, d: "evaluation here takes data.eval_limit held-out prompts, "
                                                          "split over the ranks, greedy"),
    "model_name_or_path": ("model.name_or_path", _with_value("model.name_or_path")),
    "torch_dtype": ("model.dtype", _with_value("model.dtype")),
    "dtype": ("model.dtype", _with_value("model.dtype")),
    "attn_implementation": ("model.attn_implementation", _with_value("model.attn_implementation")),
    "trust_remote_code": ("model.trust_remote_code", _with_value("model.trust_remote_code")),
    "dataset_name": ("data.path", lambda v, d: f"set data.path=hf:{v if v is not None else 'NAME'} (or hf:NAME:"
                                               f"SPLIT, hf:NAME:CONFIG:SPLIT), or a .jsonl/.json/.parquet file"),
    "dataset_train_split": ("data.path", _to("data.path=hf:NAME:SPLIT")),
    "use_peft": ("lora.r", _flag("lora.r=16 (any rank > 0 turns LoRA on)", "lora.r=0 (the default) trains every "
                                                                            "weight")),
    "lora_r": ("lora.r", _with_value("lora.r")),
    "lora_alpha": ("lora.alpha", _with_value("lora.alpha")),
    "lora_dropout": ("lora.dropout", _with_value("lora.dropout")),
    "lora_target_modules": ("lora.target_modules", _with_value("lora.target_modules")),
    "num_processes": ("(the launcher)", lambda v, d: "the world size is torchrun's --nproc_per_node x nodes"),
}

# TRL's values of keys that exist here with other values: (key, TRL value) -> the value here
TRL_VALUES = {
    ("loss_type", "grpo"): "seq_mean_token_mean (each completion's token mean, averaged over completions)",
    ("loss_type", "dapo"): "token_mean (over every completion token of the step, all ranks)",
    ("loss_type", "bnpo"): "token_mean (here always over the whole step, all ranks, not one device's batch)",
}


def trl_value_hint(key: str, value: Any) -> str:
    """' (TRL's X is Y here)' for a TRL value of a key here, else ''."""
    here = TRL_VALUES.get((key, value)) if isinstance(value, str) else None
    return f" (TRL's {key}={value} is {key}={here} here)" if here else ""


# TRL's booleans: a bare `--bf16` on the command line means true, as in transformers' HfArgumentParser
BOOLEAN_NAMES = ("bf16", "fp16", "gradient_checkpointing", "use_vllm", "use_peft", "trust_remote_code",
                 "vllm_importance_sampling_correction")


def edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions and adjacent transpositions."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def typo_of(key: str, candidates) -> str | None:
    """The candidate `key` is plausibly a typo of: at most one edit per 5 characters (one at least), the closest
    (ties: the first in sorted order); None when none is that close."""
    allowed = max(1, len(key) // 5)
    best = min(((edit_distance(key, c), c) for c in sorted(candidates)), default=None)
    return best[1] if best is not None and best[0] <= allowed else None


def trl_advice(name: str, value: Any, d: dict) -> str | None:
    """The advice for a TRL name (None when `name` is not in the table)."""
    entry = TRL_NAMES.get(name)
    return None if entry is None else entry[1](value, d)


def unknown_key_message(prefix: str, key: str, names, value: Any, d: dict) -> str:
    """The problem line of an unknown config key `prefix + key` among the `names` of its section."""
    full = f"unknown config key '{prefix}{clip(key)}'"
    allowed = f"; allowed keys here: {', '.join(sorted(names))}"
    if len(str(key)) > 100:  # no name here is that long, and edit distances on megabytes of key would take minutes
        return full + allowed
    if key in TRL_NAMES:
        return f"{full}: a TRL / transformers name; {trl_advice(key, value, d)}"
    ours, trl = typo_of(key, names), typo_of(key, TRL_NAMES)
    if ours is not None and (trl is None or edit_distance(key, ours) <= edit_distance(key, trl)):
        return f"{full} (did you mean '{prefix}{ours}'?){allowed}"
    if trl is not None:
        return (f"{full} (did you mean TRL's '{trl}'? here: {TRL_NAMES[trl][0]}: {trl_advice(trl, value, d)})"
                f"{allowed}")
    return full + allowed
