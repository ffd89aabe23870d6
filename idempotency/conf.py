"""The ``IDEMPOTENCY`` setting, read in one place.

Read lazily and re-read when Django's ``setting_changed`` fires, so ``override_settings`` works.
:func:`problems` lists what is wrong (``manage.py check`` reports it as ``idempotency.E001``);
using a broken setting at run time raises
:class:`~idempotency.errors.IdempotencyImproperlyConfigured` with the same message.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

from django.apps import apps
from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

from leases.conf import MAX_TTL_LIMIT

from .errors import IdempotencyImproperlyConfigured

__all__ = ["IdempotencySettings", "ScopeFunction", "get", "problems", "resolve_scope"]

SETTING_NAME = "IDEMPOTENCY"
ON_CONFLICT_CHOICES = ("409", "wait")

ScopeFunction = Callable[[Any], str]

DEFAULTS: dict[str, Any] = {
    # Seconds a completed key (and its stored response) is kept and replayed.
    "TTL": 86400,
    # Whether guarded requests without an Idempotency-Key header are refused with 400.
    "REQUIRED": False,
    # Methods guarded by default; others pass through untouched.
    "METHODS": ["POST", "PATCH"],
    # Scope of a key: a callable (or dotted path) request -> str. One scope never sees another's.
    "SCOPE": "idempotency.scopes.by_user",
    # What idempotency.scopes.by_user falls back to for anonymous requests. by_session refuses a
    # client with no session (400); idempotency.scopes.anonymous shares one key space among them
    # (unguessable keys only; idempotency.W001).
    "ANONYMOUS_SCOPE": "idempotency.scopes.by_session",
    # Seconds a started key stays locked; after that a retry may take a crashed request's key.
    "LOCK_TIMEOUT": 60,
    # "409" answers a duplicate of a running request at once; "wait" waits up to WAIT_TIMEOUT.
    "ON_CONFLICT": "409",
    "WAIT_TIMEOUT": 10,
    # Atomic mode: the key, the stored response and the view's database effects commit together.
    # Off, the effects commit as the view makes them and the key is marked done afterwards: a
    # worker killed in between leaves a started key whose retry, after LOCK_TIMEOUT, applies the
    # effects again (as does a retry after the view raised or answered 5xx). idempotency.W002.
    "ATOMIC": True,
    # In atomic mode, claim a key inside the view's transaction (an advisory lock) instead of
    # committing a started row before the view runs: one commit per request instead of two, and
    # a crashed request leaves nothing to wait for; but a request that hangs keeps its key
    # until it ends (no take-over after LOCK_TIMEOUT). See the guide's "Atomic mode". Inside a
    # transaction that is already open (ATOMIC_REQUESTS) an atomic attempt always claims so,
    # unless its own option says otherwise.
    "CLAIM_IN_TRANSACTION": False,
    # Answers never stored, besides every status >= 500: refusals of a request that never ran or
    # failed for a passing reason (unauthenticated, forbidden, timed out, too early, throttled).
    # Stored, they would refuse the key's retries for the whole TTL; in atomic mode the view's
    # effects roll back with them, as for a 5xx.
    "NOT_STORED_STATUSES": [401, 403, 408, 425, 429],
    # Larger responses are refused (and rolled back) instead of being stored in part.
    "MAX_RESPONSE_BYTES": 1024 * 1024,
    # The database alias holding the keys (and, in atomic mode, the view's transaction).
    "DATABASE": "default",
    # Send the key store's statements as prepared statements (parsed and planned once per
    # connection): a replay then costs less than the view. False behind a pooler in transaction
    # mode that loses SQL-level prepared statements between transactions.
    "PREPARED_STATEMENTS": True,
    # The request header holding the key, and the response header marking a replay (names of
    # other libraries' headers, e.g. "X-Idempotency-Key", keep their clients working).
    "HEADER": "Idempotency-Key",
    "REPLAYED_HEADER": "Idempotent-Replayed",
    # idempotency.middleware.IdempotencyMiddleware guards requests whose path matches one of
    # these regular expressions (from the path's start, as re_path) and whose method is one of
    # MIDDLEWARE_METHODS, without decorating each view. The other settings apply as they do to
    # @idempotent.
    "MIDDLEWARE_PATHS": [],
    "MIDDLEWARE_METHODS": ["POST", "PUT", "PATCH", "DELETE"],
}

_POSITIVE = ("TTL", "LOCK_TIMEOUT", "MAX_RESPONSE_BYTES")
_NON_NEGATIVE = ("WAIT_TIMEOUT",)
_BYTES = ("MAX_RESPONSE_BYTES",)
_BOOLEANS = ("REQUIRED", "ATOMIC", "CLAIM_IN_TRANSACTION", "PREPARED_STATEMENTS")
_HEADERS = ("HEADER", "REPLAYED_HEADER")
# RFC 9110 field names: a token.
_FIELD_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_SCOPES = ("SCOPE", "ANONYMOUS_SCOPE")


@dataclass(frozen=True)
class IdempotencySettings:
    """The validated setting. ``atomic`` is what makes a retry after a crash safe: with it, a
    killed request's effects roll back with its transaction, so the retry that takes over its
    key after ``lock_timeout`` runs the view once in all; without it the effects have already
    committed and the retry applies them a second time (``manage.py check`` warns, W002)."""

    ttl: float
    required: bool
    methods: frozenset[str]
    scope: ScopeFunction
    anonymous_scope: ScopeFunction
    lock_timeout: float
    on_conflict: str
    wait_timeout: float
    atomic: bool
    max_response_bytes: int
    database: str
    not_stored_statuses: frozenset[int]
    prepared_statements: bool = True
    header: str = "Idempotency-Key"
    replayed_header: str = "Idempotent-Replayed"
    middleware_paths: tuple[re.Pattern[str], ...] = ()
    middleware_methods: frozenset[str] = frozenset()
    claim_in_transaction: bool = False

    @cached_property
    def header_meta_key(self) -> str:
        """Where Django's ``request.META`` keeps the key header (``HTTP_IDEMPOTENCY_KEY``)."""
        return "HTTP_" + self.header.upper().replace("-", "_")

    def stores(self, status: int) -> bool:
        """Whether a response with this status is kept for replay: not a 5xx (a failure the
        retry should not inherit) and not one of ``NOT_STORED_STATUSES`` (the request never
        ran)."""
        return status < 500 and status not in self.not_stored_statuses


