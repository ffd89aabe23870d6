"""OpenTelemetry spans around acquire, wait and release, when ``opentelemetry-api`` is installed.

A library depends on the OpenTelemetry API only and never configures it: without an SDK the
API's tracer is a no-op, and with one (set up by the application) the spans land wherever the
application exports them. Without the API installed at all, :func:`span` is a ``nullcontext``,
so the package has no dependency to carry and the lease path pays one attribute check.

The tracer is looked up once, on first use rather than at import (importing the API costs
milliseconds that a process which never acquires should not pay); the API's proxy tracer
forwards to a provider set up later, so an early lookup is not a stale one.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .errors import LeaseUnavailable

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = ["INSTRUMENTATION_NAME", "NO_SPAN", "Attributes", "span"]

#: The instrumentation scope of every span this package starts.
INSTRUMENTATION_NAME = "django-leases"

Attributes = Mapping[str, str | int | float | bool]

_UNSET: Any = object()
_tracer: Tracer | None = _UNSET
#: The providers that record nothing: the API's placeholder before an SDK is set up, and the
#: explicit no-op one.
_SILENT: tuple[type, ...] = ()
#: Reads the global tracer provider, once the API is imported: its ``get_tracer_provider``.
_provider: Callable[[], object] = object
#: The API's ``trace`` module when the global provider is read as its module variable instead
#: (see ``_read_directly``), else ``None``.
_direct: Any = None
#: A recording provider was seen: it is set for good (the API sets the global one once).
_recording = False
_lock = threading.Lock()


def _get_tracer() -> Tracer | None:
    """The package's tracer, or ``None`` when nothing would record a span.

    With the OpenTelemetry API installed but no SDK set up, a span still costs tens of
    microseconds to start and end (context attach and detach), about a third of what this
    package adds to an uncontended acquire + release: so spans start only once a recording
    provider is set (checked on every call: a provider may be set up at any time).
    """
    global _tracer, _SILENT, _provider, _direct, _recording
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
                    _provider = trace.get_tracer_provider
                    _direct = trace if _read_directly(trace) else None
                    _tracer = trace.get_tracer(INSTRUMENTATION_NAME)
    if _tracer is None:
        return None
    # An attribute read rather than a call: this is every acquire's and release's path.
    provider = _direct._TRACER_PROVIDER if _direct is not None else _provider()
    if provider is None or isinstance(provider, _SILENT):
        return None
    _recording = True  # the global provider is set once and for all: no need to look again
    return _tracer


def _read_directly(trace: Any) -> bool:
    """Whether the global provider can be read as the API's module variable on every acquire
    while none is set (``None`` until set: the proxy's, silent): the API's
    ``get_tracer_provider`` looks the environment up (``OTEL_PYTHON_TRACER_PROVIDER``) each
    time it finds none. Not when that variable is gone (another API version) or the
    environment names a provider (the API loads it on first get)."""
    from opentelemetry.environment_variables import OTEL_PYTHON_TRACER_PROVIDER

    return hasattr(trace, "_TRACER_PROVIDER") and OTEL_PYTHON_TRACER_PROVIDER not in os.environ


#: What :func:`span` returns when nothing would record one: entered and left for nothing
#: (a hot path may compare with it and skip entering it at all).
NO_SPAN: contextlib.AbstractContextManager[None] = contextlib.nullcontext()


def span(
    name: str, attributes: Attributes | Callable[[], Attributes]
) -> contextlib.AbstractContextManager[Span | None]:
    """A span named ``name`` around the block, or nothing without the OpenTelemetry API (or
    without a recording provider). ``attributes`` may be a function making them, called only
    when a span is started (the hot path builds no dictionary for nothing).

    A lease that was not available in time is an answer, not a failure: the span says so in
    ``leases.outcome`` and keeps an unset status, so a dashboard of failed spans shows only
    stores that failed. Any other exception is recorded and marks the span as an error.
    """
    if _recording:
        tracer = _tracer
    elif _direct is not None and _direct._TRACER_PROVIDER is None:
        # :func:`_get_tracer`'s most common answer, without the call: the API is imported and
        # no provider is set yet (read on every call: one may be set up at any time).
        return NO_SPAN
    else:
        tracer = _get_tracer()
    if tracer is None:
        return NO_SPAN
    return _recorded(tracer, name, attributes() if callable(attributes) else attributes)


@contextlib.contextmanager
def _recorded(tracer: Tracer, name: str, attributes: Attributes) -> Iterator[Span]:
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
