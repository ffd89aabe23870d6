"""Fencing with real leases, on every lease backend: the lease is checked, the token decides."""

from __future__ import annotations

import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from leases import LeaseLost, StaleFencingToken, acquire, check_fence
from leases.lease import Lease
from tests.checker import check_history, history, new_register, record_write
from tests.lease_backends import lease_backend, lease_name
from tests.testapp.models_fencing import FencedDoc

__all__ = ["lease_backend", "lease_name"]  # fixtures, re-exported for pytest


def wait_expired(held: Lease, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while held.remaining() > 0 and time.monotonic() < deadline:
        time.sleep(0.02)


def test_fenced_save_with_a_held_lease_writes_its_token(
    lease_backend: str, lease_name: str
) -> None:
    held = acquire(lease_name, ttl=5, backend=lease_backend)
    try:
        doc = FencedDoc(title="by lease")
        doc.save(fence=held)
        doc.title = "again"
        doc.save(fence=held)
        doc.refresh_from_db()
        assert (doc.title, doc.fencing_token) == ("again", held.token)
        assert FencedDoc.objects.filter(pk=doc.pk).fenced(held).update(body="b") == 1
        assert check_fence(f"file:{lease_name}", held) == held.token
    finally:
        held.release()


def test_expired_lease_fails_before_writing_although_nobody_newer_wrote(
    lease_backend: str, lease_name: str
) -> None:
    """The row still holds this lease's own token, so only the lease can refuse the write."""
    held = acquire(lease_name, ttl=0.3, backend=lease_backend, keepalive=False)
    doc = FencedDoc(title="original")
    doc.save(fence=held)
    wait_expired(held)
    doc.title = "unprotected"
    with CaptureQueriesContext(connection) as queries:
        with pytest.raises(LeaseLost):
            doc.save(fence=held)
        with pytest.raises(LeaseLost):
            FencedDoc.objects.fenced(held).update(title="unprotected")
        with pytest.raises(LeaseLost):
            check_fence(f"file:{lease_name}", held)
    assert len(queries) == 0
    doc.refresh_from_db()
    assert doc.title == "original"


def test_released_lease_cannot_fence(lease_backend: str, lease_name: str) -> None:
    held = acquire(lease_name, ttl=5, backend=lease_backend)
    held.release()
    with pytest.raises(LeaseLost):
        FencedDoc(title="after release").save(fence=held)
    assert not FencedDoc.objects.filter(title="after release").exists()


def test_successor_token_rejects_the_predecessor(lease_backend: str, lease_name: str) -> None:
    register = new_register()
    first = acquire(lease_name, ttl=0.3, backend=lease_backend, keepalive=False)
    assert record_write(register, first, "first")
    second = acquire(lease_name, ttl=5, backend=lease_backend, timeout=5, holder="successor")
    try:
        assert record_write(register, second, "second")
        assert not record_write(register, first.token, "first")  # the fence refuses
        assert not record_write(register, first, "first")  # the lease already knows
    finally:
        second.release()
    outcomes = [(a.writer, a.outcome) for a in history(register)]
    assert outcomes == [
        ("first", "accepted"),
        ("second", "accepted"),
        ("first", "stale"),
        ("first", "lost"),
    ]
    check_history(register, grants=[first.token, second.token])
    check_fence(f"file:{lease_name}", second.token)
    with pytest.raises(StaleFencingToken):
        check_fence(f"file:{lease_name}", first.token)
