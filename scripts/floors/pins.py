"""Print the lowest versions pyproject.toml declares, as pins: ``name[extras]==floor``.

``scripts/check-floors`` installs them to run the suite's tests that reach into each library.
A floor is the ``>=`` bound of a requirement of the package (its dependencies and every extra)
and of the ``observability`` group, which holds the extras' libraries for the tests (and the
OpenTelemetry SDK, pinned to the API's floor: the SDK of a release needs that very API). A
requirement without a ``>=`` bound gets no pin. Nothing but the standard library and
``packaging`` (in the project's ``.venv``, which pytest needs), so it runs before the floors'
virtualenv exists.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
#: The dependency groups whose floors are pinned with the package's own.
GROUPS = ("observability",)
#: Libraries pinned to another's floor: a release of each needs its partner's same release.
PARTNERS = {"opentelemetry-sdk": "opentelemetry-api"}


def floor(requirement: Requirement) -> str | None:
    """The version of the requirement's ``>=`` bound, if it has one."""
    bounds = [spec.version for spec in requirement.specifier if spec.operator == ">="]
    return bounds[0] if bounds else None


def declared(pyproject: dict[str, object]) -> Iterator[Requirement]:
    """Every requirement of the package, its extras and :data:`GROUPS`."""
    project = pyproject["project"]
    assert isinstance(project, dict)
    texts: list[str] = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        texts += extra
    groups = pyproject.get("dependency-groups", {})
    assert isinstance(groups, dict)
    for group in GROUPS:
        texts += [text for text in groups[group] if isinstance(text, str)]
    for text in texts:
        yield Requirement(text)


def pins(requirements: Iterable[Requirement]) -> list[str]:
    """One pin per library (the highest floor where several requirements name it)."""
    floors: dict[str, tuple[str, set[str]]] = {}
    for requirement in requirements:
        version = floor(requirement)
        if version is None:
            continue
        name = requirement.name.lower()
        seen, extras = floors.get(name, (version, set()))
        highest = max(seen, version, key=Version)
        floors[name] = (highest, extras | set(requirement.extras))
    for name, partner in PARTNERS.items():
        if name in floors and partner in floors:
            floors[name] = (floors[partner][0], floors[name][1])
    return [
        f"{name}[{','.join(sorted(extras))}]=={version}" if extras else f"{name}=={version}"
        for name, (version, extras) in sorted(floors.items())
    ]


def main() -> int:
    with open(ROOT / "pyproject.toml", "rb") as file:
        pyproject = tomllib.load(file)
    print("\n".join(pins(declared(pyproject))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
