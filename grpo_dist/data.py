"""Prompt data: loading (.jsonl / .json / .parquet / hf:), presets, the built-in arithmetic set, prompt rendering,
and the deterministic, resumable, rank-sharded prompt sampler.

Presets fill defaults; anything the user set explicitly wins:

======== ================================== ============== ============ ============= =========================
preset   train file                         prompt_field   answer_field answer_format eval split (no eval_path)
======== ================================== ============== ============ ============= =========================
gsm8k    gsm8k/train.jsonl (7473)           question       answer       gsm8k         gsm8k/test.jsonl (1319)
math500  math500/test.jsonl (500)           problem        answer       raw           none
math     math_test5000/test.jsonl minus the problem        solution     boxed         math500/test.jsonl (500)
         500 MATH-500 problems (4500)
arithm.  built in, no file                  -              -            raw           disjoint held-out problems
======== ================================== ============== ============ ============= =========================

"Explicitly set" means "different from the DataConfig class default" (a dataclass cannot tell a default from the same
value written by hand): e.g. with ``preset: gsm8k`` the answer format is ``gsm8k`` unless ``data.answer_format`` is set
to something other than ``raw``. To read a file with no preset logic at all, set ``data.preset: null``.
An explicit ``data.path`` replaces the preset's training file; with the ``arithmetic`` preset (the config default) it
replaces the built-in set entirely, so ``data.path=train.jsonl`` alone loads that file.

Preset data comes from the Hugging Face Hub through `datasets` (cached in HF_HOME after the first download):
gsm8k = openai/gsm8k (config main), math500 = HuggingFaceH4/MATH-500, the MATH test set =
DigitalLearningGmbH/MATH-lighteval (split test, 5000 problems). With ``$GRPO_DIST_DATA_DIR`` set, the files above
are read from that folder instead (an offline mirror; the tests use one) and the Hub is never asked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from grpo_dist.config import DataConfig
from grpo_dist.rewards.extract import last_boxed  # one extractor for references and completions


class DataError(ValueError):
    """A data problem, naming the file and line (or the config key) at fault."""


@dataclass
class PromptExample:
    prompt: str   # the problem text (not rendered)
    answer: str   # the reference answer, already extracted
    index: int    # 0-based position in the loaded split (stable: same data config -> same index)


# ------------------------------------------------------------------------------------------------ answer extraction

def extract_reference(raw: str, answer_format: str) -> str:
    """The gold answer from a reference field.

    gsm8k: the text after the last '####', stripped, with thousands separators removed ('1,080' -> '1080').
    boxed: the content of the last \\boxed{...} (or \\fbox{...}), nested braces matched.
    raw:   the field, stripped.
    Raises DataError when the marker is missing.
    """
    if answer_format == "raw":
        return raw.strip()
    if answer_format == "gsm8k":
        k = raw.rfind("####")
        if k < 0:
            raise DataError("no '####' marker in the answer (answer_format gsm8k)")
        return raw[k + 4:].strip().replace(",", "")
    if answer_format == "boxed":
        content = last_boxed(raw)
        if content is None:
            raise DataError("no \\boxed{...} in the answer (answer_format boxed)")
        return content.strip()
    raise DataError(f"unknown answer_format {answer_format!r}; choose raw, gsm8k or boxed")


# ------------------------------------------------------------------------------------------------ presets

@dataclass(frozen=True)
class _Preset:
    train: Optional[str]            # file in the offline mirror, a key of HUB_SOURCES (None: built in)
    eval: Optional[str]
    prompt_field: Optional[str] = None
    answer_field: Optional[str] = None
    answer_format: Optional[str] = None
    exclude_from_train: Optional[str] = None   # file whose prompts are removed from the training split


PRESETS: dict[str, _Preset] = {
    "gsm8k": _Preset("gsm8k/train.jsonl", "gsm8k/test.jsonl", "question", "answer", "gsm8k"),
    "math500": _Preset("math500/test.jsonl", None, "problem", "answer", "raw"),
    # MATH test (5000) has no 'answer' field: the gold answer is the last \boxed{} of 'solution'. MATH-500 is a subset
    # of it, so its 500 problems are dropped from the training split (the remaining 4500 are PRM800K's train problems).
    "math": _Preset("math_test5000/test.jsonl", "math500/test.jsonl", "problem", "solution", "boxed",
                    exclude_from_train="math500/test.jsonl"),
    "arithmetic": _Preset(None, None),
}
_MATH500_EVAL = ("problem", "answer", "raw")  # fields of math500 when used as the eval split of `math`

# Where each preset file comes from on the Hub: (dataset, config, split). The mirror's files hold the same rows.
HUB_SOURCES: dict[str, tuple[str, Optional[str], str]] = {
    "gsm8k/train.jsonl": ("openai/gsm8k", "main", "train"),
    "gsm8k/test.jsonl": ("openai/gsm8k", "main", "test"),
    "math500/test.jsonl": ("HuggingFaceH4/MATH-500", None, "test"),
    "math_test5000/test.jsonl": ("DigitalLearningGmbH/MATH-lighteval", "default", "test"),
}
DATA_DIR_ENV = "GRPO_DIST_DATA_DIR"


def data_dir() -> Optional[Path]:
    """The offline mirror of the preset data ($GRPO_DIST_DATA_DIR), or None: presets then load from the Hub."""
    env = os.environ.get(DATA_DIR_ENV)
    if not env:
        return None
    p = Path(env)
    if not p.is_dir():
        raise DataError(f"{DATA_DIR_ENV}={env} is not a directory")
    return p


def _preset_source(rel: str | None, preset: str | None) -> str:
    assert rel is not None, preset  # only the built-in arithmetic preset has no file, and it never gets here
    """The mirror's file for `rel` when $GRPO_DIST_DATA_DIR is set, else an hf:NAME:CONFIG:SPLIT spec."""
    root = data_dir()
    if root is None:
        name, config, split = HUB_SOURCES[rel]
        return f"hf:{name}:{config}:{split}" if config else f"hf:{name}:{split}"
    p = root / rel
    if not p.is_file():
        raise DataError(f"data.preset={preset}: file {p} not found; {DATA_DIR_ENV} must name a folder holding "
                        f"{rel}, or unset it to load {HUB_SOURCES[rel][0]} from the Hugging Face Hub, or set "
                        f"data.path")
    return str(p)


