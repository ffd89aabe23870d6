"""System checks: ``manage.py check`` reports a broken ``IDEMPOTENCY`` setting (an error) and a
valid one that gives up a guarantee of the idempotency contract (a warning, to silence by id
once the project has decided it is right for it)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Tags, Warning, register

from . import conf, scopes
from .errors import GUIDE_URL


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """idempotency.E001: the IDEMPOTENCY setting is invalid."""
    return [
        Error(message, hint="See the idempotency section of the guide.", id="idempotency.E001")
        for message in conf.problems()
    ]


def _valid_settings() -> conf.IdempotencySettings | None:
    """The setting, or None when it is invalid: E001 reports that, and nothing else is sure."""
    return None if conf.problems() else conf.get()


@register(Tags.security)
def check_anonymous_scope(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """idempotency.W001: a scope setting pools clients into the one shared anonymous key space,
    where a client that sends another's key is replayed that client's response."""
    settings = _valid_settings()
    if settings is None:
        return []
    chosen = {"SCOPE": settings.scope, "ANONYMOUS_SCOPE": settings.anonymous_scope}
    return [
        Warning(
            f'{conf.SETTING_NAME}["{name}"] is idempotency.scopes.anonymous: every client it '
            "applies to shares one key space, so a client that sends another's Idempotency-Key "
            "is replayed that client's response.",
            hint=(
                "Keep it only if every client sends unguessable keys (a random UUID per "
                "operation), and silence idempotency.W001; otherwise identify clients by a "
                "session, a login or a credential header (idempotency.scopes.by_header). See "
                f"{GUIDE_URL}idempotency.html#anonymous-clients"
            ),
            id="idempotency.W001",
        )
        for name, scope in chosen.items()
        if scope is scopes.anonymous
    ]


@register(Tags.compatibility)
def check_atomic(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """idempotency.W002: ATOMIC is off, so the key no longer commits with the view's effects, and
    a request killed after its effects committed is run again by a retry after LOCK_TIMEOUT."""
    settings = _valid_settings()
    if settings is None or settings.atomic:
        return []
    return [
        Warning(
            f'{conf.SETTING_NAME}["ATOMIC"] is False: a view\'s database effects commit before '
            "its key is marked done, so a worker killed in between (or a view that raises or "
            "answers 5xx after writing) leaves effects that the client's retry applies again.",
            hint=(
                "Keep ATOMIC on unless the effects are outside this database anyway; then make "
                "them idempotent on their own (pass the key on) and silence idempotency.W002. "
                f"See {GUIDE_URL}idempotency.html#atomic-mode"
            ),
            id="idempotency.W002",
        )
    ]
