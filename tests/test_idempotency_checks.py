"""``manage.py check`` reports an ``IDEMPOTENCY`` setting that gives up a guarantee."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.checks import WARNING, run_checks
from django.test import override_settings

from idempotency import scopes


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
