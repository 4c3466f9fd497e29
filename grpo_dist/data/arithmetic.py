"""The built-in arithmetic set (the `arithmetic` preset): problems such as "3+14=" generated from a seed, with
disjoint train and held-out splits, no file and no download; options_problems checks its options (data.arithmetic)."""

from __future__ import annotations

import random
from typing import Optional

from grpo_dist.config.data_checks import (_SMALL_SPACE, _argument_problems, _size_problem, _space,  # noqa: F401
                                         options_problems)  # (the options' checks live with the config's)
from grpo_dist.config.schema import DataConfig
from grpo_dist.data.examples import DataError, PromptExample

_EVAL_FRACTION = 0.2


def _arith_problem(code: int, base: int, num_operands: int, ops: str) -> tuple[str, str]:
    """Decode a problem number (mixed radix: operands in base `base`, operators in base len(ops))."""
    operands = []
    for _ in range(num_operands):
        code, d = divmod(code, base)
        operands.append(d)
    operators = []
    for _ in range(num_operands - 1):
        code, d = divmod(code, len(ops))
        operators.append(ops[d])
    prompt = str(operands[0]) + "".join(o + str(x) for o, x in zip(operators, operands[1:])) + "="
    return prompt, str(_arith_value(operands, operators))


def _arith_value(operands: list[int], operators: list[str]) -> int:
    """Usual precedence: '*' binds tighter than '+' and '-', which go left to right."""
    terms = [operands[0]]
    signs = [1]
    for op, x in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


def synthetic_arithmetic(num_examples: int = 10000, max_operand: int = 19, num_operands: int = 2, ops: str = "+",
                         seed: int = 0, split: str = "train") -> list[PromptExample]:
    """Built-in arithmetic problems: prompt "3+14=", answer "17" (operands 0..max_operand, operators from `ops`,
    '*' before '+'/'-'). Deterministic from `seed`; train and eval never share a prompt.

    Small problem spaces (<= 200k distinct problems; 0..19 + 0..19 has 400) are enumerated, shuffled with `seed` and
    split 80/20: train is the first `num_examples` of the 80 % part (so fewer than num_examples when the part is
    smaller; no duplicates), eval is the 20 % part (at most max(1, num_examples // 4)).
    Large spaces: each problem belongs to eval iff a hash of (seed, prompt) falls in a 20 % bucket; train draws
    `num_examples` distinct non-eval problems with `seed`, eval draws max(1, num_examples // 4) distinct eval-bucket
    problems with a different seed.
    """
    if split not in ("train", "eval"):
        raise DataError(f"split must be 'train' or 'eval', got {split!r}")
    bad = _argument_problems(num_examples, max_operand, num_operands, ops, seed)
    if bad:
        raise DataError(bad[0])
    ops = "".join(dict.fromkeys(ops))  # dedupe, keep order
    base = max_operand + 1
    space = _space(max_operand, num_operands, ops)
    n_eval = max(1, num_examples // 4)

    if space <= _SMALL_SPACE:
        codes = list(range(space))
        random.Random(f"arith:{seed}").shuffle(codes)
        k = max(1, round(space * _EVAL_FRACTION))
        eval_codes, train_codes = codes[:k], codes[k:]
        chosen = train_codes[:num_examples] if split == "train" else eval_codes[:n_eval]
    else:
        want = num_examples if split == "train" else n_eval
        size = _size_problem(want, num_examples, space)
        if size:
            raise DataError(size)
        rng = random.Random(f"arith:{seed}:{split}")
        seen: set[int] = set()
        chosen = []
        while len(chosen) < want:
            c = rng.randrange(space)
            if c in seen:
                continue
            seen.add(c)
            if _in_eval_bucket(c, seed) == (split == "eval"):
                chosen.append(c)
    out = []
    for i, c in enumerate(chosen):
        prompt, answer = _arith_problem(c, base, num_operands, ops)
        out.append(PromptExample(prompt=prompt, answer=answer, index=i, columns={"answer": answer}))
    return out


def _in_eval_bucket(code: int, seed: int) -> bool:
    import hashlib
    h = hashlib.blake2b(f"{seed}:{code}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % 5 == 0


def arithmetic_from_config(cfg: DataConfig, split: str, limit: Optional[int]) -> list[PromptExample]:
    """The split of the arithmetic set data.arithmetic describes (options already checked: options_problems)."""
    examples = synthetic_arithmetic(**(cfg.arithmetic or {}), split=split)
    return examples[:limit] if limit is not None else examples
