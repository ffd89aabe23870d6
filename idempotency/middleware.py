"""``IdempotencyMiddleware``: the Idempotency-Key contract for whole URL prefixes, no decorators.

The drop-in path for projects coming from drf-idempotency or django-idempotency-key: list the
paths (``IDEMPOTENCY["MIDDLEWARE_PATHS"]``, regular expressions matched from the start of the
path) and every request to them with a method of ``MIDDLEWARE_METHODS`` (the unsafe ones by
default) runs under the same guard as ``@idempotent``, with the same settings (``HEADER`` and
``REPLAYED_HEADER`` name the headers other libraries' clients already send and read).

The guard wraps everything after this middleware, so the attempt's transaction (atomic mode)
holds the view's effects and the stored response commits with them; place it after
``SessionMiddleware`` and ``AuthenticationMiddleware``, whose user and session scope the keys.
A response from further in that must not be kept (a CSRF 403, a 5xx) is not stored, as for the
decorator. A view that carries ``@idempotent`` or ``IdempotentMixin`` itself steps aside for the
middleware's guard (nested guards: the outer one counts).

DRF authenticates inside the view, after every middleware ran, so for a request to a DRF view
the scope is computed from a DRF request authenticated here with the view's own authenticators
(token, session, any): a token client is scoped by its user, not pooled as anonymous. Those
authenticators then run once more in the view.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponseBase
from django.urls import Resolver404, resolve

from . import conf, drf
from .views import Options, _Guard

__all__ = ["IdempotencyMiddleware"]


class IdempotencyMiddleware:
    """Guard the unsafe methods of the configured paths; see the module. Sync and async."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def _guard(self, request: HttpRequest) -> _Guard | None:
        """The guard for this request, or None when its path or method is not configured."""
        settings = conf.get()
        if request.method not in settings.middleware_methods:
            return None
        path = request.path_info
        if not any(pattern.match(path) for pattern in settings.middleware_paths):
            return None
        return _Guard(Options(methods=settings.middleware_methods))

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        guard = self._guard(request)
        if guard is None:
            return self.get_response(request)
        return guard.run(request, lambda: self.get_response(request), _scope_source(request))

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        guard = self._guard(request)
        call: Callable[[], Awaitable[HttpResponseBase]] = lambda: self.get_response(request)  # noqa: E731
        if guard is None:
            return await call()
        return await guard.arun(request, call, _scope_source(request))


def _scope_source(request: HttpRequest) -> Callable[[], Any]:
    """What the scope function is handed (called only for keyed requests): DRF's authenticated
    request when the path resolves to a DRF view, else Django's request."""

    def source() -> Any:
        try:
            match = resolve(request.path_info, getattr(request, "urlconf", None))
        except Resolver404:
            return request
        return drf.authenticated_request(match.func, request, match.args, match.kwargs)

    return source
