"""mkdocs hook: serve a few files from outside docs/ (the examples, the benchmark results), read where they are.

The guides link to ``examples/*.py`` and ``benchmarks/results/*.{txt,png}``; they are added
to the site as they are in the repository (no copy under docs/), at the same paths.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
MOUNTED = {"examples": ("*.py",), "benchmarks/results": ("*.txt", "*.png")}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for folder, patterns in MOUNTED.items():
        for pattern in patterns:
            for path in sorted((ROOT / folder).glob(pattern)):
                files.append(File.generated(config, f"{folder}/{path.name}", abs_src_path=str(path)))
    return files
