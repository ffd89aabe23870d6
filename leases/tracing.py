"""OpenTelemetry spans around acquire, wait and release, when ``opentelemetry-api`` is installed.

A library depends on the OpenTelemetry API only and never configures it: without an SDK the
API's tracer is a no-op, and with one (set up by the application) the spans land wherever the
application exports them. Without the API installed at all, :func:`span` is a ``nullcontext``,
so the package has no dependency to carry and the lease path pays one attribute check.

The tracer is looked up once, on first use rather than at import (importing the API costs
milliseconds that a process which never acquires should not pay); the API's proxy tracer
forwards to a provider set up later, so an early lookup is not a stale one. Until the
application sets a provider, every span the API would start is a no-op that still costs
microseconds per acquire and release (context attach and detach), so :func:`span` starts none
while the global provider is the API's placeholder, and starts real ones as soon as it is not.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .errors import LeaseUnavailable

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = ["INSTRUMENTATION_NAME", "Attributes", "span"]

#: The instrumentation scope of every span this package starts.
INSTRUMENTATION_NAME = "django-leases"

Attributes = Mapping[str, str | int | float | bool]

_UNSET: Any = object()
_tracer: Tracer | None = _UNSET
_api: ModuleType | None = None
_lock = threading.Lock()

#: What :func:`span` returns while nothing would record a span.
_NO_SPAN: AbstractContextManager[None] = contextlib.nullcontext()


def _get_tracer() -> Tracer | None:
    global _tracer, _api
    if _tracer is _UNSET:
        with _lock:
            if _tracer is _UNSET:
                try:
                    from opentelemetry import trace
                except ImportError:
                    _tracer = None
                else:
                    _api = trace
                    _tracer = trace.get_tracer(INSTRUMENTATION_NAME)
    return _tracer


def span(name: str, attributes: Attributes) -> AbstractContextManager[Span | None]:
    """A span named ``name`` around the block, or nothing when no span would be recorded:
    without the OpenTelemetry API, or before the application set a tracer provider.

    A lease that was not available in time is an answer, not a failure: the span says so in
    ``leases.outcome`` and keeps an unset status, so a dashboard of failed spans shows only
    stores that failed. Any other exception is recorded and marks the span as an error.
    """
    tracer = _get_tracer()
    if tracer is None or _api is None:
        return _NO_SPAN
    if isinstance(_api.get_tracer_provider(), _api.ProxyTracerProvider):
        return _NO_SPAN  # the placeholder: its spans are no-ops
    return _span(tracer, name, attributes)


@contextlib.contextmanager
def _span(tracer: Tracer, name: str, attributes: Attributes) -> Iterator[Span]:
    from opentelemetry.trace import Status, StatusCode

    with tracer.start_as_current_span(
        name, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as current:
        try:
            yield current
        except LeaseUnavailable:
            current.set_attribute("leases.outcome", "unavailable")
            raise
        except BaseException as exc:
            current.set_attribute("leases.outcome", "error")
            current.record_exception(exc)
            current.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
