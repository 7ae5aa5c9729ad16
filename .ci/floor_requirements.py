"""Print the requirements of the floor environment: every dependency at its oldest allowed version.

Reads ``pyproject.toml``: each ``[project] dependencies`` entry ``name>=X`` (with or without
more specifiers after it, such as ``!=Y``) becomes ``name==X`` (an entry without a ``>=`` floor is kept as written), so a dependency added
there is tested at its floor without editing this file. The test runner comes from the
``dev`` extra as written there (only ``pytest``, ``pytest-xdist`` and ``hypothesis``: the
library tests need nothing else).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

TEST_TOOLS = ("pytest", "pytest-xdist", "hypothesis")
FLOOR = re.compile(r"^\s*([A-Za-z0-9_.\-]+(?:\[[^\]]*\])?)\s*>=\s*([^,;\s]+)\s*(?:,[^;]*)?(;.*)?$")


def at_floor(requirement: str) -> str:
    """``name>=X`` as ``name==X``; any other requirement as it is."""
    match = FLOOR.match(requirement)
    if match is None:
        return requirement
    name, version, marker = match.groups()
    return f"{name}=={version}{marker or ''}"


def main(pyproject: Path) -> None:
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = [at_floor(r) for r in project["dependencies"]]
    for requirement in project.get("optional-dependencies", {}).get("dev", []):
        name = re.split(r"[\s<>=!~\[;]", requirement, maxsplit=1)[0]
        if name in TEST_TOOLS:
            lines.append(requirement)
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"))