def _normalise(text: str) -> str:
    """Whitespace-insensitive key: MATH copies on the Hub and in mirrors differ in spacing, not in content."""
    return " ".join(text.split())


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DataConfig) if f.default is not dataclasses.MISSING}


def resolve_data_config(cfg: DataConfig) -> DataConfig:
    """A copy of `cfg` with the preset's defaults filled in (fields left at their class default take the preset's
    value). Paths of preset files are resolved against the shared data directory only when loading."""
    if cfg.preset is None:
        return dataclasses.replace(cfg)
    if cfg.preset not in PRESETS:
        raise DataError(f"config key 'data.preset' = {cfg.preset!r} is not known; choose one of {', '.join(PRESETS)}")
    p = PRESETS[cfg.preset]
    changes = {}
    for name in ("prompt_field", "answer_field", "answer_format"):
        value = getattr(p, name)
        if value is not None and getattr(cfg, name) == _DEFAULTS[name]:
            changes[name] = value
    return dataclasses.replace(cfg, **changes)


# ------------------------------------------------------------------------------------------------ loading

def load_examples(cfg: DataConfig, split: str = "train") -> list[PromptExample]:
    """Load the `train` split (data.path or the preset's file, first data.limit rows) or the `eval` split
    (data.eval_path, else the preset's held-out set, else []). data.eval_limit is not applied here: all eval rows are
    returned and the evaluator picks its subset."""
    if split not in ("train", "eval"):
        raise DataError(f"split must be 'train' or 'eval', got {split!r}")
    rcfg = resolve_data_config(cfg)
    preset = PRESETS.get(cfg.preset) if cfg.preset else None
    limit = cfg.limit if split == "train" else None
    if limit is not None and limit < 1:
        raise DataError(f"config key 'data.limit' must be >= 1 (or null), got {limit}")

    if split == "train":
        if cfg.path is not None:
            return _load_file(cfg.path, rcfg.prompt_field, rcfg.answer_field, rcfg.answer_format, limit)
        if cfg.preset == "arithmetic":
            return _arithmetic_from_cfg(cfg, "train", limit)
        if preset is None:
            raise DataError("config key 'data.path' (or 'data.preset') must be set")
        path = _preset_source(preset.train, cfg.preset)
        if not preset.exclude_from_train:
            return _load_file(path, rcfg.prompt_field, rcfg.answer_field, rcfg.answer_format, limit)
        ex_path = _preset_source(preset.exclude_from_train, cfg.preset)
        exclude = {_normalise(e.prompt) for e in _load_file(ex_path, *_MATH500_EVAL, None)}
        rows = _load_file(path, rcfg.prompt_field, rcfg.answer_field, rcfg.answer_format, None)
        kept = [e for e in rows if _normalise(e.prompt) not in exclude]
        found = len(exclude & {_normalise(e.prompt) for e in rows})
        if found != len(exclude):  # else training and evaluation would share problems
            raise DataError(f"data.preset={cfg.preset}: {path} holds {found} of the {len(exclude)} problems of "
                            f"{ex_path} that must leave the training split; is it the MATH test set?")
        kept = [dataclasses.replace(e, index=i) for i, e in enumerate(kept)]
        return kept[:limit] if limit is not None else kept

    # eval
    if cfg.eval_path is not None:
        return _load_file(cfg.eval_path, rcfg.prompt_field, rcfg.answer_field, rcfg.answer_format, None)
    if cfg.preset == "arithmetic":
        return [] if cfg.path is not None else _arithmetic_from_cfg(cfg, "eval", None)
    if preset is None or preset.eval is None:
        return []
    path = _preset_source(preset.eval, cfg.preset)
    if cfg.preset == "math":  # eval set is MATH-500, whose fields differ from the training file's
        return _load_file(path, *_MATH500_EVAL, None)
    return _load_file(path, rcfg.prompt_field, rcfg.answer_field, rcfg.answer_format, None)