def _raw() -> dict[str, Any]:
    value = getattr(django_settings, SETTING_NAME, {})
    if not isinstance(value, dict):
        raise IdempotencyImproperlyConfigured(f"{SETTING_NAME} must be a dict, not {type(value)}")
    return value


def resolve_scope(value: object) -> ScopeFunction:
    """A scope callable from a callable or a dotted path; raises ImproperlyConfigured if neither."""
    if isinstance(value, str):
        try:
            value = import_string(value)
        except ImportError as exc:
            raise IdempotencyImproperlyConfigured(f"cannot import scope {value!r}: {exc}") from exc
    if not callable(value):
        raise IdempotencyImproperlyConfigured(f"a scope must be a callable, not {value!r}")
    return value


def seconds_problem(value: object, *, positive: bool) -> str | None:
    """Why ``value`` is no usable number of seconds, or ``None``: it must be finite (NaN passes
    every comparison) and at most ten years, so every expiry written is a date PostgreSQL and
    Python can both read back (a key expiring past the year 9999 breaks every later read of it).
    Shared by the setting and the per-view / per-operation options."""
    kind = "positive" if positive else "non-negative"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"must be a finite {kind} number, not {value!r}"
    if not 0 <= value < math.inf or (positive and value == 0):
        return f"must be a finite {kind} number, not {value!r}"
    if value > MAX_TTL_LIMIT:
        return f"must be at most {MAX_TTL_LIMIT:g} seconds (ten years), not {value!r}"
    return None


