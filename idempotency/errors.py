"""Every error the ``idempotency`` app raises, under one base class.

``IdempotencyError`` subclasses :class:`leases.errors.LeaseError` so the whole distribution has one
root a caller can catch. Errors a client caused also carry what an HTTP layer needs to answer
(``http_status`` and a stable problem ``slug``, or a ``problem_type`` URI of the guide page that
explains the error), so the views render any of them the same way and no table elsewhere has to
be kept in sync with this module.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

from leases.errors import LeaseError

__all__ = [
    "IdempotencyClientUnidentified",
    "IdempotencyError",
    "IdempotencyImproperlyConfigured",
    "IdempotencyKeyInProgress",
    "IdempotencyKeyInvalid",
    "IdempotencyKeyLost",
    "IdempotencyKeyMismatch",
    "IdempotencyKeyMissing",
    "IdempotencyKeyMultiple",
    "IdempotencyResultNotRecorded",
    "ResponseNotStorable",
]


GUIDE_URL = "https://django-leases.readthedocs.io/en/stable/"


class IdempotencyError(LeaseError):
    """Base class of every idempotency error; ``http_status`` and ``slug`` name the answer.

    ``problem_type``, when set, is the problem's ``type`` URI: a section of the guide that tells
    the developer reading a client's bug report what to change.
    """

    http_status = 500
    slug = "error"
    title = "Idempotency error"
    problem_type: str | None = None


class IdempotencyImproperlyConfigured(IdempotencyError, ImproperlyConfigured):
    """The ``IDEMPOTENCY`` setting or a decorator argument is wrong (``manage.py check`` too),
    or ``@idempotent`` wraps a DRF view from outside, where it cannot see DRF's user."""


class IdempotencyKeyMissing(IdempotencyError, ValueError):
    """The endpoint requires an ``Idempotency-Key`` header and the request had none."""

    http_status = 400
    slug = "idempotency-key-missing"
    title = "Idempotency-Key header missing"

    def __init__(self) -> None:
        super().__init__(
            "this endpoint requires an Idempotency-Key header: send a unique value "
            '(e.g. a UUID) per operation, as Idempotency-Key: "<key>"'
        )


class IdempotencyKeyInvalid(IdempotencyError, ValueError):
    """The header is not an RFC 8941 string (or bare key) of 1-255 printable ASCII characters."""

    http_status = 400
    slug = "idempotency-key-malformed"
    title = "Idempotency-Key header malformed"

    def __init__(self, value: str, reason: str) -> None:
        self.value = value
        self.reason = reason
        super().__init__(
            f"the Idempotency-Key header is malformed: {reason}; send 1-255 printable ASCII "
            'characters, as a quoted string (Idempotency-Key: "<key>") or bare'
        )


class IdempotencyClientUnidentified(IdempotencyError, ValueError):
    """A keyed request came from a client with no identity: no user, no session, no scope.

    Its key cannot be given a key space of its own, and one key space shared by every such client
    would replay one client's response to another who picked the same key; so the request is
    refused rather than guessed at. The guide section says how to give clients an identity or
    configure ``IDEMPOTENCY["SCOPE"]``.
    """

    http_status = 400
    slug = "idempotency-client-unidentified"
    title = "Idempotency-Key sent without a client identity"
    problem_type = GUIDE_URL + "idempotency.html#anonymous-clients"

    def __init__(self) -> None:
        super().__init__(
            "an Idempotency-Key is kept per client, and this request identifies no client: "
            "log in or start a session first, or send the credentials this API scopes keys by"
        )


class IdempotencyKeyMultiple(IdempotencyError, ValueError):
    """More than one ``Idempotency-Key`` header (or a list) was sent: which counts is unclear."""

    http_status = 400
    slug = "idempotency-key-multiple"
    title = "More than one Idempotency-Key"

    def __init__(self, value: str) -> None:
        self.value = value
        super().__init__("send exactly one Idempotency-Key header holding one key")


class IdempotencyKeyMismatch(IdempotencyError, ValueError):
    """The key was already used for a different request (method, path, media type or body
    differ), completed or still running."""

    http_status = 422
    slug = "idempotency-key-mismatch"
    title = "Idempotency-Key reused for a different request"

    def __init__(self, scope: str, key: str) -> None:
        self.scope = scope
        self.key = key
        super().__init__(
            f"Idempotency-Key {key!r} was already used for a different request; "
            "use a new key for a new operation"
        )


class IdempotencyKeyInProgress(IdempotencyError):
    """The first request with this key is still running; retry after ``retry_after`` seconds."""

    http_status = 409
    slug = "idempotency-key-in-progress"
    title = "A request with this Idempotency-Key is in progress"

    def __init__(self, scope: str, key: str, retry_after: float) -> None:
        self.scope = scope
        self.key = key
        self.retry_after = retry_after
        super().__init__(
            f"a request with Idempotency-Key {key!r} is still in progress; retry later to get "
            "its response"
        )


class IdempotencyKeyLost(IdempotencyKeyInProgress):
    """This request ran past its lock and a retry took the key over; its effects were undone.

    The request that took over owns the outcome now, so the answer is the same as for a request
    arriving while another is in progress.
    """

    def __init__(self, scope: str, key: str) -> None:
        super().__init__(scope, key, retry_after=1.0)
        self.args = (
            f"the lock on Idempotency-Key {key!r} expired and a retry took it over; this "
            "attempt was rolled back; retry to get the outcome",
        )


class ResponseNotStorable(IdempotencyError, TypeError):
    """The view answered with something that cannot be replayed byte for byte.

    Streaming responses and bodies over ``MAX_RESPONSE_BYTES`` are refused rather than stored in
    part; in atomic mode the view's effects are rolled back with the key. Outside it they have
    committed: the key is stored as run, holding this error's problem, which every retry is
    answered instead of running the view again.
    """

    http_status = 500
    slug = "idempotency-response-not-storable"
    title = "Response cannot be stored for replay"

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"an idempotent view returned a response that cannot be stored for replay: {reason}"
        )


class IdempotencyResultNotRecorded(IdempotencyError, TypeError):
    """An operation or a step ran, and its result could not be recorded (it is not JSON).

    In atomic mode the attempt's effects roll back with the error and the key is freed, so the
    retry runs again. Outside it the effects have happened: the key (for the operation's
    result) or the step is recorded as run without a result, and every retry under the key
    raises this error instead of running the work again, which a retry of an effect that
    cannot be undone must never do silently. ``step`` is None for the operation's own result.
    """

    http_status = 500
    slug = "idempotency-result-not-recorded"
    title = "Result cannot be recorded for replay"

    def __init__(self, scope: str, key: str, step: str | None, reason: str) -> None:
        self.scope = scope
        self.key = key
        self.step = step
        self.reason = reason
        what = "the result" if step is None else f"step {step!r}"
        super().__init__(f"{what} of scope {scope!r} key {key!r} {reason}")