def _load_file(path: str, prompt_field: str, answer_field: str, answer_format: str,
               limit: Optional[int]) -> list[PromptExample]:
    if answer_format not in ("raw", "gsm8k", "boxed"):
        raise DataError(f"config key 'data.answer_format' = {answer_format!r} is not allowed; choose raw, gsm8k "
                        f"or boxed")
    rows: Iterator[tuple[Any, Any]]
    if path.startswith("hf:"):
        rows, where = _iter_hf(path), path
    else:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"data file not found: {path}" + (" (it is a directory)" if p.is_dir() else ""))
        suffix = p.suffix.lower()
        if suffix == ".jsonl":
            rows = _iter_jsonl(p)
        elif suffix == ".json":
            rows = _iter_json(p)
        elif suffix == ".parquet":
            rows = _iter_parquet(p)
        else:
            raise DataError(f"{path}: unsupported data file type {suffix or '(no suffix)'!r}; use .jsonl, .json, "
                            f".parquet or hf:NAME[:SPLIT]")
        where = str(path)

    out: list[PromptExample] = []
    for loc, row in rows:
        ctx = f"{where}:{loc}" if isinstance(loc, int) else f"{where}: {loc}"
        if not isinstance(row, dict):
            raise DataError(f"{ctx}: row is a {type(row).__name__}, not an object with fields "
                            f"'{prompt_field}' and '{answer_field}'")
        prompt = _field(row, prompt_field, ctx)
        raw_answer = _field(row, answer_field, ctx)
        try:
            answer = extract_reference(raw_answer, answer_format)
        except DataError as e:
            raise DataError(f"{ctx}: field '{answer_field}': {e}") from None
        if not answer:
            raise DataError(f"{ctx}: field '{answer_field}' gives an empty reference answer "
                            f"(answer_format {answer_format})")
        out.append(PromptExample(prompt=prompt, answer=answer, index=len(out)))
        if limit is not None and len(out) >= limit:
            break
    return out


def _field(row: dict, name: str, ctx: str) -> str:
    if name not in row:
        present = ", ".join(map(str, row)) or "none"
        raise DataError(f"{ctx}: missing field '{name}' (fields present: {present})")
    v = row[name]
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise DataError(f"{ctx}: field '{name}' must be a string or number, got {type(v).__name__} "
                        f"{_short(v)}")
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    s = str(v)
    if not s.strip():
        raise DataError(f"{ctx}: field '{name}' is empty")
    return s


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _not_utf8(p: Path, lineno: int, e: UnicodeDecodeError, line_start: int = 0) -> DataError:
    return DataError(f"{p}:{lineno}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at column "
                     f"{e.start - line_start + 1}); re-encode the file as UTF-8")