def check_seconds(name: str, value: object, *, positive: bool, optional: bool = True) -> None:
    """Raise for an option of seconds that :func:`seconds_problem` refuses (``None``: unset,
    when ``optional``: the options a setting stands behind; one with no setting, such as an
    operation's ``wait``, has no meaning for ``None``)."""
    problem = None if value is None and optional else seconds_problem(value, positive=positive)
    if problem is not None:
        raise IdempotencyImproperlyConfigured(f"{name} {problem}")


def check_flag(name: str, value: object, *, optional: bool = False) -> None:
    """Raise for an option that must be ``True`` or ``False`` (or ``None`` when ``optional``):
    a truthy string such as ``"no"`` would otherwise be taken at its truth value."""
    if type(value) is bool or (optional and value is None):
        return
    allowed = "True, False or None" if optional else "True or False"
    raise IdempotencyImproperlyConfigured(f"{name} must be {allowed}, not {value!r}")


def check_count(name: str, value: object) -> None:
    """Raise for a count (of retries) that is not an int >= 0: ``"3"`` fails the first
    comparison with it, in a worker, after the first retry was already decided."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise IdempotencyImproperlyConfigured(f"{name} must be an int >= 0, not {value!r}")


def _number_problems(raw: dict[str, Any]) -> list[str]:
    found = []
    for key in _POSITIVE + _NON_NEGATIVE:
        value = raw.get(key, DEFAULTS[key])
        if key in _BYTES:
            bad = isinstance(value, bool) or not isinstance(value, int) or value <= 0
            problem = f"must be a positive whole number of bytes, not {value!r}" if bad else None
        else:
            problem = seconds_problem(value, positive=key in _POSITIVE)
        if problem is not None:
            found.append(f'{SETTING_NAME}["{key}"] {problem}')
    return found


def _statuses_problems(raw: dict[str, Any]) -> list[str]:
    value = raw.get("NOT_STORED_STATUSES", DEFAULTS["NOT_STORED_STATUSES"])
    valid = isinstance(value, list | tuple | set | frozenset) and all(
        isinstance(status, int) and not isinstance(status, bool) and 100 <= status <= 599
        for status in value
    )
    if valid:
        return []
    return [
        f'{SETTING_NAME}["NOT_STORED_STATUSES"] must be a list of HTTP statuses (100-599), '
        f"not {value!r}"
    ]


def _method_list_problem(raw: dict[str, Any], key: str) -> list[str]:
    methods = raw.get(key, DEFAULTS[key])
    if (
        not isinstance(methods, list | tuple)
        or not methods
        or not all(isinstance(m, str) for m in methods)
    ):
        return [f'{SETTING_NAME}["{key}"] must be a non-empty list of method names']
    return []


def _http_problems(raw: dict[str, Any]) -> list[str]:
    """Header names and the middleware's path patterns."""
    found = [
        f'{SETTING_NAME}["{key}"] must be an HTTP header name, not {raw[key]!r}'
        for key in _HEADERS
        if key in raw and not (isinstance(raw[key], str) and _FIELD_NAME.fullmatch(raw[key]))
    ]
    paths = raw.get("MIDDLEWARE_PATHS", DEFAULTS["MIDDLEWARE_PATHS"])
    if not isinstance(paths, list | tuple) or not all(isinstance(p, str) for p in paths):
        found.append(f'{SETTING_NAME}["MIDDLEWARE_PATHS"] must be a list of regular expressions')
    else:
        for pattern in paths:
            try:
                re.compile(pattern)
            except re.error as exc:
                found.append(f'{SETTING_NAME}["MIDDLEWARE_PATHS"]: {pattern!r}: {exc}')
                continue
            first = pattern.removeprefix("^")[:1]
            if first.isalnum() or first in ("_", "-"):
                found.append(
                    f'{SETTING_NAME}["MIDDLEWARE_PATHS"]: {pattern!r} never matches: it is '
                    "matched from the start of the path, which begins with '/' (unlike a "
                    f"re_path pattern): write {'^/' + pattern.removeprefix('^')!r}"
                )
    return found + _method_list_problem(raw, "MIDDLEWARE_METHODS")


