"""OpenTelemetry spans around acquire, wait and release, when ``opentelemetry-api`` is installed.

A library depends on the OpenTelemetry API only and never configures it: without an SDK the
API's tracer is a no-op, and with one (set up by the application) the spans land wherever the
application exports them. Without the API installed at all, :func:`span` is a ``nullcontext``,
so the package has no dependency to carry and the lease path pays one attribute check.

The tracer is looked up once, on first use rather than at import (importing the API costs
milliseconds that a process which never acquires should not pay); the API's proxy tracer
forwards to a provider set up later, so an early lookup is not a stale one.

Whether anything records is asked on every acquire and release, so it is asked cheaply: the
API's global provider is read directly (``get_tracer_provider()`` also looks up an environment
variable on every call while none is set; it is called once, on first use, which is when it
loads a provider named by ``OTEL_PYTHON_TRACER_PROVIDER``). The API lets a provider be set
only once, so once a recording one is found the answer is kept.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
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
#: The providers that record nothing: the API's placeholder before an SDK is set up, and the
#: explicit no-op one.
_SILENT: tuple[type, ...] = ()
#: ``opentelemetry.trace``, once imported.
_api: Any = None
#: A recording provider was found (it can never be replaced: the API sets one only once).
_recording = False
_lock = threading.Lock()
#: What :func:`span` returns when nothing records: reusable, and cheaper than a generator.
_NOTHING: AbstractContextManager[None] = contextlib.nullcontext()


def _get_tracer() -> Tracer | None:
    """The package's tracer, or ``None`` when nothing would record a span.

    With the OpenTelemetry API installed but no SDK set up, a span still costs tens of
    microseconds to start and end (context attach and detach), about a third of what this
    package adds to an uncontended acquire + release: so spans start only once a recording
    provider is set (checked on every call: a provider may be set up at any time).
    """
    global _tracer, _SILENT, _api, _recording
    if _recording:
        return _tracer
    if _tracer is _UNSET:
        with _lock:
            if _tracer is _UNSET:
                try:
                    from opentelemetry import trace
                except ImportError:
                    _tracer = None
                else:
                    _SILENT = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
                    trace.get_tracer_provider()  # loads one named by the environment, if any
                    _api, _tracer = trace, trace.get_tracer(INSTRUMENTATION_NAME)
    if _tracer is None:
        return None
    provider = getattr(_api, "_TRACER_PROVIDER", _UNSET)
    if provider is None:  # none set up yet: the common case, answered without a call
        return None
    if provider is _UNSET:  # an API without that global: ask it
        provider = _api.get_tracer_provider()
    if isinstance(provider, _SILENT):
        return None
    _recording = True
    return _tracer


def span(name: str, attributes: Attributes) -> AbstractContextManager[Span | None]:
    """A span named ``name`` around the block, or nothing without the OpenTelemetry API.

    A lease that was not available in time is an answer, not a failure: the span says so in
    ``leases.outcome`` and keeps an unset status, so a dashboard of failed spans shows only
    stores that failed. Any other exception is recorded and marks the span as an error.
    """
    tracer = _get_tracer()
    if tracer is None:
        return _NOTHING
    return _recorded(tracer, name, attributes)


@contextlib.contextmanager
def _recorded(tracer: Tracer, name: str, attributes: Attributes) -> Iterator[Span]:
    """:func:`span` when a provider records."""
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
