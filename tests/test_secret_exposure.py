"""Where a grant's secret must not show: error reports of a store call that failed while the
grant was still valid, and the objects that carry it (an outside security review, stop 37).
``pg_stat_activity`` is proven in ``tests/test_lease_database_prepared.py``."""

from __future__ import annotations

import copy
import pickle
import sys
import traceback
from typing import Any

import pytest
from django.test import RequestFactory, override_settings
from django.views.debug import technical_500_response

from leases import BackendUnavailable, acquire
from leases.backends import get_backend
from leases.backends._zookeeper_line import Queued
from leases.backends.base import Grant, Secret, new_secret
from leases.election import elect
from leases.semaphore import acquire_slot
from tests.clusters import etcd_ready
from tests.lease_backends import lease_name

__all__ = ["lease_name"]  # fixtures, for pytest

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("backend", ["default", "redis"])
def test_a_failed_renewals_error_report_does_not_show_the_live_secret(
    backend: str, lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renewal timed out (the grant still valid): Django's debug page, HTML error mails
    and ``capture_locals`` tracebacks printed the frames' variables, among them the
    statement's parameters with the secret, ten times on the database backend's page."""
    held = acquire(lease_name, ttl=30, backend=backend, keepalive=False)
    store = get_backend(backend)
    real = type(store)._run  # type: ignore[attr-defined]

    def no_reply(*args: Any, **kwargs: Any) -> Any:
        raise BackendUnavailable(backend, "no reply within 5s (a test's stand-in)")

    monkeypatch.setattr(store, "_run", no_reply)
    try:
        held.renew()
    except BackendUnavailable:
        info = sys.exc_info()
    else:
        pytest.fail("the renewal did not fail")
    monkeypatch.setattr(store, "_run", real.__get__(store))
    assert info[0] is not None
    report = "".join(traceback.TracebackException(*info, capture_locals=True).format())
    with override_settings(DEBUG=True):
        page = technical_500_response(RequestFactory().get("/"), *info).content.decode()
    secret = str(held.grant.secret)  # only now: this frame's variables are in the report too
    assert "params" in report or "args" in report  # the frames' variables are there
    assert secret not in report
    assert secret not in page
    held.release()


def test_the_objects_that_carry_a_secret_do_not_show_it() -> None:
    secret = new_secret()
    assert isinstance(secret, Secret) and str(secret) not in repr({"secret": secret})
    rebuilt = Grant("n", "h", 1, 5.0, 0.0, secret=str(secret))  # from a task's headers
    assert rebuilt.secret == secret and str(secret) not in repr(vars(rebuilt))
    place = Queued("n", "c-1", str(secret), 1, 2)
    assert str(secret) not in repr(place)


def test_an_etcd_grants_lease_id_is_not_shown(lease_name: str) -> None:
    """The etcd lease behind a grant is a handle of its own: a client of the cluster that may
    use leases can keep it alive (a dead holder's lease held on) or look it up with its ID
    alone. ``repr(grant)`` showed it, so every log line or debug page that showed a grant did."""
    etcd_ready()
    held = acquire(lease_name, ttl=30, backend="etcd", keepalive=False)
    try:
        lease_id = str(held.grant.extra["lease"])
        assert lease_id not in repr(held.grant) and lease_id not in repr(held)
    finally:
        held.release()


def test_a_grant_refuses_to_be_pickled_but_copies_in_the_process() -> None:
    """``pickle.dumps(grant)`` carried the secret: a grant put in a cache, a session or a task's
    result handed whoever read it the credential that releases the lease."""
    secret = new_secret()
    grant = Grant("n", "h", 1, 5.0, 0.0, extra={"epoch": [1]}, secret=str(secret))
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        with pytest.raises(TypeError, match="cannot pickle a Grant: it carries the lease's secret"):
            pickle.dumps(grant, protocol)
    assert copy.copy(grant) is grant
    deep = copy.deepcopy(grant)
    assert deep == grant and deep.extra is not grant.extra and isinstance(deep.secret, Secret)


def test_the_handles_that_hold_a_grant_refuse_to_be_pickled_in_its_words(lease_name: str) -> None:
    """A lease, a semaphore's slot and a leadership were refused only by accident, in words
    that said nothing of why ("cannot pickle '_thread.lock' object"); a copy of a lease was
    a second handle of its grant (released, it left the first renewing a grant given back)."""
    held = acquire(lease_name, ttl=30, keepalive=False)
    slot = acquire_slot(f"{lease_name}-slots", limit=2, ttl=30, keepalive=False)
    leadership = elect(f"{lease_name}-election", ttl=30)
    try:
        for handle, kind in ((held, "Lease"), (slot, "Slot"), (leadership, "Leadership")):
            for refused in (pickle.dumps, copy.copy, copy.deepcopy):
                with pytest.raises(TypeError, match=f"cannot pickle or copy a {kind}: it carries"):
                    refused(handle)
    finally:
        held.release()
        slot.release()
        leadership.resign()
