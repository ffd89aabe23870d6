"""``@idempotent`` for function views and ``IdempotentMixin`` for class-based and DRF views.

Both run one ``_Guard``: it parses the header, claims the key (one round trip), replays or
refuses duplicates, and otherwise runs the view inside an :class:`~idempotency.store.Attempt`, so
in atomic mode the view's database effects and the stored response commit together. The guard
holds only options; a request's live state is local to the call, so one decorated view serves
every thread at once.

Guards nest: ``IdempotentMixin`` on a view and ``@idempotent`` on its handler (or around its
``as_view()``) would both claim the key, and the inner one would find it claimed by the outer and
answer 409. So the outermost guard that claims marks the request, and guards inside it step
aside: the outer guard's options are the ones that count.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, NoReturn, TypeVar, cast, overload

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.http import HttpRequest, HttpResponseBase

from . import conf, drf, http, store
from ._claiming import open_cancellably
from .errors import (
    IdempotencyError,
    IdempotencyImproperlyConfigured,
    IdempotencyKeyLost,
    IdempotencyKeyMissing,
    ResponseNotStorable,
)

__all__ = ["IdempotentMixin", "idempotent"]

logger = logging.getLogger(__name__)

View = TypeVar("View", bound=Callable[..., Any])
Fingerprint = Callable[[Any], str]


@dataclass(frozen=True)
class Options:
    """Per-view options; ``None`` means "the IDEMPOTENCY setting's value", read per request."""

    required: bool | None = None
    methods: Iterable[str] | None = None
    ttl: float | None = None
    scope: conf.ScopeFunction | str | None = None
    fingerprint: Fingerprint | None = None
    on_conflict: str | None = None
    wait_timeout: float | None = None
    lock_timeout: float | None = None
    atomic: bool | None = None
    claim_in_transaction: bool | None = None

    def __post_init__(self) -> None:
        if self.on_conflict not in (None, *conf.ON_CONFLICT_CHOICES):
            raise IdempotencyImproperlyConfigured(
                f"on_conflict must be one of {conf.ON_CONFLICT_CHOICES}, not {self.on_conflict!r}"
            )
        if isinstance(self.methods, str):
            raise IdempotencyImproperlyConfigured("methods must be a list, e.g. ['POST']")
        conf.check_seconds("ttl", self.ttl, positive=True)
        conf.check_seconds("lock_timeout", self.lock_timeout, positive=True)
        conf.check_seconds("wait_timeout", self.wait_timeout, positive=False)
        if self.scope is not None:
            conf.resolve_scope(self.scope)


# Set on Django's request (under DRF's, if any) while a guard's attempt runs the view.
_GUARDED_ATTR = "_idempotency_guarded"


class _Guarding:
    """Marks the request as guarded while the view runs, so a nested guard steps aside
    (:attr:`nested`). A class rather than ``@contextmanager``: it is entered on every keyed
    request, and a generator's context manager costs more than the attribute it sets."""

    __slots__ = ("inner",)

    def __init__(self, request: Any) -> None:
        self.inner = drf.http_request(request)

    @property
    def nested(self) -> bool:
        """Whether an outer guard already runs this request's attempt."""
        return bool(getattr(self.inner, _GUARDED_ATTR, False))

    def __enter__(self) -> None:
        setattr(self.inner, _GUARDED_ATTR, True)

    def __exit__(self, *exc: object) -> None:
        delattr(self.inner, _GUARDED_ATTR)


@dataclass(frozen=True)
class _Plan:
    scope: str
    key: str
    fingerprint: str
    #: The default fingerprint as versions up to 0.1.0 made it, which keys they stored hold.
    legacy_fingerprint: str


