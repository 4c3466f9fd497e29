"""The `data` section: DataConfig and every check of it that needs no file (data_config_problems: the limit, the
built-in arithmetic set's options, the prompt template). A leaf: grpo_dist.data imports it, it imports nothing of
grpo_dist.data (that is what keeps grpo_dist.config free of an import circle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grpo_dist.config_sections.base import _f, short

# data.arithmetic: the arguments of grpo_dist.data.arithmetic.synthetic_arithmetic, with its defaults
ARITHMETIC_DEFAULTS = dict(num_examples=10000, max_operand=19, num_operands=2, ops="+", seed=0)
_ARITH_KEYS = tuple(ARITHMETIC_DEFAULTS)
_SMALL_SPACE = 200_000      # spaces up to this size are enumerated and split exactly


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


def data_config_problems(cfg: DataConfig) -> list[str]:
    """Every problem of a data config found without reading a file. GRPOConfig.problems() reports them with the rest
    of the config; load_examples refuses a config that has any (the first is its DataError)."""
    bad = []
    if cfg.limit is not None and cfg.limit < 1:
        bad.append(f"config key 'data.limit' must be >= 1 (or null), got {cfg.limit}")
    if cfg.preset == "arithmetic" and cfg.path is None:  # the built-in set is used: its options count
        bad += options_problems(cfg.arithmetic or {})
    return bad + template_problems(cfg.prompt_template)


def options_problems(opts) -> list[str]:
    """Every problem of the data.arithmetic options (keys and values of synthetic_arithmetic's arguments)."""
    if not isinstance(opts, dict):
        return [f"config key 'data.arithmetic' must be a mapping of {', '.join(_ARITH_KEYS)}"]
    unknown = [f"unknown config key 'data.arithmetic.{k}'; allowed: {', '.join(_ARITH_KEYS)}"
               for k in opts if k not in _ARITH_KEYS]
    if unknown:
        return unknown
    args = {k: opts.get(k, ARITHMETIC_DEFAULTS[k]) for k in _ARITH_KEYS}
    bad = _argument_problems(**args)
    if bad:
        return bad
    space = _space(args["max_operand"], args["num_operands"], args["ops"])
    size = _size_problem(args["num_examples"], args["num_examples"], space)  # the train split draws the most
    return [size] if size else []


def _argument_problems(num_examples, max_operand, num_operands, ops, seed) -> list[str]:
    bad = []
    for key, v, lo in (("num_examples", num_examples, 1), ("max_operand", max_operand, 1),
                       ("num_operands", num_operands, 2)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            bad.append(f"config key 'data.arithmetic.{key}' must be an integer >= {lo}, got {v!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        bad.append(f"config key 'data.arithmetic.seed' must be an integer, got {seed!r}")
    if not isinstance(ops, str) or not ops or set(ops) - set("+-*"):
        bad.append(f"config key 'data.arithmetic.ops' must be a non-empty string of operators from '+-*', got "
                   f"{ops!r}")
    return bad


def _space(max_operand: int, num_operands: int, ops: str) -> int:
    """How many distinct problems the options can make."""
    return (max_operand + 1) ** num_operands * len(set(ops)) ** (num_operands - 1)


def _size_problem(want: int, num_examples: int, space: int) -> Optional[str]:
    """Large spaces are sampled with a held-out part: at most half of the problems can be drawn for one split."""
    if space <= _SMALL_SPACE or want <= space // 2:
        return None
    return (f"config key 'data.arithmetic.num_examples' = {num_examples} is too large for a space of {space} "
            f"problems with a held-out part; use at most {space // 2}")


def template_problems(template) -> list[str]:
    """The problem of a data.prompt_template without its one placeholder, '{prompt}' (none when it has it)."""
    if not isinstance(template, str) or "{prompt}" not in template:
        return [f"config key 'data.prompt_template' must contain '{{prompt}}', got {short(template)}"]
    return []
