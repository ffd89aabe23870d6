"""The HTTP edge: the Idempotency-Key header, response capture and replay.

Request fingerprints live in :mod:`idempotency.fingerprint` (re-exported here).

Nothing here touches the database; :mod:`idempotency.store` never sees a request or response.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse

from . import conf, sfv
from .errors import (
    GUIDE_URL,
    IdempotencyError,
    IdempotencyKeyInProgress,
    IdempotencyKeyInvalid,
    IdempotencyKeyMultiple,
    ResponseNotStorable,
)
from .fingerprint import default_fingerprint, digest, fingerprints
from .store import Outcome

__all__ = [
    "HEADER",
    "MAX_KEY_LENGTH",
    "PROBLEM_TYPE_BASE",
    "REPLAYED_HEADER",
    "capture",
    "default_fingerprint",
    "digest",
    "fingerprints",
    "parse_key",
    "problem",
    "problem_outcome",
    "problem_type",
    "replay",
]

#: The defaults of ``IDEMPOTENCY["HEADER"]`` and ``["REPLAYED_HEADER"]``, which name them.
HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
MAX_KEY_LENGTH = 255
#: A problem's ``type`` is its guide page, ``problems/<slug>.html`` (docs/guide/problems/).
PROBLEM_TYPE_BASE = GUIDE_URL + "problems/"
PROBLEM_CONTENT_TYPE = "application/problem+json"

# Never replayed: cookies belong to the first client's session; hop-by-hop headers describe the
# first connection (RFC 9110 section 7.6.1), not the resource.
UNREPLAYED_HEADERS = frozenset(
    {
        "set-cookie",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


# A bare key with nothing to refuse: printable ASCII without a comma, quote or backslash.
_PLAIN_BARE_KEY = re.compile(r"[ !#-+\--\[\]-~]*")


def parse_key(raw: str) -> str:
    """The key in an ``Idempotency-Key`` header value.

    Accepts the draft's RFC 8941 string Item (``"abc"``, with ``\\"`` and ``\\\\`` escapes, and
    parameters such as ``"abc";v=1``, which are ignored) and the bare form Stripe clients send
    (``abc``, taken whole). Servers join repeated headers with commas, so a comma after the Item,
    or in a bare key, means more than one header.
    """
    value = raw.strip(" \t")
    if value.startswith('"'):
        try:
            key, rest = sfv.parse_string_item(value)
        except sfv.Malformed as exc:
            raise IdempotencyKeyInvalid(raw, exc.reason) from exc
        rest = rest.lstrip(" \t")
        if rest.startswith(","):
            raise IdempotencyKeyMultiple(raw)
        if rest:
            raise IdempotencyKeyInvalid(
                raw, "unexpected characters after the string and its parameters"
            )
    elif _PLAIN_BARE_KEY.fullmatch(value):
        key = value  # the common case, checked in one pass; the rest says what is wrong
    else:
        key = value
        if "," in key:
            raise IdempotencyKeyMultiple(raw)
        if '"' in key or "\\" in key:
            raise IdempotencyKeyInvalid(raw, "quotes and backslashes need the quoted form")
        if not all(" " <= char <= "~" for char in key):
            raise IdempotencyKeyInvalid(raw, "only printable ASCII characters are allowed")
    if not key:
        raise IdempotencyKeyInvalid(raw, "the key is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise IdempotencyKeyInvalid(raw, f"the key is {len(key)} characters, over {MAX_KEY_LENGTH}")
    return key


def header_value(request: HttpRequest) -> str | None:
    """The raw key header (``IDEMPOTENCY["HEADER"]``), or None when absent."""
    value = request.META.get(conf.get().header_meta_key)
    return None if value is None else str(value)


def _materialize(response: HttpResponseBase) -> HttpResponseBase:
    render = getattr(response, "render", None)
    if callable(render) and not getattr(response, "is_rendered", True):
        rendered = render()
        response = rendered if isinstance(rendered, HttpResponseBase) else response
    return response


def capture(response: HttpResponseBase, max_bytes: int) -> tuple[HttpResponseBase, Outcome]:
    """The response (rendered) and what to store for it; refuses what cannot be replayed exactly."""
    response = _materialize(response)
    if response.streaming or isinstance(response, StreamingHttpResponse):
        _close_quietly(response)
        raise ResponseNotStorable(
            f"{type(response).__name__} is streamed; return an HttpResponse from an idempotent "
            "view, or exempt it"
        )
    if not isinstance(response, HttpResponse):
        raise ResponseNotStorable(f"{type(response).__name__} has no stored content")
    body = response.content
    if len(body) > max_bytes:
        raise ResponseNotStorable(
            f"the body is {len(body)} bytes, over MAX_RESPONSE_BYTES ({max_bytes}); raise the "
            "limit or return a smaller body (e.g. a link to the result)"
        )
    replayed = conf.get().replayed_header.lower()
    headers = [
        (k, v)
        for k, v in response.items()
        if k.lower() not in UNREPLAYED_HEADERS and k.lower() != replayed
    ]
    if any("\x00" in k or "\x00" in v for k, v in headers):
        # Django lets a NUL through in a header (an echoed X-Request-Id); jsonb cannot hold
        # one, and the store's write failed with a DataError: a 500, the effects undone.
        raise ResponseNotStorable("a header holds a NUL character, which cannot be stored")
    return response, Outcome(status=response.status_code, headers=headers, body=body)


def _close_quietly(response: HttpResponseBase) -> None:
    """Close what a refused streamed response holds (a ``FileResponse``'s file, which nobody
    would close otherwise). Not ``response.close()``: that also sends ``request_finished``,
    which closes the database connections, the attempt's among them, mid-request."""
    for closer in getattr(response, "_resource_closers", ()):
        try:
            closer()
        except Exception:  # noqa: S112 - closing is best effort; the refusal follows
            continue