class _Guard:
    """The protocol around one view call; stateless apart from its options."""

    def __init__(self, options: Options) -> None:
        self.options = options

    def _settings(self) -> conf.IdempotencySettings:
        return conf.get()

    def _plan(self, request: HttpRequest, scope_source: Callable[[], Any]) -> _Plan | None:
        opts, defaults = self.options, self._settings()
        methods = {m.upper() for m in opts.methods} if opts.methods else defaults.methods
        if request.method not in methods:
            return None
        raw = http.header_value(request)
        if raw is None:
            required = defaults.required if opts.required is None else opts.required
            if required:
                raise IdempotencyKeyMissing()
            return None
        key = http.parse_key(raw)
        scope_request = scope_source()
        if scope_request is None:
            return None
        scope_fn = conf.resolve_scope(opts.scope) if opts.scope else defaults.scope
        # The scope first: a client it refuses (no identity) must not make the server read,
        # and spool to disk, a body of any size only to be refused.
        scope = scope_fn(scope_request)
        if opts.fingerprint is not None:
            fingerprint = legacy = http.digest([opts.fingerprint(request).encode()])
        else:
            both = http.fingerprints(request)
            fingerprint, legacy = both.current, both.legacy
        return _Plan(scope=scope, key=key, fingerprint=fingerprint, legacy_fingerprint=legacy)

    def open(
        self, request: HttpRequest, scope_source: Callable[[], Any] | None = None
    ) -> HttpResponseBase | store.Attempt | None:
        """Claim the key: None (not guarded), a response (refusal or replay), or an Attempt.

        ``scope_source`` gives the object handed to the scope function (DRF's request, whose
        user DRF authenticated); it is called only for guarded requests, and None skips them.
        """
        defaults, opts = self._settings(), self.options
        try:
            plan = self._plan(request, scope_source or (lambda: request))
            if plan is None:
                return None
            wait = opts.wait_timeout if opts.wait_timeout is not None else defaults.wait_timeout
            conflict = opts.on_conflict or defaults.on_conflict
            lock = opts.lock_timeout if opts.lock_timeout is not None else defaults.lock_timeout
            ttl = opts.ttl if opts.ttl is not None else defaults.ttl
            atomic = defaults.atomic if opts.atomic is None else opts.atomic
            in_transaction = store.claims_in_transaction(
                atomic, opts.claim_in_transaction, defaults.claim_in_transaction, defaults.database
            )
            begun = store.begin(
                plan.scope,
                plan.key,
                plan.fingerprint,
                ttl=ttl,
                lock_timeout=lock,
                wait=wait if conflict == "wait" else 0.0,
                using=defaults.database,
                in_transaction=in_transaction,
                legacy_fingerprint=plan.legacy_fingerprint,
            )
            begun.raise_for_conflict(plan.scope, plan.key)
        except IdempotencyError as exc:
            return http.problem(exc)
        if begun.outcome is not None:
            return http.replay(begun.outcome)
        assert begun.claim is not None
        attempt = store.Attempt(begun.claim, atomic=atomic, ttl=ttl)
        attempt.start()
        return attempt

    def close(
        self, attempt: store.Attempt, response: HttpResponseBase, request: Any
    ) -> HttpResponseBase:
        """Store the response with the effects, or undo both: for a 5xx, a failure, and a
        refusal of a request that never ran (``NOT_STORED_STATUSES``), so the retry runs. A
        response that cannot be stored raises :class:`ResponseNotStorable` (see
        :func:`_refuse_unstorable`, which outside atomic mode records the key as run)."""
        settings = self._settings()
        if not settings.stores(response.status_code):
            attempt.abort()
            return response
        try:
            response = drf.finalize(request, response)
            response, outcome = http.capture(response, settings.max_response_bytes)
        except ResponseNotStorable as exc:
            _refuse_unstorable(attempt, exc)
        except BaseException:
            attempt.abort()
            raise
        try:
            attempt.commit(outcome)
        except IdempotencyError as exc:
            logger.warning("idempotent attempt not stored: %s", exc)
            return http.problem(exc)
        return response

    def run(
        self,
        request: HttpRequest,
        call: Callable[[], HttpResponseBase],
        scope_source: Callable[[], Any] | None = None,
    ) -> HttpResponseBase:
        guarding = _Guarding(request)
        if guarding.nested:
            return call()  # an outer guard runs this request's attempt
        opened = self.open(request, scope_source)
        if opened is None:
            return call()
        if isinstance(opened, HttpResponseBase):
            return opened
        try:
            with guarding:
                response = call()
        except IdempotencyKeyLost as exc:
            opened.abort()
            return _lost(opened, exc)
        except BaseException:
            opened.abort()
            raise
        return self.close(opened, response, request)

    async def arun(
        self,
        request: HttpRequest,
        call: Callable[[], Awaitable[HttpResponseBase]],
        scope_source: Callable[[], Any] | None = None,
    ) -> HttpResponseBase:
        """The async form: database steps run in the request's thread-sensitive sync thread,
        where the async ORM's queries also run, so they share the attempt's transaction."""
        guarding = _Guarding(request)
        if guarding.nested:
            return await call()
        # A client that goes away while the key is being claimed (ASGI cancels the request's
        # task) has the claim given up before the cancellation goes on. Left claimed, the
        # client's retries got 409 until the lock lapsed.
        opened = await open_cancellably(
            functools.partial(self.open, request, scope_source), _attempt_in
        )
        if opened is None:
            return await call()
        if isinstance(opened, HttpResponseBase):
            return opened
        try:
            with guarding:
                response = await call()
        except IdempotencyKeyLost as exc:
            await sync_to_async(opened.abort)()
            return _lost(opened, exc)
        except BaseException:
            await sync_to_async(opened.abort)()
            raise
        return await sync_to_async(self.close)(opened, response, request)


