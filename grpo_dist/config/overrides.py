"""Overrides: `key=value` words applied to the config mapping (values read as YAML, a string key's value as
written), and argparse-style `--key value` / `--key=value` words (TRL's and transformers' scripts) rewritten as
such overrides."""

from __future__ import annotations

from typing import Any

import yaml

from grpo_dist.config.errors import ConfigError, _raise_all, short
from grpo_dist.config.schema import key_type
from grpo_dist.config.trl_names import BOOLEAN_NAMES
from grpo_dist.config.yaml_text import _check_yaml_size


def _parse_scalar(text: str, item: str) -> Any:
    """Parse a command-line value as YAML (numbers, bools, null, lists) and fall back to the raw string; a value
    past load_yaml's bounds is a ConfigError naming the override."""
    try:
        _check_yaml_size(text, f"override {short(item)}")
        return yaml.safe_load(text)
    except ConfigError:
        raise
    except (yaml.YAMLError, ValueError, RecursionError):
        return text


def apply_overrides(d: dict, overrides: list[str]) -> dict:
    """Apply every well-formed override to `d`, then raise (if any was not) naming each malformed one."""
    bad = []
    for item in overrides:
        if "=" not in item:
            bad.append(f"override {short(item)} must look like key=value (e.g. beta=0.0 or model.dtype=bfloat16)")
            continue
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = d
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                bad.append(f"override {short(item)}: '{p}' is not a section")
                break
        else:
            try:
                node[parts[-1]] = text if _is_text_key(parts) and text not in ("null", "~") else \
                    _parse_scalar(text, item)
            except ConfigError as e:
                bad += e.problems
    _raise_all(bad)
    return d


def expand_flags(tokens: list[str], keep: tuple[str, ...] = ()) -> list[str]:
    """Command-line words with argparse-style `--key value` / `--key=value` (TRL's and transformers' scripts; dotted
    keys too, `-` read as `_`) rewritten as `key=value` overrides; `key=value` words pass as they are. A bare
    `--key` of a boolean key (or of a TRL boolean such as --bf16) means true, and takes a following true / false.
    The options in `keep` (with their value, e.g. --config FILE) are left for the caller's argparse."""
    out, i, bad = [], 0, []
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        name = tok.split("=", 1)[0]
        if not tok.startswith("--") or tok == "--" or name in keep:
            out.append(tok)
            if name in keep and "=" not in tok and i < len(tokens):
                out.append(tokens[i])
                i += 1
            continue
        key = name[2:].replace("-", "_")
        if "=" in tok:
            out.append(f"{key}={tok.split('=', 1)[1]}")
            continue
        parts = key.split(".")
        boolean = key_type(parts) is bool or (len(parts) == 1 and key in BOOLEAN_NAMES)
        nxt = tokens[i] if i < len(tokens) else None
        if boolean:
            if nxt is not None and nxt.lower() in ("true", "false"):
                out.append(f"{key}={nxt.lower()}")
                i += 1
            else:
                out.append(f"{key}=true")
        elif nxt is None or (nxt.startswith("--") and nxt != "--"):
            bad.append(f"command line: flag {tok} needs a value: {tok} VALUE, {tok}=VALUE or {key}=VALUE")
        else:
            out.append(f"{key}={nxt}")
            i += 1
    _raise_all(bad)
    return out



def _is_text_key(parts: list[str]) -> bool:
    """Whether the dotted key names a string field: its value is taken as written ("End with: N." stays text
    instead of becoming a YAML mapping)."""
    return key_type(parts) is str