def replay(outcome: Outcome) -> HttpResponse:
    """The stored response, byte for byte, marked ``Idempotent-Replayed: true`` (or the
    ``REPLAYED_HEADER`` setting's name)."""
    response = HttpResponse(outcome.body, status=outcome.status or 200)
    del response["Content-Type"]
    for name, value in outcome.headers:
        response[name] = value
    response[conf.get().replayed_header] = "true"
    if 300 <= response.status_code < 400 and response.has_header("Location"):
        response.url = response["Location"]  # type: ignore[attr-defined]  # as a redirect's
    return response


def problem_type(error: IdempotencyError) -> str:
    """The problem's ``type`` URI: a page of the published guide (RFC 9457 asks that it
    resolve to documentation a developer can read), built from the error's stable ``slug``."""
    return error.problem_type or f"{PROBLEM_TYPE_BASE}{error.slug}.html"


def problem(error: IdempotencyError) -> HttpResponse:
    """An RFC 9457 problem response for an error a client caused, with a stable ``type``."""
    body: dict[str, Any] = {
        "type": problem_type(error),
        "title": error.title,
        "status": error.http_status,
        "detail": str(error),
    }
    response = HttpResponse(
        json.dumps(body), status=error.http_status, content_type=PROBLEM_CONTENT_TYPE
    )
    if isinstance(error, IdempotencyKeyInProgress):
        # When the first request's claim lapses at the latest (whole seconds, at least 1).
        response["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
    return response


def problem_outcome(error: IdempotencyError) -> Outcome:
    """The problem response for ``error`` as an outcome to store, so that every retry under the
    key is answered it (replayed, and marked so) instead of running the view again. Built
    whole, not through :func:`capture`: its few hundred bytes stand in for an answer that
    ``MAX_RESPONSE_BYTES`` may have refused, and must not be refused in turn."""
    response = problem(error)
    return Outcome(
        status=response.status_code, headers=list(response.items()), body=response.content
    )
