"""What the guards need to know about Django REST framework, duck-typed: DRF is never imported.

DRF wraps Django's request in its own ``Request`` and authenticates it (token, session, any
authenticator) inside the view, after every decorator outside the view has run. So where a guard
sits decides whose key space a request lands in:

- **Inside** (``@idempotent`` under ``@api_view``, or ``IdempotentMixin`` on the class) the guard
  sees DRF's request and DRF's user. The handler's ``Response`` is not rendered yet (DRF gives it
  a renderer only after the handler returned), so the guard has DRF finalize it first.
- **Outside** (``@idempotent`` around ``@api_view`` or ``as_view()``) the guard would only see
  Django's session user: every token-authenticated client would be scoped as anonymous. That
  order is refused when the view is decorated (:func:`refuse_outer_guard`).
- **In the middleware**, which is outside every view by nature, the guard has the view's own
  authenticators run on a DRF request built for the purpose (:func:`authenticated_request`).
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponseBase

from .errors import IdempotencyImproperlyConfigured

__all__ = ["authenticated_request", "finalize", "http_request", "refuse_outer_guard"]


def http_request(request: Any) -> HttpRequest:
    """Django's request under a DRF ``Request`` (or the request itself): the one object every
    guard of a request shares, whatever layer it was handed."""
    inner = getattr(request, "_request", None)
    return inner if isinstance(inner, HttpRequest) else request


def finalize(request: Any, response: HttpResponseBase) -> HttpResponseBase:
    """Give a DRF ``Response`` returned by a handler its renderer, as DRF's view will.

    Inside ``@api_view`` the guard must store the body before DRF's ``finalize_response`` runs;
    rendering without it fails (``.accepted_renderer not set``). The view's own method does the
    same work DRF repeats afterwards (same renderer, same headers), so nothing changes twice.
    """
    unrendered_drf = hasattr(type(response), "rendered_content") and not getattr(
        response, "accepted_renderer", None
    )
    if not unrendered_drf:
        return response
    view = (getattr(request, "parser_context", None) or {}).get("view")
    if view is None:
        return response
    args, kwargs = getattr(view, "args", ()), getattr(view, "kwargs", {})
    return view.finalize_response(request, response, *args, **kwargs)  # type: ignore[no-any-return]


def _drf_view_class(view: Any) -> type | None:
    """The APIView class behind ``as_view()`` / ``@api_view`` (DRF marks it ``cls``)."""
    cls = getattr(view, "cls", None)
    return cls if isinstance(cls, type) and hasattr(cls, "initialize_request") else None


def authenticated_request(
    view: Any, request: HttpRequest, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """For a DRF view, a DRF request authenticated by the view's authenticators (the object a
    scope function reads the user from); for any other view, ``request`` itself. None when DRF
    cannot authenticate it: DRF refuses such a request itself, so there is nothing to guard."""
    cls = _drf_view_class(view)
    if cls is None:
        return request
    instance = cls(**(getattr(view, "initkwargs", None) or {}))
    instance.args, instance.kwargs, instance.request = args, kwargs, request
    instance.action_map = getattr(view, "actions", None) or {}  # a viewset's routing
    drf_request = instance.initialize_request(request, *args, **kwargs)
    try:
        drf_request.user  # noqa: B018  (runs DRF's authenticators)
    except Exception:
        return None
    return drf_request


def refuse_outer_guard(view: Any) -> None:
    """Raise if ``view`` is a DRF view (``as_view()`` of an ``APIView``, ``@api_view``), even
    behind other decorators (``functools.wraps`` copies the ``cls`` DRF marks it with)."""
    cls = _drf_view_class(view)
    if cls is None:
        return
    raise IdempotencyImproperlyConfigured(
        f"@idempotent is outside the DRF view {cls.__name__}: it would run before DRF "
        "authenticates the request and scope every token-authenticated client as anonymous. "
        "Put @idempotent under @api_view (right above the function), or add IdempotentMixin "
        "to the APIView or viewset class."
    )
