"""Loading a config: the composed mapping (grpo_dist/config/compose.py: defaults, +exp files) with the overrides
applied, checked value by value against the schema's types (_coerce) and built into a GRPOConfig, which checks
itself; every problem is prefixed with where its key came from (FILE:LINE or the command line)."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Union

from grpo_dist.config.compose import compose, note_overrides, source_of, split_exp
from grpo_dist.config.errors import ConfigError, _raise_all, short
from grpo_dist.config.overrides import apply_overrides
from grpo_dist.config.schema import GRPOConfig
from grpo_dist.config.trl_names import unknown_key_message
from grpo_dist.config.yaml_text import key_line


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently convert) `value` against the annotation `tp`, or raise naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if bool in args and isinstance(value, bool) or str in args[1:] and isinstance(value, str):
            return value  # bool | str keys (true / false / "auto"): the value as it came
        return _coerce(value, args[0], key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping of {_type_name(tp)} keys, got {short(value)}")
        return _from_dict(tp, value, key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {short(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key '{key}' must be an integer, got {short(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' must be a number, got {short(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}' must be a string, got {short(value)}")
    if tp is list or origin is list:
        if isinstance(value, list):
            return value
        if isinstance(value, str):  # one item given on the command line
            return [value] if value else []
        raise ConfigError(f"config key '{key}' must be a list, got {short(value)}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"config key '{key}' must be a mapping, got {short(value)}")
    return value


def _from_dict(cls, d: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    bad = []
    for k in sorted(set(d) - names):
        bad.append(unknown_key_message(prefix, k, names, d[k], d))
    kwargs = {}
    for k, v in d.items():
        if k in names:
            try:
                kwargs[k] = _coerce(v, hints[k], prefix + k)
            except ConfigError as e:  # go on with the default, to report the other keys' problems too
                bad += e.problems
    try:
        obj = cls(**kwargs)
    except ConfigError as e:
        bad += e.problems
    _raise_all(bad)
    return obj


def blame(message: str, path, overrides: list[str], lines: dict[str, int] | None = None,
           sources: dict[str, str] | None = None) -> str:
    """Prefix an error with where the bad key came from: the command line, or the YAML file and the key's line
    (`lines`: dotted key -> line in `path`, from yaml_key_lines; or `sources`: dotted key -> "FILE:LINE", from
    grpo_dist/config/compose.py, where the key may be written in a defaults or +exp file)."""
    if message.startswith("override "):  # a malformed override names itself
        return message
    # "config key 'a' ...", or "config keys 'a' + 'b' ..." (any of them given on the command line)
    m = re.match(r"(?:.*?)config keys? ((?:'[^']+'(?: \+ |, | and )?)+)", message)
    given = {o.split("=", 1)[0].strip() for o in overrides if "=" in o}
    for key in re.findall(r"'([^']+)'", m.group(1)) if m else []:
        top = re.split(r"[.\[]", key)[0]
        if any(key == g or key.startswith(g + ".") or key.startswith(g + "[") or g == top for g in given):
            return f"command line: {message}"
        source = source_of(sources, key) if sources is not None else None
        if source:
            return f"{source}: {message}"
        line = key_line(lines or {}, key)
        if path and line:
            return f"{path}:{line}: {message}"
    return f"{path}: {message}" if path else message


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None, where: dict[str, str] | None = None) -> GRPOConfig:
    """Load YAML (optional; or start from `base`, e.g. a run's saved config) with its `defaults` chain, merge the
    `+exp=NAME` files (grpo_dist/config/compose.py), apply dotted overrides, build and validate the typed config.
    `where`, when given, is filled with each dotted key's source ("FILE:LINE" or "command line")."""
    exps, overrides = split_exp(overrides or [])
    d, sources = compose(path, exps, base)
    bad = []
    try:
        d = apply_overrides(d, overrides)
    except ConfigError as e:  # the well-formed overrides are applied: check the rest of the config too
        bad += e.problems
    note_overrides(sources, overrides)
    if where is not None:
        where.update(sources)
    try:
        cfg = _from_dict(GRPOConfig, d)
    except ConfigError as e:
        bad += e.problems
    _raise_all([blame(b, path, overrides, sources=sources) for b in bad])  # each names its file:line or the CLI
    return cfg
