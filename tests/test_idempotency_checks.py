"""``manage.py check`` reports an ``IDEMPOTENCY`` setting that gives up a guarantee, and what
it and the problem responses link to is a section of the guide that exists."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.core.checks import ERROR, WARNING, run_checks
from django.test import override_settings
from markdown.extensions.toc import slugify

from idempotency import errors, scopes
from tests.harness import ROOT

GUIDE = ROOT / "docs" / "guide"


def idempotency_checks() -> list[tuple[str | None, int]]:
    """(id, level) of every idempotency message the registered checks give."""
    return [
        (message.id, message.level)
        for message in run_checks()
        if (message.id or "").startswith("idempotency.")
    ]


def test_the_defaults_give_no_warning() -> None:
    assert idempotency_checks() == []


@pytest.mark.parametrize("key", ["SCOPE", "ANONYMOUS_SCOPE"])
@pytest.mark.parametrize("value", ["idempotency.scopes.anonymous", scopes.anonymous])
def test_opting_into_the_shared_anonymous_key_space_is_warned(key: str, value: Any) -> None:
    with override_settings(IDEMPOTENCY={key: value}):
        assert idempotency_checks() == [("idempotency.W001", WARNING)]


def test_a_scope_that_gives_every_client_an_identity_is_not_warned() -> None:
    with override_settings(IDEMPOTENCY={"SCOPE": scopes.by_header("X-Api-Key")}):
        assert idempotency_checks() == []


def test_an_invalid_setting_is_reported_once_as_an_error_not_also_as_warnings() -> None:
    bad = {"ANONYMOUS_SCOPE": "idempotency.scopes.anonymous", "TTL": -1}
    with override_settings(IDEMPOTENCY=bad):
        assert {check for check, _ in idempotency_checks()} == {"idempotency.E001"}


@pytest.mark.parametrize(
    "bad",
    [
        # NaN and infinity passed the sign checks; the first keyed request then failed inside
        # the view's transaction with the database's DataError ("interval out of range").
        {"TTL": float("inf")},
        {"TTL": float("nan")},
        {"LOCK_TIMEOUT": float("nan")},
        {"LOCK_TIMEOUT": 1e300},
        {"WAIT_TIMEOUT": float("nan")},
        # Stored fine, but an expiry past the year 9999 cannot be read back: the admin's key
        # list answered 500 from then on.
        {"TTL": 10**12},
        # Truncated to 0 bytes: every response refused as too large.
        {"MAX_RESPONSE_BYTES": 0.5},
    ],
)
def test_a_number_no_clock_or_database_can_use_is_an_error(bad: dict[str, Any]) -> None:
    with override_settings(IDEMPOTENCY=bad):
        assert idempotency_checks() == [("idempotency.E001", ERROR)]


def test_turning_atomic_mode_off_is_warned() -> None:
    """Without it a request killed after its effects committed is run again by the retry."""
    with override_settings(IDEMPOTENCY={"ATOMIC": False}):
        assert idempotency_checks() == [("idempotency.W002", WARNING)]
    with override_settings(IDEMPOTENCY={"ATOMIC": True}):
        assert idempotency_checks() == []


def assert_guide_section(url: str) -> None:
    """``url`` is a page of the published guide and an anchor mkdocs makes for one of its
    headings: what a developer following a client's bug report or a warning must land on."""
    assert url.startswith(errors.GUIDE_URL), url
    page, _, anchor = url.removeprefix(errors.GUIDE_URL).partition("#")
    text = (GUIDE / page.replace(".html", ".md")).read_text()
    headings = re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
    assert anchor in {slugify(heading, "-") for heading in headings}, url


@pytest.mark.parametrize(
    "error", [e for e in vars(errors).values() if getattr(e, "problem_type", None)]
)
def test_a_problem_type_is_a_section_of_the_guide(error: type[errors.IdempotencyError]) -> None:
    assert_guide_section(str(error.problem_type))


@pytest.mark.parametrize(
    "setting", [{"ANONYMOUS_SCOPE": "idempotency.scopes.anonymous"}, {"ATOMIC": False}]
)
def test_a_warning_links_to_a_section_of_the_guide(setting: dict[str, Any]) -> None:
    with override_settings(IDEMPOTENCY=setting):
        (warning,) = [m for m in run_checks() if (m.id or "").startswith("idempotency.")]
    (url,) = re.findall(r"https://\S+", warning.hint or "")
    assert_guide_section(url)
