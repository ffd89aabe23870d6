"""Scope functions: whose key space a request's Idempotency-Key lives in.

A key is unique per scope, so the scope is what keeps one client from replaying another's
response. Secrets that identify a client (session keys, API keys) are hashed before they become a
scope: the key table is visible in the admin and must not become a list of live credentials.

A client with no identity at all (no user, no session) has no scope: the default chain
(``by_user`` -> ``by_session``) raises :class:`~idempotency.errors.IdempotencyClientUnidentified`
(a 400) instead of putting every such client in one key space, where two of them choosing the
same key would get each other's response. :func:`anonymous` is that shared key space, for
projects whose clients all send unguessable keys; choosing it is explicit and ``manage.py check``
reports it (``idempotency.W001``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from . import conf
from .errors import IdempotencyClientUnidentified

__all__ = ["ANONYMOUS", "anonymous", "by_header", "by_session", "by_user"]

ANONYMOUS = "anonymous"


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()[:40]


def by_user(request: Any) -> str:
    """``user:<pk>`` for an authenticated user, else the ``ANONYMOUS_SCOPE`` setting's answer."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    return conf.get().anonymous_scope(request)


def by_session(request: Any) -> str:
    """The (hashed) session key; a client without a session is refused, never pooled.

    Django gives a client a session key only once its session was saved (a login, or a view that
    stored something in it), so a first anonymous visit has none.
    """
    session = getattr(request, "session", None)
    session_key = getattr(session, "session_key", None)
    if not session_key:
        raise IdempotencyClientUnidentified()
    return f"session:{_digest(session_key)}"


def anonymous(request: Any) -> str:
    """One scope shared by every client that uses it: safe only when every key is unguessable
    (e.g. a random UUID per operation), since a client that sends another's key gets its
    response. An explicit opt-in, reported by ``idempotency.W001``."""
    return ANONYMOUS


def by_header(name: str) -> Callable[[Any], str]:
    """A scope function keyed by a (hashed) request header, e.g. an API key header."""
    meta_key = "HTTP_" + name.upper().replace("-", "_")

    def scope(request: Any) -> str:
        value = request.META.get(meta_key)
        return f"header:{name.lower()}:{_digest(value)}" if value else by_user(request)

    scope.__name__ = f"by_header_{name.lower().replace('-', '_')}"
    return scope
