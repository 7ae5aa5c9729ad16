"""The documentation's code runs: README.md's and docs/'s Python blocks, the API's ``>>>`` examples.

Pages: every fenced ```` ```python ```` block of ``README.md`` and ``docs/**/*.md`` runs, in
page order, in one namespace per page (a page reads as one session), on the 8 emulated
CPU devices ``conftest.py`` sets up, in a temporary working directory. A line
``--8<-- "name"`` inside a block (pymdownx.snippets, as the site renders it) stands for
the file ``docs/snippets/name``. A block that cannot run here (a cluster, several
processes, a shell's environment) is preceded by ``<!-- not run: REASON -->``, and the
reason names where that code is tested instead.

Docstrings: every ``>>>`` example in the docstrings of the public API (``substrax`` and each
of its modules without a leading underscore: ``substrax.spmd``, ``substrax.explicit``,
``substrax.checkpoint``, ``substrax.launch``, ``substrax.mesh``, ...; the modules
themselves, each name in their ``__all__`` and its methods) runs as a doctest. An example
may use the names ``docs/snippets/setup.py`` defines (``model``, ``optimizer``, ``loss_fn``,
``batch``, ``mesh``, ``jax``, ``jnp``, ``np``, ``optax``, ``nnx``, ``substrax``): a small
MLP, its Adam optimizer, its loss and a batch of 64 rows.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.metadata
import inspect
import linecache
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<info>[^\n`]*)$")
_SNIPPET = re.compile(r'^(?P<indent>[ \t]*)--8<--\s+"(?P<name>[^"]+)"\s*$')
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->$")
# a block that needs a newer release than pyproject's floor: run where it is installed (make test),
# skipped at the floor (make test-floor)
_NEEDS = re.compile(r"^<!--\s*needs (?P<package>[\w-]+) >= (?P<version>[\d.]+)\b.*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced Python block: where it starts (1-based line of its first code line) and its code."""

    page: Path
    line: int
    code: str
    not_run: str | None
    needs: tuple[str, str] | None = None

    def runnable(self) -> bool:
        """Not marked 'not run', and what it needs installed (``<!-- needs optax >= 0.2.8 ... -->``)."""
        if self.not_run is not None:
            return False
        if self.needs is None:
            return True
        package, version = self.needs
        have = tuple(int(x) for x in re.findall(r"\d+", importlib.metadata.version(package))[:3])
        return have >= tuple(int(x) for x in version.split("."))


def _expand(code: str) -> str:
    out = []
    for line in code.splitlines():
        m = _SNIPPET.match(line)
        if m is None:
            out.append(line)
            continue
        text = (SNIPPETS / m["name"]).read_text()
        out.extend(m["indent"] + t for t in text.splitlines())
    return "\n".join(out) + "\n"


def blocks(page: Path) -> list[Block]:
    """The page's ```python blocks, each dedented by its fence's indentation."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, language = m["indent"], m["info"].strip().split(" ")[0]
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if language == "python":
            previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            reason, needs = _NOT_RUN.match(previous), _NEEDS.match(previous)
            body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
            found.append(Block(
                page, i + 2, _expand("\n".join(body)), reason["reason"] if reason else None,
                (needs["package"], needs["version"]) if needs else None,
            ))  # fmt: skip
        i = end + 1
    return found


def _run(block: Block, namespace: dict[str, Any]) -> None:
    name = f"{block.page.relative_to(ROOT)}:{block.line}"
    # blank lines first, so a traceback's line numbers are the page's own
    source = "\n" * (block.line - 1) + block.code
    filename = f"<{block.page.relative_to(ROOT)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102  (running the docs is the point)
    except Exception as e:
        raise AssertionError(f"the Python block at {name} failed: {type(e).__name__}: {e}") from e


def run_blocks(found: list[Block], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run ``found`` in order in one namespace from the repository's root (a page may load
    ``examples/``): the namespace they leave (tests/test_tpu_guide.py, tests/test_gpu_guide.py)."""
    monkeypatch.chdir(ROOT)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    for block in found:
        _run(block, namespace)
    return namespace


PAGES_WITH_CODE = [p for p in PAGES if blocks(p)]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_of_the_page_runs(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    ran = 0
    for block in blocks(page):
        if block.runnable():
            _run(block, namespace)
            ran += 1
    assert ran, f"{page.relative_to(ROOT)}: every Python block is marked 'not run'"


def test_the_home_page_and_the_readme_list_every_guide() -> None:
    # regression (#51): docs/index.md's table left the planning guide out
    guides = sorted(p.name for p in (DOCS / "guides").glob("*.md"))
    for page, prefix in ((DOCS / "index.md", "guides/"), (ROOT / "README.md", "docs/guides/")):
        row = rf"^\| \[[^]]+\]\({re.escape(prefix)}([\w-]+\.md)\) \|"
        listed = set(re.findall(row, page.read_text(), re.M))
        assert listed == set(guides), f"{page.name}: missing {sorted(set(guides) - listed)}"


def test_the_pages_are_found_and_blocks_not_run_say_why() -> None:
    names = {str(p.relative_to(ROOT)) for p in PAGES_WITH_CODE}
    assert {"README.md", "docs/index.md", "docs/guides/modes.md"} <= names
    for page in PAGES:
        for block in blocks(page):
            if block.not_run is not None:
                assert "test" in block.not_run or "make" in block.not_run, (
                    f"{page.relative_to(ROOT)}:{block.line}: a block not run here names where it is "
                    f"tested instead: {block.not_run!r}"
                )


def test_every_snippet_a_page_names_exists() -> None:
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            m = _SNIPPET.match(line)
            if m is not None:
                assert (SNIPPETS / m["name"]).is_file(), (
                    f"{page.relative_to(ROOT)}:{n}: no docs/snippets/{m['name']}"
                )


def public_modules() -> list[str]:
    """``substrax`` and each of its modules and packages whose name has no leading underscore."""
    import substrax

    names = [m.name for m in pkgutil.iter_modules(substrax.__path__) if not m.name.startswith("_")]
    return ["substrax", *(f"substrax.{n}" for n in sorted(names))]


def _docstring_tests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder()
    found: dict[tuple[str | None, int | None, str], doctest.DocTest] = {}
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        objects: list[tuple[str, Any]] = [(module_name, module)]
        objects += [
            (f"{module_name}.{name}", getattr(module, name))
            for name in getattr(module, "__all__", ())
            if not inspect.ismodule(getattr(module, name))
        ]
        for name, obj in objects:
            owner = inspect.getmodule(obj) if not inspect.ismodule(obj) else obj
            for test in finder.find(obj, name, module=owner):
                if test.examples:
                    found.setdefault((test.filename, test.lineno, test.docstring or ""), test)
    return sorted(found.values(), key=lambda t: t.name)


DOCSTRING_TESTS = _docstring_tests()


def test_the_docstring_examples_are_found() -> None:
    assert {"substrax.spmd", "substrax.explicit", "substrax.checkpoint", "substrax.launch"} <= set(
        public_modules()
    )
    assert "substrax.spmd.spmd_train_step" in {t.name for t in DOCSTRING_TESTS}


@pytest.mark.parametrize("test", DOCSTRING_TESTS, ids=lambda t: t.name)
def test_every_docstring_example_runs(test: doctest.DocTest) -> None:
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    exec(compile(_expand('--8<-- "setup.py"'), "<docs/snippets/setup.py>", "exec"), namespace)  # noqa: S102
    test.globs = {**test.globs, **namespace}
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
