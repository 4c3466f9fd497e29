"""Reading config YAML: load_yaml bounds a text (nesting depth, values once aliases are expanded) before PyYAML
builds it, and yaml_key_lines says on which line each dotted key is written, so that a problem can name FILE:LINE."""

from __future__ import annotations

from typing import Any

import yaml

from grpo_dist.config.errors import ConfigError, nearest_key_value


# A config is a few hundred YAML values nested about 4 deep. These bounds are far above any real one, and keep a
# hostile file from becoming a RecursionError (PyYAML composes nested collections recursively: 100000 '[') or
# gigabytes of values ("billion laughs": 9 aliases of 9 aliases of ... expand exponentially, while the file stays
# a few hundred bytes). Aliases count as the values they expand to.
YAML_MAX_DEPTH = 100
YAML_MAX_VALUES = 100_000


def load_yaml(text: str, where: str) -> Any:
    """yaml.safe_load of a config text (a file, a command-line value, a DeepSpeed config), refusing nesting deeper
    than YAML_MAX_DEPTH and more than YAML_MAX_VALUES values once aliases are expanded. Raises one ConfigError line
    naming `where` for those and for invalid YAML."""
    try:
        _check_yaml_size(text, where)
        return yaml.safe_load(text)
    except ConfigError:
        raise
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    except (ValueError, RecursionError) as e:  # e.g. an integer of over 4300 digits
        raise ConfigError(f"{where}: YAML value cannot be read: {type(e).__name__}: {e}") from None


def _check_yaml_size(text: str, where: str) -> None:
    """Walk the parser's events (PyYAML's parser is not recursive, its composer is) counting depth and values,
    before anything is built."""
    sizes: dict[str, int] = {}   # anchor -> values its node expands to
    open_at: list[tuple[Any, int]] = []  # open collections: (anchor, running total when opened)
    total = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            total += sizes.get(event.anchor, 1)
        elif isinstance(event, yaml.ScalarEvent):
            total += 1
            if event.anchor:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.CollectionStartEvent):
            total += 1
            open_at.append((event.anchor, total - 1))
            if len(open_at) > YAML_MAX_DEPTH:
                raise ConfigError(f"{where}: YAML nested more than {YAML_MAX_DEPTH} levels deep (line "
                                  f"{event.start_mark.line + 1}); a config needs a handful")
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start = open_at.pop()
            if anchor:
                sizes[anchor] = total - start
        if total > YAML_MAX_VALUES:
            raise ConfigError(f"{where}: YAML expands to more than {YAML_MAX_VALUES} values (line "
                              f"{event.start_mark.line + 1}; anchors and aliases count as what they repeat); a "
                              f"config holds a few hundred")



def yaml_key_lines(text: str) -> dict[str, int]:
    """Dotted key (items of lists as key[i]) -> the 1-based line where it is written in a YAML text; {} when the
    text does not compose."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}
    out: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = f"{prefix}{k.value}"
                out.setdefault(key, k.start_mark.line + 1)
                walk(v, key + ".")
        elif isinstance(node, yaml.SequenceNode):
            base = prefix[:-1]
            for i, item in enumerate(node.value):
                out.setdefault(f"{base}[{i}]", item.start_mark.line + 1)
                walk(item, f"{base}[{i}].")
    walk(root, "")
    return out


def key_line(lines: dict[str, int], key: str) -> int | None:
    """The line of `key`, else of its nearest enclosing key that is written in the file."""
    return nearest_key_value(lines, key)