def _iter_jsonl(p: Path) -> Iterator[tuple[int, Any]]:
    with open(p, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(p, lineno, e) from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None


def _iter_json(p: Path) -> Iterator[tuple[Any, Any]]:
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8(p, raw.count(b"\n", 0, e.start) + 1, e, raw.rfind(b"\n", 0, e.start) + 1) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{p}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, list):
        raise DataError(f"{p}: a .json data file must hold a list of objects, got a {type(data).__name__}")
    # A list parsed as a whole has no per-item line numbers; report the item's line when items are one per line.
    lines = _item_lines(text, len(data))
    for i, row in enumerate(data):
        yield (lines[i] if lines else f"item {i + 1}"), row


def _item_lines(text: str, n: int) -> Optional[list[int]]:
    """Line numbers (1-based) of the items of a JSON list written one item per line; None otherwise."""
    lines = text.splitlines()
    found = []
    for k, line in enumerate(lines, 1):
        s = line.strip().rstrip(",")
        if s in ("", "[", "]"):
            continue
        candidates = [s]
        if s.startswith("["):
            candidates.append(s[1:].strip().rstrip(","))
        if s.endswith("]"):
            candidates += [c[:-1].strip().rstrip(",") for c in list(candidates)]
        if not any(_parses(c) for c in candidates):
            return None
        found.append(k)
    return found if len(found) == n else None


def _parses(s: str) -> bool:
    try:
        json.loads(s)
    except json.JSONDecodeError:
        return False
    return True