def problems() -> list[str]:
    """Every problem with the current setting, as messages (empty when it is valid)."""
    try:
        raw = _raw()
    except IdempotencyImproperlyConfigured as exc:
        return [str(exc)]
    found = [
        f"{SETTING_NAME} has an unknown key {key!r} (known: {', '.join(sorted(DEFAULTS))})"
        for key in raw
        if key not in DEFAULTS
    ]
    found += _number_problems(raw)
    found += _statuses_problems(raw)
    found += [
        f'{SETTING_NAME}["{key}"] must be True or False'
        for key in _BOOLEANS
        if not isinstance(raw.get(key, DEFAULTS[key]), bool)
    ]
    found += _method_list_problem(raw, "METHODS")
    found += _http_problems(raw)
    if raw.get("ON_CONFLICT", "409") not in ON_CONFLICT_CHOICES:
        found.append(f'{SETTING_NAME}["ON_CONFLICT"] must be one of {ON_CONFLICT_CHOICES}')
    if not isinstance(raw.get("DATABASE", "default"), str):
        found.append(f'{SETTING_NAME}["DATABASE"] must be a database alias')
    elif raw.get("DATABASE", "default") not in django_settings.DATABASES:
        found.append(f'{SETTING_NAME}["DATABASE"] names no alias of DATABASES')
    for key in _SCOPES:
        try:
            resolve_scope(raw.get(key, DEFAULTS[key]))
        except IdempotencyImproperlyConfigured as exc:
            found.append(f'{SETTING_NAME}["{key}"]: {exc}')
    return found


@cache
def get() -> IdempotencySettings:
    """The validated setting; cached until Django reports the setting changed.

    Also refuses to run without the app installed: then no system check reports a bad setting
    and ``migrate`` makes no key table, so the first keyed request would fail in the database.
    """
    if not apps.is_installed("idempotency"):
        raise IdempotencyImproperlyConfigured(
            '"idempotency" is not in INSTALLED_APPS: add it and run migrate (its migrations '
            "make the key table), as the quick start says"
        )
    found = problems()
    if found:
        raise IdempotencyImproperlyConfigured("; ".join(found))
    raw = {**DEFAULTS, **_raw()}
    return IdempotencySettings(
        ttl=float(raw["TTL"]),
        required=raw["REQUIRED"],
        methods=frozenset(m.upper() for m in raw["METHODS"]),
        scope=resolve_scope(raw["SCOPE"]),
        anonymous_scope=resolve_scope(raw["ANONYMOUS_SCOPE"]),
        lock_timeout=float(raw["LOCK_TIMEOUT"]),
        on_conflict=raw["ON_CONFLICT"],
        wait_timeout=float(raw["WAIT_TIMEOUT"]),
        atomic=raw["ATOMIC"],
        max_response_bytes=int(raw["MAX_RESPONSE_BYTES"]),
        database=raw["DATABASE"],
        not_stored_statuses=frozenset(raw["NOT_STORED_STATUSES"]),
        prepared_statements=raw["PREPARED_STATEMENTS"],
        header=raw["HEADER"],
        replayed_header=raw["REPLAYED_HEADER"],
        middleware_paths=tuple(re.compile(p) for p in raw["MIDDLEWARE_PATHS"]),
        middleware_methods=frozenset(m.upper() for m in raw["MIDDLEWARE_METHODS"]),
        claim_in_transaction=raw["CLAIM_IN_TRANSACTION"],
    )


@receiver(setting_changed)
def _setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in (SETTING_NAME, "DATABASES", "INSTALLED_APPS"):
        get.cache_clear()
