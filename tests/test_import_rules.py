"""The import rules of grpo_dist/ (docs/design.md, "Rooms and the rules between them"), read from the source with
ast, imports inside functions included (a lazy import hides a circle from the interpreter, not from the reader).

- No import circle (KNOWN_CIRCLES is empty since issue 38 took the last two apart: the config package and the engine
  registry; a circle listed there would be tolerated until gone, and a listed circle that is gone fails).
- Pure modules (arithmetic and string work tested against written-out formulas) import neither
  torch.distributed nor the config, except the config's leaves (errors, choices), which import nothing of grpo_dist.
- Leaves (LEAVES) import nothing of their package: the modules that every side of a former circle imports.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "grpo_dist"

KNOWN_CIRCLES: list[set[str]] = []  # issue 38 removed the last two (config + rewards + preflight; engines)

# Leaves: modules that import nothing of the package named (what every side of a former circle imports): the config's
# error type and lists of choices (shared by every config check and every module those checks call into) import
# nothing of grpo_dist, and the engines' base class (which every engine imports) nothing of grpo_dist.engines.
LEAVES = {"grpo_dist.config.errors": "grpo_dist", "grpo_dist.config.choices": "grpo_dist",
          "grpo_dist.engines.base": "grpo_dist.engines"}
CONFIG_LEAVES = {"grpo_dist.config.errors", "grpo_dist.config.choices"}

PURE_MODULES = ["grpo_dist.advantages", "grpo_dist.logprobs", "grpo_dist.prompt_sharing", "grpo_dist.compaction",
                "grpo_dist.sampling_noise", "grpo_dist.health", "grpo_dist.rewards.answer_words",
                "grpo_dist.rewards.extract", "grpo_dist.rewards.prose", "grpo_dist.rewards.parser",
                "grpo_dist.rewards.math", "grpo_dist.rewards.format", "grpo_dist.rewards.length",
                "grpo_dist.config.errors", "grpo_dist.config.choices"]


def _modules(package: Path) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported_names(module: str, path: Path, tree: ast.AST) -> list[str]:
    """Every dotted name an import statement of the module names (from-imports: the module and module.name)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


@functools.lru_cache(maxsize=4)
def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name resolves to its longest prefix that is a module)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name in _imported_names(module, path, ast.parse(path.read_text())):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


@pytest.mark.fast
def test_circles_finds_a_loop_and_ignores_a_chain():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.fast
def test_a_lazy_import_inside_a_function_counts(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "one.py").write_text("from pkg.two import f\n")
    (package / "two.py").write_text("def f():\n    from . import one\n    return one\n")
    assert circles(import_graph(package)) == [{"pkg.one", "pkg.two"}]


def _circle_problems(graph: dict[str, set[str]], known: list[set[str]]) -> list[str]:
    found = circles(graph)
    new = [sorted(c) for c in found if not any(c <= k for k in known)]
    gone = [sorted(k) for k in known if not any(c & k for c in found)]
    return ([f"new import circle(s) in grpo_dist/: {new}"] if new else []) + \
        ([f"circle(s) no longer there: remove them from KNOWN_CIRCLES: {gone}"] if gone else [])


@pytest.mark.fast
def test_no_new_import_circle():
    assert not _circle_problems(import_graph(), KNOWN_CIRCLES)


@pytest.mark.fast
@pytest.mark.parametrize("edge", [("grpo_dist.config.errors", "grpo_dist.config"),
                                  ("grpo_dist.rewards.specs", "grpo_dist.config"),
                                  ("grpo_dist.engines.base", "grpo_dist.engines")])
def test_the_circle_rule_fails_once_an_import_closes_a_circle(edge):
    """The rule against the real graph with one import added that closes a circle (the ones issue 38 removed: the
    config's leaf importing the package, the reward specs importing the config, the engines' base importing the
    registry): the rule names it."""
    graph = {m: set(v) for m, v in import_graph().items()}
    graph[edge[0]].add(edge[1])
    problems = _circle_problems(graph, KNOWN_CIRCLES)
    assert len(problems) == 1 and "new import circle" in problems[0] and edge[0] in problems[0], problems


@pytest.mark.fast
@pytest.mark.parametrize("module", sorted(LEAVES))
def test_leaves_import_nothing_of_their_package(module):
    package = LEAVES[module]
    inside = sorted(m for m in import_graph()[module] if m == package or m.startswith(package + "."))
    assert not inside, f"{module} imports {inside}"


@pytest.mark.parametrize("module", ["grpo_dist.config.errors", "grpo_dist.rewards.specs", "grpo_dist.preflight",
                                    "grpo_dist.data"])
def test_a_module_the_config_reaches_imports_first_on_its_own(module):
    """Importing grpo_dist.config.errors runs grpo_dist/config/__init__.py, which imports the whole config: a module
    that the config's checks call into, imported first in a fresh interpreter, must not meet a half-built config
    (the graph above does not see the package __init__ a submodule import runs)."""
    code = f"import {module}\nimport grpo_dist.config as c\nc.GRPOConfig().validate()\n"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent, timeout=120)


@pytest.mark.fast
@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_modules_import_no_distributed_and_no_config(module):
    imported = import_graph()[module]
    path = _modules(PACKAGE)[module]
    names = _imported_names(module, path, ast.parse(path.read_text()))
    assert not [n for n in names if n.startswith("torch.distributed")], f"{module} imports torch.distributed"
    config = [m for m in imported if m == "grpo_dist.config" or m.startswith("grpo_dist.config.")]
    assert not [m for m in config if m not in CONFIG_LEAVES], f"{module} imports the config"
