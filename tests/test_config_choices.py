"""One source for each list of choices (grpo_dist/config/choices.py): the schema's fields take their choices from it,
no module of grpo_dist writes one of those lists out again, and the tables that implement each choice (dtypes,
presets, health conditions, ...) have exactly its values as keys."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import grpo_dist.config.choices as C
from grpo_dist.config import GRPOConfig

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_dist"
LISTS = {k: v for k, v in vars(C).items() if k.isupper() and isinstance(v, tuple) and len(v) >= 2}

# Copies left where they are on purpose, with why: (file under grpo_dist/, name in choices.py).
LEFT: set[tuple[str, str]] = set()  # (file, list name) of a copy allowed to stay: none


def _fields(obj, prefix=""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _fields(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f


@pytest.mark.fast
def test_every_field_with_choices_takes_them_from_choices_py():
    with_choices = {key: f.metadata["choices"] for key, f in _fields(GRPOConfig()) if "choices" in f.metadata}
    assert len(with_choices) >= 20, sorted(with_choices)
    strays = {key: ch for key, ch in with_choices.items() if not any(ch is v for v in LISTS.values())}
    assert not strays, f"choices written in the schema instead of grpo_dist/config/choices.py: {strays}"


def _copies(package: Path = PACKAGE):
    """(file, line, name) of every tuple / list / set literal in grpo_dist/ whose strings are one of the lists."""
    out = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "choices.py" and path.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and \
                    all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                values = {e.value for e in node.elts}  # type: ignore[attr-defined]
                out += [(str(path.relative_to(package)), node.lineno, name) for name, v in LISTS.items()
                        if values == set(v)]
    return out


@pytest.mark.fast
def test_no_module_writes_a_list_of_choices_out_again():
    copies = [c for c in _copies() if (c[0], c[2]) not in LEFT]
    assert not copies, f"use grpo_dist.config.choices instead of these copies: {copies}"


@pytest.mark.fast
def test_the_copy_finder_finds_a_copy(tmp_path):
    (tmp_path / "mod.py").write_text('if x not in ("k3", "k2", "k1"):\n    pass\n')
    assert _copies(tmp_path) == [("mod.py", 1, "KL_ESTIMATORS")]


@pytest.mark.fast
def test_the_tables_of_each_choice_have_exactly_its_values():
    from grpo_dist import health, losses
    from grpo_dist.data.presets import PRESETS
    assert set(PRESETS) == set(C.DATA_PRESETS)
    assert set(health.CONDITIONS) == set(C.HEALTH_CONDITIONS)
    assert losses.LOSS_TYPES is C.LOSS_TYPES and losses.KL_ESTIMATORS is C.KL_ESTIMATORS


def test_the_model_tables_have_exactly_the_choices():  # imports transformers: not the fast tier
    from grpo_dist import models
    assert set(models.DTYPES) == set(C.DTYPES)
    assert set(models.MIXED_PRECISION_DTYPES) == set(C.MIXED_PRECISIONS)
