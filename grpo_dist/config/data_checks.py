"""The checks of the `data` section that need no file (data_config_problems: the limit, the built-in arithmetic
set's options, the prompt template). grpo_dist.data imports them (load_examples refuses what they find) and the
config's checks report them; this module imports only the config's leaves (errors, choices), never grpo_dist.data
nor the schema, so neither import leads back here in a circle. (DataConfig itself: grpo_dist/config/schema.py.)"""

from __future__ import annotations

from typing import Optional

from grpo_dist.config.choices import ARITHMETIC_DEFAULTS
from grpo_dist.config.errors import short

_ARITH_KEYS = tuple(ARITHMETIC_DEFAULTS)
_SMALL_SPACE = 200_000      # spaces up to this size are enumerated and split exactly


def data_config_problems(cfg) -> list[str]:
    """Every problem of a data config (a DataConfig) found without reading a file. GRPOConfig.problems() reports
    them with the rest of the config; load_examples refuses a config that has any (the first is its DataError)."""
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