def _iter_parquet(p: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{p}: reading .parquet needs the `pyarrow` package (pip install pyarrow)") from None
    try:
        table = pq.read_table(p)
    except Exception as e:  # noqa: BLE001 - any pyarrow failure means an unreadable file
        raise DataError(f"{p}: cannot read parquet file: {e}") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"row {i + 1}", row


def _iter_hf(spec: str) -> Iterator[tuple[str, Any]]:
    """hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT (split default 'train')."""
    parts = spec[3:].split(":")
    if not parts[0] or len(parts) > 3:
        raise DataError(f"data path {spec!r}: use hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT")
    name = parts[0]
    config = parts[1] if len(parts) == 3 else None
    split = parts[-1] if len(parts) >= 2 else "train"
    try:
        import datasets
    except ImportError:
        raise DataError(f"data path {spec!r} needs the `datasets` package (pip install datasets), or export the "
                        f"split to a .jsonl file and set data.path to it") from None
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001 - offline, unknown name, missing split: all end the run the same way
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        where = f"{name}" + (f" (config {config}, split {split})" if config else f" (split {split})")
        raise DataError(f"cannot load the dataset {where} from the Hugging Face Hub: {type(e).__name__}: {reason}. "
                        f"Offline, set {DATA_DIR_ENV} to a folder mirroring the preset files (gsm8k/, math500/, "
                        f"math_test5000/), or export the split to a .jsonl file and set data.path") from None
    for i, row in enumerate(ds):
        yield f"row {i + 1}", row


# ------------------------------------------------------------------------------------------------ arithmetic

_ARITH_KEYS = ("num_examples", "max_operand", "num_operands", "ops", "seed")
_SMALL_SPACE = 200_000      # spaces up to this size are enumerated and split exactly
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


def _check_arith_args(num_examples, max_operand, num_operands, ops, seed) -> str:
    def bad(key, msg):
        raise DataError(f"config key 'data.arithmetic.{key}' {msg}")
    for key, v, lo in (("num_examples", num_examples, 1), ("max_operand", max_operand, 1),
                       ("num_operands", num_operands, 2)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            bad(key, f"must be an integer >= {lo}, got {v!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        bad("seed", f"must be an integer, got {seed!r}")
    if not isinstance(ops, str) or not ops or set(ops) - set("+-*"):
        bad("ops", f"must be a non-empty string of operators from '+-*', got {ops!r}")
    return "".join(dict.fromkeys(ops))  # dedupe, keep order


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
    ops = _check_arith_args(num_examples, max_operand, num_operands, ops, seed)
    base = max_operand + 1
    space = base ** num_operands * len(ops) ** (num_operands - 1)
    n_eval = max(1, num_examples // 4)

    if space <= _SMALL_SPACE:
        codes = list(range(space))
        random.Random(f"arith:{seed}").shuffle(codes)
        k = max(1, round(space * _EVAL_FRACTION))
        eval_codes, train_codes = codes[:k], codes[k:]
        chosen = train_codes[:num_examples] if split == "train" else eval_codes[:n_eval]
    else:
        want = num_examples if split == "train" else n_eval
        if want > space // 2:
            raise DataError(f"config key 'data.arithmetic.num_examples' = {num_examples} is too large for a space of "
                            f"{space} problems with a held-out part; use at most {space // 2}")
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
        out.append(PromptExample(prompt=prompt, answer=answer, index=i))
    return out


def _in_eval_bucket(code: int, seed: int) -> bool:
    import hashlib
    h = hashlib.blake2b(f"{seed}:{code}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % 5 == 0


def _arithmetic_from_cfg(cfg: DataConfig, split: str, limit: Optional[int]) -> list[PromptExample]:
    opts = cfg.arithmetic or {}
    if not isinstance(opts, dict):
        raise DataError(f"config key 'data.arithmetic' must be a mapping of {', '.join(_ARITH_KEYS)}")
    for k in opts:
        if k not in _ARITH_KEYS:
            raise DataError(f"unknown config key 'data.arithmetic.{k}'; allowed: {', '.join(_ARITH_KEYS)}")
    examples = synthetic_arithmetic(**opts, split=split)
    return examples[:limit] if limit is not None else examples


# ------------------------------------------------------------------------------------------------ rendering

def render_prompt(example: PromptExample, cfg: DataConfig, tokenizer) -> str:
    """The text the model is prompted with.

    data.prompt_template must contain '{prompt}', which is replaced by the problem text. It is the only placeholder:
    every other brace is literal, so templates such as 'Put the answer in \\boxed{}. {prompt}' need no doubled braces.
    With data.use_chat_template the filled template is the user message (after data.system_prompt, if set) and the
    tokenizer's chat template renders it with the generation prompt appended.
    """
    template = cfg.prompt_template
    if not isinstance(template, str) or "{prompt}" not in template:
        raise DataError(f"config key 'data.prompt_template' must contain '{{prompt}}', got {template!r}")
    user = template.replace("{prompt}", example.prompt)
    if not cfg.use_chat_template:
        return user
    messages = []
    if cfg.system_prompt:
        messages.append({"role": "system", "content": cfg.system_prompt})
    messages.append({"role": "user", "content": user})
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("config key 'data.use_chat_template' is true but the tokenizer has no chat_template; set "
                        "data.use_chat_template=false or use a tokenizer with one")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):  # some versions wrap single conversations
        text = text[0] if isinstance(text, list) and text and isinstance(text[0], str) else str(text)
    return text


# ------------------------------------------------------------------------------------------------ sampler

class PromptSampler:
    """Deterministic, resumable, rank-sharded prompt order.

    Epoch e visits a permutation of all examples drawn from numpy's RNG seeded with (seed, e), identical on every
    rank. A step takes the next global batch of prompts_per_rank * world_size prompts; rank r takes its
    [r * prompts_per_rank, (r + 1) * prompts_per_rank) slice, so ranks are disjoint and all take the same number of
    steps. The last len(examples) % global_batch prompts of each epoch's permutation are dropped (different ones each
    epoch).

    state_dict() records the position (epoch, step_in_epoch) and what it depends on. load_state_dict() refuses a
    state whose seed, number of examples or global batch size differs (the position would then name different
    prompts). A different world_size is accepted when prompts_per_rank * world_size is unchanged: the global batches
    are then exactly the same and only their split across ranks changes.
    """

    def __init__(self, examples: list[PromptExample], prompts_per_rank: int, rank: int, world_size: int, seed: int):
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world_size {world_size}")
        if prompts_per_rank < 1:
            raise DataError(f"prompts_per_rank must be >= 1, got {prompts_per_rank}")
        self.examples = examples
        self.prompts_per_rank = prompts_per_rank
        self.rank = rank
        self.world_size = world_size
        self.seed = int(seed)
        self.global_batch = prompts_per_rank * world_size
        self._steps_per_epoch = len(examples) // self.global_batch
        if self._steps_per_epoch == 0:
            raise DataError(f"{len(examples)} examples is fewer than one global batch of prompts_per_rank x "
                            f"world_size = {prompts_per_rank} x {world_size} = {self.global_batch}")
        self._epoch = 0
        self._step = 0
        self._perm_epoch: Optional[int] = None
        self._perm: Any = None  # numpy permutation of epoch _perm_epoch

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step_in_epoch(self) -> int:
        return self._step

    @property
    def steps_per_epoch(self) -> int:
        return self._steps_per_epoch

    def permutation(self, epoch: int):
        """The order (indices into `examples`) of epoch `epoch`; the same on every rank."""
        if self._perm_epoch != epoch:
            import numpy as np
            # SeedSequence needs non-negative entropy; fold a negative seed into a distinct non-negative value.
            s = self.seed if self.seed >= 0 else (1 << 64) + self.seed
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([s, epoch])))
            self._perm = rng.permutation(len(self.examples))
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> list[PromptExample]:
        """This rank's prompts for the next step; rolls over to the next epoch after the last step of one."""
        perm = self.permutation(self._epoch)
        start = self._step * self.global_batch + self.rank * self.prompts_per_rank
        batch = [self.examples[int(i)] for i in perm[start:start + self.prompts_per_rank]]
        self._step += 1
        if self._step >= self._steps_per_epoch:
            self._epoch += 1
            self._step = 0
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "step_in_epoch": self._step, "seed": self.seed,
                "num_examples": len(self.examples), "world_size": self.world_size,
                "prompts_per_rank": self.prompts_per_rank}

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in ("epoch", "step_in_epoch", "seed", "num_examples", "world_size", "prompts_per_rank")
                   if k not in state]
        if missing:
            raise DataError(f"sampler state is missing {', '.join(missing)}")
        problems = []
        if state["num_examples"] != len(self.examples):
            problems.append(f"the checkpoint had {state['num_examples']} examples, now there are "
                            f"{len(self.examples)} (data.path / data.limit / preset changed?)")
        if state["seed"] != self.seed:
            problems.append(f"the checkpoint's data seed is {state['seed']}, now {self.seed}")
        old_gb = state["prompts_per_rank"] * state["world_size"]
        if old_gb != self.global_batch:
            problems.append(f"the checkpoint's global batch is prompts_per_rank x world_size = "
                            f"{state['prompts_per_rank']} x {state['world_size']} = {old_gb}, now "
                            f"{self.prompts_per_rank} x {self.world_size} = {self.global_batch} (a different world "
                            f"size is fine only with the same global batch)")
        if problems:
            raise DataError("cannot resume the prompt order: " + "; ".join(problems))
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if epoch < 0 or not 0 <= step <= self._steps_per_epoch:
            raise DataError(f"sampler state position epoch={epoch} step_in_epoch={step} is invalid "
                            f"({self._steps_per_epoch} steps per epoch)")
        if step == self._steps_per_epoch:
            epoch, step = epoch + 1, 0
        self._epoch, self._step = epoch, step


