"""The package's imports against docs/development.md's table of tiers ("Which package may import
which"): each package imports only from the tiers below its own, through their faces, and no
modules import each other in a circle; and the sizes it sets (modules, functions). Read from the source
(``ast``), nothing imported."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "substrax"


def tiers() -> dict[str, int]:
    """Each package or root module's tier, from the table under ``<!-- layers`` in docs/development.md."""
    text = (ROOT / "docs" / "development.md").read_text()
    table = text.split("<!-- layers", 1)[1].split("\n\n", 1)[0]
    found = {}
    for row in re.finditer(r"^\| (\d+) \| ([^|]+) \|", table, re.M):
        for name in re.findall(r"`([^`]+)`", row.group(2)):
            found[name] = int(row.group(1))
    return found


def unit_of(path: Path) -> str:
    """The package (``census``) or root module (``demo``, ``__init__``) ``path`` belongs to."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[str]:
    """The substrax modules ``path`` imports (``from substrax._base import scopes`` as
    ``substrax._base.scopes``), at its top or inside a function, under ``TYPE_CHECKING`` too."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "substrax")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "substrax":
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (ROOT / Path(*sub.split("."))).with_suffix(".py").exists() or (
                    ROOT / Path(*sub.split("."))
                ).is_dir()
                yield sub if is_module else node.module


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_package_has_a_tier() -> None:
    table = tiers()
    units = {unit_of(p) for p in SOURCES}
    assert units - set(table) == set(), "add these to docs/development.md's table of tiers"
    assert set(table) - units == set(), "the table names what the package no longer has"


def test_each_package_imports_only_from_the_tiers_below_it() -> None:
    table = tiers()
    wrong = set()
    for path in SOURCES:
        unit = unit_of(path)
        for module in imports(path):
            other = _unit(module)
            if other != unit and table[other] >= table[unit]:
                wrong.add(f"{path.relative_to(ROOT)} imports {module} (tier {table[other]} >= {table[unit]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_package_imports_another_packages_private_module() -> None:
    wrong = set()
    for path in SOURCES:
        unit = unit_of(path)
        for module in imports(path):
            parts = module.split(".")
            private = len(parts) > 2 and parts[2].startswith("_") and parts[1] != unit
            if private:
                wrong.add(f"{path.relative_to(ROOT)} imports {module}: import it from substrax.{parts[1]}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = {module_of(p): {m for m in imports(p) if m != module_of(p)} for p in SOURCES}
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done
    circles = []

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph.get(module, ())):
            if state.get(other) == 1:
                circles.append(" -> ".join([*path[path.index(other) :], other]))
            elif other not in state:
                walk(other, [*path, other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [module])
    assert not circles, "\n".join(circles)


def oversized(paths: list[Path], module_lines: int, function_lines: int) -> list[str]:
    """Each module of ``paths`` over ``module_lines`` lines, and each function over ``function_lines``."""
    wrong = []
    for path in paths:
        text = path.read_text()
        if text.count("\n") > module_lines:
            wrong.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines (split it by concept)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > function_lines:
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    return wrong


def test_no_module_over_400_lines_and_no_function_over_80() -> None:
    """docs/development.md's sizes: a module read top to bottom, a function on one screen."""
    wrong = oversized(SOURCES, 400, 80)
    assert not wrong, "\n".join(wrong)


def test_no_test_or_benchmark_module_over_600_lines_and_no_function_over_80() -> None:
    """The tests and benchmarks held near the library's sizes (docs/development.md), split by what
    they test or measure."""
    paths = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    wrong = oversized(paths, 600, 80)
    assert not wrong, "\n".join(wrong)
