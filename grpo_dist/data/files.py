"""Reading prompt rows from a file (.jsonl, .json, .parquet) or a Hugging Face dataset (hf:NAME[:CONFIG]:SPLIT), and
the reference answer of each row (answer_format raw, gsm8k '#### n' or boxed). Every problem is a DataError naming
the file and line (or row) at fault."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from grpo_dist.config.choices import ANSWER_FORMATS
from grpo_dist.data.examples import DataError, PromptExample
from grpo_dist.data.presets import DATA_DIR_ENV
from grpo_dist.rewards.extract import last_boxed  # one extractor for references and completions


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


def load_file(path: str, prompt_field: str, answer_field: str, answer_format: str,
              limit: Optional[int]) -> list[PromptExample]:
    """The first `limit` rows (all with None) of a .jsonl / .json / .parquet file or an hf:NAME[:CONFIG]:SPLIT
    dataset, each checked and its reference answer extracted with `answer_format`."""
    if answer_format not in ANSWER_FORMATS:
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
        messages = _messages(row[prompt_field], prompt_field, ctx) if isinstance(row.get(prompt_field), list) \
            else None
        prompt = _field(row, prompt_field, ctx) if messages is None else \
            next(m["content"] for m in reversed(messages) if m["role"] == "user")
        raw_answer = _field(row, answer_field, ctx)
        try:
            answer = extract_reference(raw_answer, answer_format)
        except DataError as e:
            raise DataError(f"{ctx}: field '{answer_field}': {e}") from None
        if not answer:
            raise DataError(f"{ctx}: field '{answer_field}' gives an empty reference answer "
                            f"(answer_format {answer_format})")
        out.append(PromptExample(prompt=prompt, answer=answer, index=len(out), messages=messages,
                                 columns={k: v for k, v in row.items() if k != prompt_field}))
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
    # JSON may escape half a UTF-16 pair ("\\ud800"): Python holds it, but no tokenizer takes such a string (a
    # TypeError naming nothing, at the first rollout)
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{ctx}: field '{name}' holds a lone UTF-16 surrogate ({s[e.start]!r} at character "
                        f"{e.start + 1}), not text; fix the row (a JSON \\u escape without its pair)") from None
    return s


def _messages(value: list, name: str, ctx: str) -> list[dict]:
    """A conversational prompt (TRL's format): a list of {"role": str, "content": str} with a user message."""
    if not value:
        raise DataError(f"{ctx}: field '{name}' is an empty list (a conversational prompt needs messages)")
    out = []
    for i, m in enumerate(value):
        where = f"{ctx}: field '{name}' message {i + 1}"
        if not isinstance(m, dict) or not {"role", "content"} <= set(m):
            raise DataError(f"{ctx}: field '{name}' is a list, but item {i + 1} is not a message with 'role' and "
                            f"'content' (TRL's conversational format): {_short(m)}")
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise DataError(f"{where}: 'role' and 'content' must be strings (text only), got "
                            f"{type(m['role']).__name__} and {type(m['content']).__name__}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in out):
        raise DataError(f"{ctx}: field '{name}' has no message with role 'user' "
                        f"(roles: {', '.join(m['role'] for m in out)})")
    return out


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
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:  # a string column with bytes that are not UTF-8 (pyarrow does not check on read)
        raise _bad_parquet_text(p, table) from None
    for i, row in enumerate(rows):
        yield f"row {i + 1}", row


def _bad_parquet_text(p: Path, table) -> DataError:
    """The first row and column whose string is not UTF-8 (only on that error: row by row)."""
    for i in range(table.num_rows):
        for name in table.column_names:
            try:
                table.column(name).slice(i, 1).to_pylist()
            except UnicodeDecodeError as e:
                return DataError(f"{p}: row {i + 1}: field '{name}' is not UTF-8 text (byte "
                                 f"0x{e.object[e.start]:02x}); re-encode the file's strings as UTF-8")
    return DataError(f"{p}: a string column is not UTF-8 text; re-encode the file's strings as UTF-8")


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
        # a machine without `datasets` (e.g. a bare GPU machine) is often offline too: the mirror is the way out
        raise DataError(f"data path {spec!r} needs the `datasets` package (pip install datasets); or set "
                        f"{DATA_DIR_ENV} to a folder mirroring the preset files (gsm8k/, math500/, math_test5000/), "
                        f"or export the split to a .jsonl file and set data.path to it") from None
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
