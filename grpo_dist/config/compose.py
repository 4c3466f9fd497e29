"""Composable configs: a YAML file may name `defaults: [base.yaml, ...]` (paths relative to the file), and the
command line may name `+exp=NAME` experiment files (configs/exp/NAME.yaml). One dict comes out, merged in this
order, each layer deep-merging its nested sections over the ones before:

    defaults (in order, each with its own defaults first) -> the file itself -> +exp files (in order) -> key=value

with, for every dotted key, where its value came from ("FILE:LINE" or "command line"): load_config names a bad key
by it, and `python -m grpo_dist.config --check` prints it. The config a run saves (output_dir/config.yaml and
trainer_state.json) is the merged result without `defaults`: resume and evaluate read that, never the chain.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from grpo_dist.config.errors import ConfigError, clip, nearest_key_value
from grpo_dist.config.schema import key_type
from grpo_dist.config.yaml_text import load_yaml, yaml_key_lines

DEFAULTS_KEY = "defaults"
EXP_PREFIX = "+exp="
COMMAND_LINE = "command line"


def shipped_configs_dir() -> Path:
    """The shipped configs/ (with exp/, the `+exp=NAME` files): the source tree's, else where a wheel installs them
    (setup.cfg data_files: <prefix>/share/grpo_dist/configs, prefix = sys.prefix, the user base, or the data path
    of the install scheme). The source tree's path when none has them (then it is named in "not found" lines)."""
    import site
    import sys
    import sysconfig
    source = Path(__file__).resolve().parents[2] / "configs"  # grpo_dist/config/compose.py -> the tree's root
    prefixes = [sys.prefix, getattr(site, "USER_BASE", None) or "", sysconfig.get_path("data")]
    for d in [source] + [Path(x) / "share" / "grpo_dist" / "configs" for x in prefixes if x]:
        if (d / "exp").is_dir():
            return d.resolve()
    return source


def shipped_exp_dir() -> Path:
    """The shipped experiment overrides; `+exp=NAME` also looks in exp/ next to the config file and in
    ./configs/exp/."""
    return shipped_configs_dir() / "exp"


def describe_composition() -> list[str]:
    """The listing's lines for `defaults` and `+exp=NAME` (`python -m grpo_dist.config`): not dataclass fields, so
    describe() cannot find them, yet a user writes them like keys."""
    shipped = ", ".join(sorted(p.stem for p in shipped_exp_dir().glob("*.yaml"))) or "none"
    return [
        "[composition]  # not config keys: they say which files make up the config (grpo_dist/config/compose.py, "
        "docs/configs.md)",
        f"{DEFAULTS_KEY} = []  # in a config file: the YAML files it builds on (paths relative to it), deep-merged "
        f"in list order (each with its own {DEFAULTS_KEY} first) before the file itself; dropped from the saved "
        f"config",
        f"{EXP_PREFIX}NAME  # on the command line (repeatable, in order): merge NAME.yaml from exp/ next to the "
        f"config, ./configs/exp/ or the shipped configs/exp/ ({shipped}) after the file and before the key=value "
        f"overrides; `--check` shows each value's source",
    ]


