"""The command line of the config: `python -m grpo_dist.config` lists every key (describe), `--check CONFIG` loads
one and prints it resolved with each value's source, or every problem (exit 2)."""

from __future__ import annotations

import dataclasses
import json
import sys
import typing

import yaml

from grpo_dist.config.compose import describe_composition, provenance_lines
from grpo_dist.config.errors import ConfigError, _raise_all
from grpo_dist.config.loading import blame, load_config
from grpo_dist.config.overrides import expand_flags
from grpo_dist.config.schema import GRPOConfig


def describe(cls=GRPOConfig, prefix: str = "") -> list[str]:
    """One line per key: name, type, default, help (the reference behind `python -m grpo_dist.config`)."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            lines.append(f"\n[{prefix}{f.name}]")
            lines += describe(hints[f.name], f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        ch = f.metadata.get("choices")
        extra = f" (one of: {', '.join(map(str, ch))})" if ch else ""
        lines.append(f"{prefix}{f.name} = {json.dumps(default)}  # {f.metadata.get('help', '')}{extra}")
    return lines


def _check_data_files(cfg: GRPOConfig, path, overrides: list[str], where: dict[str, str] | None = None) -> None:
    """--check: the data files the config names exist and their first row has the configured fields (no model,
    no dataset download); each problem names the file and line of the key, or the command line."""
    from grpo_dist.data.check import data_file_problems
    _raise_all([blame(b, path, overrides, sources=where or {}) for b in data_file_problems(cfg.data)])


def main(argv: list[str] | None = None) -> int:
    """`python -m grpo_dist.config`: `defaults` and `+exp=NAME` (grpo_dist/config/compose.py), then every key with
    its default and help.
    `python -m grpo_dist.config --check CONFIG [key=value | --key value | --key=value ...]`: the resolved config
    as YAML followed by `# key = value  <- source` comment lines saying where each value came from (FILE:LINE of
    the config, a defaults file or a +exp file; command line; default), exit 0; or every problem, one per line
    (exit 2). CONFIG may be `none` to check overrides on the defaults."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("\n".join(describe_composition() + [""] + describe()))
        return 0
    if args[0] != "--check" or len(args) < 2:
        print("usage: python -m grpo_dist.config [--check CONFIG|none [+exp=NAME ...] [key=value | --key value ...]]",
              file=sys.stderr)
        return 2
    path = None if args[1] == "none" else args[1]
    try:
        overrides = expand_flags(args[2:])
        where: dict[str, str] = {}
        cfg = load_config(path, overrides, where=where)
        _check_data_files(cfg, path, overrides, where)
        from grpo_dist.preflight import check_context_length  # reads the model's config.json, as the trainer's start
        check_context_length(cfg)
    except ConfigError as e:
        print(f"{path or 'config'}: {len(e.problems)} problem(s)", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return 2
    from grpo_dist.advice import start_warnings
    for line in start_warnings(cfg):
        print(line, file=sys.stderr)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    print("# where each value came from:")  # as YAML comments: stdout stays the resolved YAML
    print("\n".join(f"# {line}" for line in provenance_lines(cfg.to_dict(), where)))
    return 0