# ------------------------------------------------------------------------------------------- pathological rows
# Characters kept per token of max_prompt_length when a prompt is cut before tokenizing: generous (most tokens
# are 3-5 characters, whitespace runs of code tokenizers up to ~16), so the left truncation to max_prompt_length
# tokens still happens on real tokens, but a 10 MB row never reaches the tokenizer whole (GBs, seconds per step).
CHARS_PER_TOKEN_BOUND = 16


def truncate_long_prompts(examples: list[PromptExample], max_prompt_length: int, where: str,
                          warn: bool = True) -> list[PromptExample]:
    """Keep the last max_prompt_length * CHARS_PER_TOKEN_BOUND characters of over-long prompts (prompts are
    truncated from the left, like the tokens later); one warning per file with the count."""
    limit = max_prompt_length * CHARS_PER_TOKEN_BOUND
    cut = [i for i, e in enumerate(examples) if len(e.prompt) > limit]
    if not cut:
        return examples
    out = list(examples)
    longest = max(len(examples[i].prompt) for i in cut)
    for i in cut:
        out[i] = dataclasses.replace(out[i], prompt=out[i].prompt[-limit:])
    if not warn:
        return out
    print(f"[grpo_dist] warning: {where}: {len(cut)} of {len(examples)} prompts are longer than {limit} characters "
          f"(up to {longest}); kept their last {limit} characters before tokenizing (max_prompt_length="
          f"{max_prompt_length} tokens, truncated from the left)", flush=True)
    return out