def _refuse_unstorable(attempt: store.Attempt, exc: ResponseNotStorable) -> NoReturn:
    """End an attempt whose response cannot be stored, and say so (a 500: the view, not the
    request, has to change).

    Atomic, it ends as a failed one: the view's effects roll back, the key is freed and the
    retry runs again. Outside atomic mode the view's writes have committed and cannot be
    undone, and a freed key let every retry run the view and write again, failing the same way
    each time. So the key is stored as run without a response: its outcome is this error's
    problem, which every retry is answered with (replayed, as Stripe replays a 500) instead of
    running the view, as a non-atomic operation whose result is not JSON is refused
    (:class:`~idempotency.errors.IdempotencyResultNotRecorded`). Inside a transaction the
    caller opened, the record goes with that transaction, as the view's writes do.
    """
    if attempt.atomic:
        attempt.abort()
        raise exc
    refusal = ResponseNotStorable(
        f"{exc.reason}. The view ran under this key outside atomic mode, so it is recorded as "
        "run without a response, and it is not run again under this key: a retry with it gets "
        "this answer (use a new key once the server is fixed)"
    )
    try:
        attempt.commit(http.problem_outcome(refusal))
    except IdempotencyKeyLost as lost:
        # A retry took the key over (this attempt's lock lapsed) and runs the view itself:
        # nothing is recorded, and the refusal is only this attempt's.
        raise exc from lost
    raise refusal from exc


def _attempt_in(opened: HttpResponseBase | store.Attempt | None) -> store.Attempt | None:
    """The attempt :meth:`_Guard.open` opened, if it opened one (not a refusal or replay)."""
    return opened if isinstance(opened, store.Attempt) else None


def _lost(attempt: store.Attempt, exc: IdempotencyKeyLost) -> HttpResponseBase:
    """The answer to a request whose key was taken over while its view ran (a step found it
    so), as :meth:`_Guard.close` answers one found so at the end: the 409 problem. Only this
    attempt's key: a key the view used itself (``idempotency_key(...)`` inside it) is the
    view's business, and its loss goes on as the view's exception."""
    claim = attempt.claim
    if (exc.scope, exc.key) != (claim.scope, claim.key):
        raise exc
    logger.warning("idempotent attempt not stored: %s", exc)
    return http.problem(exc)


