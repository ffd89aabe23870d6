"""OpenTelemetry spans around acquire, wait and release, recorded by the real SDK.

The SDK's tracer provider is global and can be set once per process, so this module sets it
once (an in-memory exporter behind a simple span processor: every ended span is exported at
once) and each test reads the spans of its own lease name.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import Iterator, Sequence

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from leases import LeaseUnavailable, aacquire, aacquire_slot, acquire, acquire_slot
from leases.errors import BackendUnavailable
from leases.tracing import INSTRUMENTATION_NAME
from tests.extra_backends import closed_port_backend
from tests.lease_backends import lease_backend, lease_name
from tests.test_lease_async import arun

__all__ = ["closed_port_backend", "lease_backend", "lease_name"]  # fixtures, for pytest

_EXPORTERS: list[InMemorySpanExporter] = []


@pytest.fixture(scope="module", autouse=True)
def _sdk() -> Iterator[None]:
    """The SDK for this module's tests; afterwards their exporter stops keeping spans (the
    provider itself cannot be unset, and later tests should not fill memory with spans).

    pytest-django runs database tests first, so the module's tests may come in two runs and
    this fixture set up twice: each run gets an exporter of its own.
    """
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _EXPORTERS.append(exporter)
    yield
    _EXPORTERS.remove(exporter)
    exporter.clear()
    exporter.shutdown()


def spans_of(name: str) -> Sequence[ReadableSpan]:
    return [
        span
        for span in _EXPORTERS[-1].get_finished_spans()
        if span.attributes is not None and span.attributes.get("leases.name") == name
    ]


def by_name(spans: Sequence[ReadableSpan], span_name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == span_name]


def test_acquire_wait_and_release_are_spans(lease_backend: str, lease_name: str) -> None:
    first = acquire(lease_name, ttl=10, backend=lease_backend, keepalive=False)
    releasing = threading.Timer(0.2, first.release)
    releasing.start()
    second = acquire(lease_name, ttl=10, backend=lease_backend, timeout=20, holder="contender")
    second.release()
    # The release's span ends after its reply; the waiter it let in can acquire and release
    # before the releasing thread gets to end it (seen on a loaded machine).
    releasing.join()

    spans = spans_of(lease_name)
    acquires, waits = by_name(spans, "leases.acquire"), by_name(spans, "leases.wait")
    releases = by_name(spans, "leases.release")
    assert [s.attributes["leases.token"] for s in acquires] == [first.token, second.token]  # type: ignore[index]
    assert {s.attributes["leases.outcome"] for s in acquires} == {"acquired"}  # type: ignore[index]
    assert {s.instrumentation_scope.name for s in spans} == {INSTRUMENTATION_NAME}  # type: ignore[union-attr]
    (wait,) = waits  # only the second acquire waited, inside its acquire span
    assert wait.parent is not None and acquires[1].context is not None
    assert wait.parent.span_id == acquires[1].context.span_id
    assert wait.end_time is not None and wait.start_time is not None
    assert (wait.end_time - wait.start_time) / 1e9 >= 0.15
    released = {s.attributes["leases.token"] for s in releases}  # type: ignore[index]
    assert released == {first.token, second.token}
    assert all(s.attributes["leases.backend"] == lease_backend for s in spans)  # type: ignore[index]
    assert all(s.status.status_code is StatusCode.UNSET for s in spans)


def test_an_unavailable_lease_is_an_outcome_not_an_error(
    lease_backend: str, lease_name: str
) -> None:
    held = acquire(lease_name, ttl=10, backend=lease_backend, keepalive=False)
    try:
        with pytest.raises(LeaseUnavailable):
            acquire(lease_name, ttl=10, backend=lease_backend, timeout=0.2, holder="contender")
    finally:
        held.release()
    acquires = by_name(spans_of(lease_name), "leases.acquire")
    (refused,) = [s for s in acquires if s.attributes and "leases.token" not in s.attributes]
    assert refused.attributes is not None and refused.attributes["leases.outcome"] == "unavailable"
    assert refused.status.status_code is StatusCode.UNSET
    (wait,) = by_name(spans_of(lease_name), "leases.wait")
    assert wait.attributes is not None and wait.attributes["leases.outcome"] == "unavailable"


def test_an_unreachable_store_is_an_error_span(closed_port_backend: str) -> None:
    name = "tracing-unreachable"
    with pytest.raises(BackendUnavailable):
        acquire(name, ttl=5, backend=closed_port_backend, timeout=0)
    (failed,) = by_name(spans_of(name), "leases.acquire")
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes is not None and failed.attributes["leases.outcome"] == "error"
    assert [event.name for event in failed.events] == ["exception"]


def test_async_acquires_and_slots_are_the_same_spans(lease_backend: str, lease_name: str) -> None:
    """``aacquire`` and ``aacquire_slot`` trace as ``acquire`` and ``acquire_slot`` do: an
    acquire span each (a slot's with its limit, a timed-out one as unavailable), and a wait
    span inside the acquire span of an ``aacquire`` that waited."""
    held = acquire_slot(lease_name, limit=1, ttl=10, backend=lease_backend, holder="h")

    async def main() -> None:
        with pytest.raises(LeaseUnavailable):
            await aacquire_slot(lease_name, limit=1, backend=lease_backend, timeout=0.2)
        held.release()
        slot = await aacquire_slot(lease_name, limit=1, ttl=10, backend=lease_backend)
        await slot.arelease()
        first = await aacquire(lease_name, ttl=10, backend=lease_backend, keepalive=False)
        asyncio.get_running_loop().call_later(0.2, lambda: asyncio.ensure_future(first.arelease()))
        second = await aacquire(lease_name, ttl=10, backend=lease_backend, timeout=20, holder="c")
        await second.arelease()

    arun(lease_backend, main)
    acquires = by_name(spans_of(lease_name), "leases.acquire")
    attributes = [dict(s.attributes or {}) for s in acquires]
    seen = [(a.get("leases.outcome"), a.get("leases.limit")) for a in attributes]
    assert seen == [
        ("acquired", 1),
        ("unavailable", 1),
        ("acquired", 1),
        ("acquired", None),
        ("acquired", None),
    ], seen
    (wait,) = by_name(spans_of(lease_name), "leases.wait")
    assert wait.parent is not None and acquires[-1].context is not None
    assert wait.parent.span_id == acquires[-1].context.span_id


_QUIET_UNTIL_SET = """
import sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from leases import tracing

def recording():
    with tracing.span("leases.acquire", {"leases.name": "n"}) as current:
        return current is not None and current.is_recording()

if sys.argv[1] == "named":  # the environment names the SDK's: the API loads it on first get
    assert recording()
    sys.exit(0)
assert tracing.span("leases.acquire", {}) is tracing.NO_SPAN  # no provider yet: silent
assert tracing.span("leases.acquire", {}) is tracing.NO_SPAN  # ...and looked up again
if sys.argv[1] == "noop":
    trace.set_tracer_provider(trace.NoOpTracerProvider())
    assert tracing.span("leases.acquire", {}) is tracing.NO_SPAN
else:
    trace.set_tracer_provider(TracerProvider())
    assert recording()
"""


@pytest.mark.parametrize("provider", ["sdk", "noop", "named"])
def test_spans_start_once_a_recording_provider_is_set(python: str, provider: str) -> None:
    """A process starts spans from the moment a recording provider is set, however many
    acquires found none before (each looks again), and never for the API's no-op provider. In
    a fresh process: the global provider can be set only once. With
    ``OTEL_PYTHON_TRACER_PROVIDER`` naming one (``named``), spans record from the first."""
    env = {k: v for k, v in os.environ.items() if k != "OTEL_PYTHON_TRACER_PROVIDER"}
    if provider == "named":
        env["OTEL_PYTHON_TRACER_PROVIDER"] = "sdk_tracer_provider"
    done = subprocess.run(
        [python, "-c", _QUIET_UNTIL_SET, provider],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
