"""The guide covers every setting, error and signal the code has (``scripts/test`` builds it)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import idempotency.conf
import idempotency.errors
import leases.conf
import leases.errors
import leases.signals

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide"


def page(name: str) -> str:
    return (GUIDE / name).read_text()


@pytest.mark.parametrize(
    "key", [*leases.conf.DEFAULTS, *(f"IDEMPOTENCY:{k}" for k in idempotency.conf.DEFAULTS)]
)
def test_every_setting_is_documented(key: str) -> None:
    assert f"| `{key.removeprefix('IDEMPOTENCY:')}` |" in page("settings.md")


def _documented_options(engine: str) -> set[str]:
    """The option names in the table under the guide's ``**`engine`**`` heading."""
    section = page("settings.md").split(f"**`{engine}`**", 1)[1].split("\n**`", 1)[0]
    section = section.split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([A-Z_]+)` \|", section, flags=re.MULTILINE))


@pytest.mark.parametrize(
    "engine",
    [
        "leases.backends.database",
        "leases.backends.redis",
        "leases.backends.redlock",
        "leases.backends.etcd",
    ],
)
def test_every_backend_option_is_documented_and_no_other(engine: str) -> None:
    """Unknown options are configuration errors, so a documented one that is gone would
    send readers straight into ``leases.E005``."""
    module = importlib.import_module(engine)
    assert _documented_options(engine) == set(module.Backend.known_options)


@pytest.mark.parametrize("error", [*leases.errors.__all__, *idempotency.errors.__all__])
def test_every_error_is_documented(error: str) -> None:
    assert f"| `{error}` |" in page("errors.md")


SIGNALS = [
    name
    for name in leases.signals.__all__
    if isinstance(getattr(leases.signals, name), leases.signals.Signal)
]


@pytest.mark.parametrize("signal", SIGNALS)
def test_every_signal_is_documented_with_its_arguments(signal: str) -> None:
    assert f"| `{signal}` |" in page("operating.md")


def test_every_system_check_is_documented() -> None:
    root = GUIDE.parent.parent
    sources = [*root.glob("leases/**/*.py"), *root.glob("idempotency/**/*.py")]
    ids = set(re.findall(r'id="((?:leases|idempotency)\.[EW]\d+)"', "".join(map(_read, sources))))
    assert ids, "no system check ids found: has the check module moved?"
    missing = sorted(i for i in ids if f"| `{i}` |" not in page("settings.md"))
    assert not missing, f"system checks missing from docs/guide/settings.md: {missing}"


def _read(path: Path) -> str:
    return path.read_text()


def test_every_page_is_in_the_navigation() -> None:
    config = (GUIDE.parent / "mkdocs.yml").read_text()
    for path in GUIDE.glob("*.md"):
        assert f": {path.name}" in config, f"{path.name} is not in docs/mkdocs.yml's nav"