def _decorate(view: View, options: Options) -> View:
    drf.refuse_outer_guard(view)
    guard = _Guard(options)
    # asgiref's test, not inspect's: before Python 3.12 only it sees the mark Django puts on an
    # async class-based view's ``as_view()``, which is a plain function returning a coroutine.
    if iscoroutinefunction(view):

        @functools.wraps(view)
        async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            return await guard.arun(request, lambda: view(request, *args, **kwargs))

        return cast(View, async_wrapper)

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        return guard.run(request, lambda: view(request, *args, **kwargs))

    return cast(View, wrapper)


@overload
def idempotent(view: View, /) -> View: ...
@overload
def idempotent(
    *,
    required: bool | None = None,
    methods: Iterable[str] | None = None,
    ttl: float | None = None,
    scope: conf.ScopeFunction | str | None = None,
    fingerprint: Fingerprint | None = None,
    on_conflict: str | None = None,
    wait_timeout: float | None = None,
    lock_timeout: float | None = None,
    atomic: bool | None = None,
    claim_in_transaction: bool | None = None,
) -> Callable[[View], View]: ...
def idempotent(view: Any = None, /, **options: Any) -> Any:
    """Make a view honour the Idempotency-Key header (bare ``@idempotent`` or called form).

    Unset options come from the ``IDEMPOTENCY`` setting at request time. ``on_conflict="wait"``
    waits up to ``wait_timeout`` seconds for a running duplicate and then replays its response.
    On a DRF function view it goes under ``@api_view``; around a DRF view it is refused here
    (:func:`idempotency.drf.refuse_outer_guard` says why).
    """
    opts = Options(**options)
    if view is None:
        return lambda fn: _decorate(fn, opts)
    return _decorate(view, opts)


class IdempotentMixin:
    """Honour Idempotency-Key in a class-based view or a DRF ``APIView``/viewset.

    Options are class attributes named ``idempotency_<option>``. For DRF views the scope is
    computed from DRF's authenticated user (token, session or any authenticator), not only
    Django's session user; a request DRF cannot authenticate is left for DRF to refuse.
    """

    idempotency_required: bool | None = None
    idempotency_methods: Iterable[str] | None = None
    idempotency_ttl: float | None = None
    idempotency_scope: conf.ScopeFunction | str | None = None
    idempotency_fingerprint: Fingerprint | None = None
    idempotency_on_conflict: str | None = None
    idempotency_wait_timeout: float | None = None
    idempotency_lock_timeout: float | None = None
    idempotency_atomic: bool | None = None
    idempotency_claim_in_transaction: bool | None = None

    def get_idempotency_options(self) -> Options:
        fields = Options.__dataclass_fields__
        values = {name: getattr(self, f"idempotency_{name}") for name in fields}
        scope = values["scope"]
        if callable(scope) and not isinstance(scope, str) and hasattr(scope, "__func__"):
            values["scope"] = scope.__func__  # a plain function stored on the class
        return replace(Options(), **values)

    def _idempotency_scope_request(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        initialize = getattr(super(), "initialize_request", None)
        if initialize is None:
            return request
        drf_request = initialize(request, *args, **kwargs)
        try:
            drf_request.user  # noqa: B018  (runs DRF's authenticators)
        except Exception:
            return None  # DRF refuses the request itself; nothing to guard
        self._idempotency_request = drf_request
        return drf_request

    def initialize_request(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        """DRF's hook: reuse the request authenticated for the scope, so auth runs once."""
        prepared = self.__dict__.pop("_idempotency_request", None)
        if prepared is not None and prepared._request is request:
            return prepared
        return super().initialize_request(request, *args, **kwargs)  # type: ignore[misc]

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
        """Guard the parent's dispatch; for an async view (``view_is_async``, Django awaits what
        this returns) that is the coroutine of the async guard, which awaits the handler."""
        parent = super().dispatch  # type: ignore[misc]
        guard = _Guard(self.get_idempotency_options())
        call = functools.partial(parent, request, *args, **kwargs)
        scope_source = functools.partial(self._idempotency_scope_request, request, *args, **kwargs)
        if getattr(self, "view_is_async", False):
            return guard.arun(request, call, scope_source)
        return guard.run(request, call, scope_source)
