"""Every test the guide names as a proof exists: a renamed or deleted test must not leave the
hazards page pointing at nothing, or the claim it backs stands unproven without anyone noticing."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide"

#: ``tests/file.py`` optionally followed by ``::test_name``, inside backticks.
_FILE_REF = re.compile(r"`tests/([\w/]+\.py)(?:::(\w+))?(?:\[[^\]`]*\])?`")
#: ``::test_name`` alone: a further test of the file named last on the same line.
_MORE_REF = re.compile(r"`::(\w+)(?:\[[^\]`]*\])?`")
#: a bare ``test_name`` in backticks: a test somewhere in ``tests/``.
_BARE_REF = re.compile(r"`(test_\w+)(?:\[[^\]`]*\])?`")


@cache
def _tests_of(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    )


def _every_test() -> frozenset[str]:
    return frozenset().union(*(_tests_of(p) for p in (ROOT / "tests").glob("test_*.py")))


def _references() -> list[tuple[str, str, str | None]]:
    """``(page:line, file or "", test or None)`` for every test the guide cites."""
    found: list[tuple[str, str, str | None]] = []
    for page in sorted(GUIDE.glob("**/*.md")):
        if page.name == "changelog.md":
            continue
        for number, line in enumerate(page.read_text().splitlines(), 1):
            where = f"{page.name}:{number}"
            last_file: str | None = None
            for match in re.finditer(f"{_FILE_REF.pattern}|{_MORE_REF.pattern}", line):
                if match.group(1):
                    last_file = match.group(1)
                    found.append((where, last_file, match.group(2)))
                else:
                    assert last_file, f"{where}: `::{match.group(3)}` follows no test file"
                    found.append((where, last_file, match.group(3)))
            for match in _BARE_REF.finditer(line):
                found.append((where, "", match.group(1)))
    return found


def test_the_guide_cites_tests() -> None:
    """The check below must have something to check (the hazards page cites dozens)."""
    assert len(_references()) > 30


@pytest.mark.parametrize(("where", "file", "test"), _references(), ids=lambda v: str(v)[:60])
def test_every_test_the_guide_cites_exists(where: str, file: str, test: str | None) -> None:
    if not file:
        assert test in _every_test(), f"{where}: no test named {test} in tests/"
        return
    path = ROOT / "tests" / file
    assert path.is_file(), f"{where}: tests/{file} does not exist"
    if test is not None:
        assert test in _tests_of(path), f"{where}: tests/{file} has no {test}"