def split_exp(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(+exp names in order, the other overrides)."""
    exps = [o[len(EXP_PREFIX):].strip() for o in overrides if o.startswith(EXP_PREFIX)]
    return exps, [o for o in overrides if not o.startswith(EXP_PREFIX)]


def exp_path(name: str, config_path: Path | None) -> Path:
    """The file of `+exp=NAME`: a path to a .yaml file as given, else NAME.yaml in exp/ next to the config file,
    ./configs/exp/ or the shipped configs/exp/ (the first that exists)."""
    if name.endswith((".yaml", ".yml")) and Path(name).is_file():
        return Path(name)
    dirs = ([config_path.parent / "exp"] if config_path is not None else []) + [Path("configs") / "exp",
                                                                                 shipped_exp_dir()]
    for d in dirs:
        f = d / f"{name}.yaml"
        if f.is_file():
            return f
    known = sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.yaml")})
    raise ConfigError(f"command line: +exp={clip(name)}: no such experiment file (looked in "
                      f"{', '.join(str(d) for d in dirs)}); known: {', '.join(known) or 'none'}")


def deep_merge(into: dict, layer: dict, where: dict[str, str], layer_where: dict[str, str], prefix: str = "") -> None:
    """Merge `layer` over `into` in place: mappings merge key by key (recursively), anything else (scalars, lists)
    replaces. `where` (dotted key -> source) follows: a replaced key forgets its old sub-keys' sources."""
    for k, v in layer.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            if key in layer_where:
                where[key] = layer_where[key]
            deep_merge(into[k], v, where, layer_where, key + ".")
            continue
        for old in [w for w in where if w.startswith(key + ".") or w.startswith(key + "[")]:
            del where[old]
        into[k] = _copy(v)
        where.update({w: s for w, s in layer_where.items() if w == key or w.startswith(key + ".")
                      or w.startswith(key + "[")})


def _copy(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_copy(x) for x in v]
    return v


_YAML_SUFFIXES = (".yaml", ".yml")


class _Composer:
    """One composition: the folders `defaults:` may reach, and each file expanded once (a diamond of defaults, a
    file reached along several paths, is read and merged once instead of once per path: 2^depth before)."""

    def __init__(self, roots: list[Path]):
        self.roots = [r.resolve() for r in roots] + [shipped_configs_dir()]
        self.done: dict[Path, tuple[dict, dict[str, str]]] = {}

    def default_path(self, name: str, named_by: Path, line) -> Path:
        """The file a `defaults:` entry of `named_by` names: a relative path to a .yaml file, from named_by's folder
        (or, when not there, from the shipped configs), that stays inside the allowed folders once symlinks are
        followed. Refused before the file is opened: nothing of a file outside is ever read or printed."""
        where = f"{named_by}:{line}: config key 'defaults' entry {clip(repr(name), 300)}"
        if Path(name).is_absolute() or name.startswith("~"):
            raise ConfigError(f"{where} is an absolute path: defaults name files relative to the config, under "
                              f"{self._allowed()}")
        if not name.endswith(_YAML_SUFFIXES):
            raise ConfigError(f"{where} is not a .yaml file: defaults name config files")
        candidates = [named_by.parent / name, shipped_configs_dir() / name]
        path = next((c for c in candidates if c.is_file()), candidates[0])
        real = path.resolve()
        if not any(real.is_relative_to(r) for r in self.roots):
            raise ConfigError(f"{where} resolves to {real}, outside the folders defaults may name ({self._allowed()})")
        return path

    def _allowed(self) -> str:
        return ", ".join(str(r) for r in dict.fromkeys(self.roots))

    def file(self, path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict, dict[str, str]]:
        """A config file with its defaults chain merged under it: (dict without `defaults`, dotted key ->
        "FILE:LINE"). A file met again inside its own chain is a cycle, refused with one line naming the files."""
        real = path.resolve()
        if real in chain:
            names = [str(p) for p in chain[chain.index(real):]] + [str(real)]
            raise ConfigError(f"{path}: config defaults form a cycle: {' -> '.join(names)}")
        if real not in self.done:
            self.done[real] = self._expand(path, real, chain)
        return self.done[real]

    def _expand(self, path: Path, real: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[str, str]]:
        d, lines = _read_config_file(path, chain)
        own_where = {k: f"{path}:{n}" for k, n in lines.items()
                     if k != DEFAULTS_KEY and not k.startswith(DEFAULTS_KEY + "[")}
        defaults = d.pop(DEFAULTS_KEY, None) or []
        if isinstance(defaults, str):
            defaults = [defaults]
        if not isinstance(defaults, list) or not all(isinstance(x, str) for x in defaults):
            raise ConfigError(f"{path}:{lines.get(DEFAULTS_KEY)}: config key 'defaults' must be a list of YAML file "
                              f"paths (relative to this file), got {clip(repr(defaults))}")
        merged: dict = {}
        where: dict[str, str] = {}
        for name in defaults:
            base, base_where = self.file(self.default_path(name, path, lines.get(DEFAULTS_KEY)), chain + (real,))
            deep_merge(merged, base, where, base_where)
        deep_merge(merged, d, where, own_where)
        return merged, where


def _read_config_file(path: Path, chain: tuple[Path, ...]) -> tuple[dict, dict[str, int]]:
    """(the file's mapping, its key lines). A file reached through `defaults:` that is not a config (not YAML, not a
    mapping, none of its top-level keys a config key) is refused naming the file and no more: its text is
    somebody else's, never echoed (a YAML error's excerpt, unknown-key names)."""
    if not path.is_file():
        named_by = f"{chain[-1]}: config key 'defaults' names " if chain else ""
        raise ConfigError(f"{named_by}config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read as UTF-8 text: {e}") from None
    try:
        d = load_yaml(text, str(path)) or {}  # bounded (depth, alias expansion) before anything else reads it
    except ConfigError as e:
        if not chain:
            raise
        raise ConfigError(f"{path}: not a config file ({_without_excerpt(str(e), str(path))}; named by "
                          f"{chain[-1]})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: top level must be a mapping of config keys")
    if chain and d and not any(k == DEFAULTS_KEY or (isinstance(k, str) and key_type([k]) is not None)
                               for k in d):
        raise ConfigError(f"{path}: not a config file: none of its {len(d)} top-level keys is a config key (named "
                          f"by {chain[-1]}; its keys are not shown)")
    return d, yaml_key_lines(text)


def _without_excerpt(message: str, where: str) -> str:
    """A YAML error reduced to its kind and position: PyYAML quotes the offending line, which is the file's text."""
    import re
    body = message[len(where) + 2:] if message.startswith(where + ": ") else message
    pos = re.search(r"line (\d+), column (\d+)", body)
    kind = body.split(":", 1)[0] if body.startswith("not valid YAML") else "cannot be read as YAML"
    return kind + (f" at line {pos.group(1)}, column {pos.group(2)}" if pos else "")


def compose(path: str | Path | None, exps: list[str], base: dict | None = None) -> tuple[dict, dict[str, str]]:
    """The config dict of `path` (its defaults chain merged under it; or `base` when there is no file), with the
    +exp files merged over it in order, and the source of every key written in a file. `defaults:` may name files
    under the config's folder (and an exp file's, under its own) and the shipped configs, each expanded once."""
    p = Path(path) if path is not None else None
    top_roots = [p.parent] if p is not None else []
    if p is not None:
        d, where = _Composer(top_roots).file(p)
    else:
        d, where = _copy(dict(base or {})), {}
    for name in exps:
        f = exp_path(name, p)
        layer, layer_where = _Composer(top_roots + [f.parent]).file(f)
        deep_merge(d, layer, where, layer_where)
    return d, where


def note_overrides(where: dict[str, str], overrides: list[str]) -> None:
    """key=value overrides come last: their keys (and what is under them) came from the command line."""
    for o in overrides:
        if "=" not in o:
            continue
        key = o.split("=", 1)[0].strip()
        for old in [w for w in where if w.startswith(key + ".") or w.startswith(key + "[")]:
            del where[old]
        where[key] = COMMAND_LINE


def source_of(where: dict[str, str], key: str) -> str | None:
    """The source of `key`, else of its nearest enclosing key that has one."""
    return nearest_key_value(where, key)


def provenance_lines(resolved: dict, where: dict[str, str], prefix: str = "") -> list[str]:
    """One line per leaf value of the resolved config: `key = value  <- FILE:LINE | command line | default`."""
    out = []
    for k, v in resolved.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and not _leaf_mapping(key):  # a section: its keys one by one
            out += provenance_lines(v, where, key + ".")
            continue
        out.append(f"{key} = {clip(repr(v), 60)}  <- {_value_source(where, key)}")
    return out


def _value_source(where: dict[str, str], key: str) -> str:
    """The key's own source; a section written in a file does not make its unwritten keys the file's (they are the
    defaults), but a whole section given on the command line does."""
    if key in where:
        return where[key]
    enclosing = source_of(where, key)
    return enclosing if enclosing == COMMAND_LINE else "default"


def _leaf_mapping(key: str) -> bool:
    """dict-valued keys that are values (model.tiny, data.arithmetic, ...), not sections: shown as one line."""
    tp = key_type(key.split("."))
    return not (isinstance(tp, type) and dataclasses.is_dataclass(tp))
