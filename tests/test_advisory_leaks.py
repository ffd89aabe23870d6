"""A session lock left held by a request is released and reported when the request ends.

Django keeps the request's connection (``CONN_MAX_AGE > 0``) or hands it back to its pool
(``OPTIONS={"pool": ...}``), so a lock left on the session would otherwise ride into whichever
request gets the connection next. The views here leak on purpose (a block entered by hand and
never exited); the next request must find the lock free and its own session holding nothing.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import pytest
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished
from django.db import DatabaseError, DataError, close_old_connections, connections, transaction
from django.http import HttpRequest, HttpResponse
from django.test import Client, override_settings
from django.urls import path

from leases import advisory
from leases.errors import LeaseLost, LeaseNotHeld
from tests.advisory_support import free_elsewhere, holders, other_session
from tests.waiting import wait_until

if TYPE_CHECKING:
    from wsgiref.types import StartResponse

    from django.db.backends.postgresql.base import DatabaseWrapper

HELD_ADVISORY_SQL = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
)


def leak(request: HttpRequest, alias: str) -> HttpResponse:
    advisory.session_lock("leaked-by-a-view", using=alias).__enter__()
    return HttpResponse("leaked")


def held_here(request: HttpRequest, alias: str) -> HttpResponse:
    with connections[alias].cursor() as cursor:
        cursor.execute(HELD_ADVISORY_SQL)
        return HttpResponse(str(cursor.fetchone()[0]))


def leak_then_abort(request: HttpRequest, alias: str) -> HttpResponse:
    """A leaked lock whose transaction then failed: the unlock at the end is refused."""
    advisory.session_lock("leaked-then-aborted", using=alias).__enter__()
    transaction.set_autocommit(False, using=alias)
    with contextlib.suppress(DatabaseError), connections[alias].cursor() as cursor:
        cursor.execute("SELECT 1 / 0")
    return HttpResponse("leaked")


def leak_inside_a_shared_block(request: HttpRequest, alias: str) -> HttpResponse:
    """A reader's block that ends, around a writer's lock of the same name left held."""
    with advisory.session_lock("leaked-by-a-view", shared=True, using=alias):
        advisory.session_lock("leaked-by-a-view", using=alias).__enter__()
    return HttpResponse("leaked")


def nested(request: HttpRequest, alias: str) -> HttpResponse:
    """A request that serves another on the same thread and connection before it ends."""
    return HttpResponse(Client().get(f"/held/{alias}").content)


urlpatterns = [
    path("nested/<str:alias>", nested),
    path("leak/<str:alias>", leak),
    path("leak-aborted/<str:alias>", leak_then_abort),
    path("leak-mixed/<str:alias>", leak_inside_a_shared_block),
    path("held/<str:alias>", held_here),
]


def serve(path: str) -> bytes:
    """One GET as a WSGI server makes it: Django's request signals with their real receivers
    (the test ``Client`` keeps connections open on purpose), then ``close()``."""
    environ = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": path,
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(b""),
        "wsgi.errors": io.StringIO(),
    }
    response = WSGIHandler()(environ, cast("StartResponse", lambda status, headers: None))
    try:
        return b"".join(response)
    finally:
        response.close()


def locks_of_a_borrowed_session(alias: str) -> int:
    """How many advisory locks the session another thread gets from ``alias`` holds."""
    box: list[int] = []

    def run() -> None:
        try:
            with connections[alias].cursor() as cursor:
                cursor.execute(HELD_ADVISORY_SQL)
                box.append(int(cursor.fetchone()[0]))
        finally:
            connections[alias].close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert box, "the other thread got no session"
    return box[0]


@pytest.fixture
def reused_alias(
    request: pytest.FixtureRequest, django_db_setup: None, django_db_blocker: Any
) -> Iterator[str]:
    """A database alias whose connections outlive the request: persistent, or pooled."""
    settings = dict(connections.settings["default"])
    if request.param == "pool":
        settings["CONN_MAX_AGE"] = 0
        settings["OPTIONS"] = {
            **settings.get("OPTIONS", {}),
            "pool": {"min_size": 1, "max_size": 1},
        }
    else:
        settings["CONN_MAX_AGE"] = 600
    settings["NAME"] = connections["default"].settings_dict["NAME"]  # the test database
    connections.settings["reused"] = settings
    try:
        with override_settings(ROOT_URLCONF=__name__), django_db_blocker.unblock():
            yield "reused"
    finally:
        with django_db_blocker.unblock():
            connections["reused"].close()
            if request.param == "pool":
                cast("DatabaseWrapper", connections["reused"]).close_pool()  # PostgreSQL's
        del connections["reused"]
        connections.settings.pop("reused", None)


@pytest.mark.parametrize("reused_alias", ["persistent", "pool"], indirect=True)
def test_a_session_lock_left_by_a_request_is_released_and_reported(
    reused_alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="leases.advisory"):
        assert serve(f"/leak/{reused_alias}") == b"leaked"
    record: Any  # a LogRecord, with the event's fields as attributes
    (record,) = [r for r in caplog.records if getattr(r, "event", "") == "advisory_lock_leaked"]
    assert record.locks == ["leaked-by-a-view"] and record.released
    assert free_elsewhere("default", "leaked-by-a-view")
    # The next request gets the kept (or pooled) connection: its session holds nothing.
    assert serve(f"/held/{reused_alias}") == b"0"


@pytest.mark.parametrize("reused_alias", ["persistent"], indirect=True)
def test_the_lock_released_at_the_end_is_the_one_left_not_one_of_its_name(
    reused_alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The shared block's end forgot the exclusive lock's entry (matched by name alone), so
    the end of the request ran the shared unlock (which found nothing), logged "released",
    and the next request on the kept connection inherited the exclusive lock."""
    with caplog.at_level(logging.ERROR, logger="leases.advisory"):
        assert serve(f"/leak-mixed/{reused_alias}") == b"leaked"
    record: Any
    (record,) = [r for r in caplog.records if getattr(r, "event", "") == "advisory_lock_leaked"]
    assert record.locks == ["leaked-by-a-view"] and record.released
    assert free_elsewhere("default", "leaked-by-a-view")
    assert serve(f"/held/{reused_alias}") == b"0"


@pytest.mark.django_db(transaction=True)
def test_a_session_lock_block_that_ends_is_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="leases.advisory"):
        with advisory.session_lock("well-behaved"):
            pass
        request_finished.send(sender=None)
    assert not [r for r in caplog.records if getattr(r, "event", "") == "advisory_lock_leaked"]


@pytest.mark.django_db(transaction=True)
def test_a_session_lock_taken_before_a_request_is_not_the_requests_to_release(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A test, command or task that holds a session lock and then serves a request on the same
    thread and connection (Django's test ``Client``) keeps its lock: only what the request took
    is the request's to release. Found by the built-wheel check, which loads the admin pages
    while it holds a session lock."""
    with (
        caplog.at_level(logging.ERROR, logger="leases.advisory"),
        advisory.session_lock("taken-before") as held,
    ):
        with override_settings(ROOT_URLCONF=__name__):
            assert Client().get("/held/default").content == b"1"
        held.ensure_held()  # still ours, on the same session
    assert not [r for r in caplog.records if getattr(r, "event", "") == "advisory_lock_leaked"]
    assert free_elsewhere("default", "taken-before")


@pytest.mark.django_db(transaction=True)
def test_a_lock_taken_before_nested_requests_is_not_released_by_the_outer_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One "held at the start" count per connection: the inner request overwrote the outer
    one's and its end dropped it, so the outer request's end released (and reported) a lock
    taken before both began, while its block still ran."""
    with (
        caplog.at_level(logging.ERROR, logger="leases.advisory"),
        advisory.session_lock("taken-before-nested") as held,
    ):
        with override_settings(ROOT_URLCONF=__name__):
            assert Client().get("/nested/default").content == b"1"
        held.ensure_held()
    assert not [r for r in caplog.records if getattr(r, "event", "") == "advisory_lock_leaked"]


@pytest.mark.django_db(transaction=True)
def test_a_session_lock_left_by_a_celery_task_is_released_when_the_task_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker keeps its connections between tasks (``CONN_MAX_AGE``, a pool), as a web
    process does between requests, but only requests were swept: a task that leaked a session
    lock left it held for every later task on the worker, and against every other process.
    The task's end now releases what the task took, and only that."""
    from celery import Celery

    app = Celery("leaks", set_as_current=False)

    @app.task(shared=False)
    def leaky() -> None:
        advisory.session_lock("leaked-by-a-task").__enter__()

    with (
        caplog.at_level(logging.ERROR, logger="leases.advisory"),
        other_session() as other,
        advisory.session_lock("held-around-the-task") as around,
    ):
        leaky.apply().get()  # in this thread, on this connection: prerun and postrun fire
        assert holders(other, "leaked-by-a-task") == 0
        around.ensure_held()  # taken before the task: not the task's to release
    leaks = [r for r in caplog.records if getattr(r, "event", "") == "advisory_lock_leaked"]
    assert [cast(Any, r).locks for r in leaks] == [["leaked-by-a-task"]]


@pytest.mark.parametrize("reused_alias", ["pool"], indirect=True)
def test_closing_a_pooled_connection_mid_block_ends_the_session_with_its_lock(
    reused_alias: str,
) -> None:
    """``close_old_connections()`` between units of work, inside a ``session_lock`` block,
    handed the session to the pool with the lock still on it: the next borrower's
    ``session_lock`` of the name was let straight in (re-entrant per session), two holders,
    and neither exit noticed. Now the close ends the session as it does without a pool."""
    with pytest.raises(LeaseNotHeld), advisory.session_lock("pooled", using=reused_alias) as held:
        close_old_connections()  # as Django's docs advise for long-running commands
        with other_session() as other:
            wait_until(lambda: holders(other, "pooled") == 0, 10, "the ended session's lock to go")
        assert locks_of_a_borrowed_session(reused_alias) == 0
        with pytest.raises(LeaseLost):
            held.ensure_held()


@pytest.mark.parametrize("reused_alias", ["pool"], indirect=True)
def test_release_by_closing_in_an_aborted_transaction_ends_a_pooled_session(
    reused_alias: str,
) -> None:
    """The exit "closed the connection to release" the lock its aborted transaction refused
    to unlock; on a pool that close rolled back and pooled the session, lock and all."""
    with (
        pytest.raises(DataError),
        transaction.atomic(using=reused_alias),
        advisory.session_lock("pooled-aborted", using=reused_alias),
        connections[reused_alias].cursor() as cursor,
    ):
        cursor.execute("SELECT 1 / 0")
    with other_session() as other:
        wait_until(lambda: holders(other, "pooled-aborted") == 0, 10, "the lock to go")
    assert locks_of_a_borrowed_session(reused_alias) == 0


@pytest.mark.parametrize("reused_alias", ["pool"], indirect=True)
def test_a_leaked_lock_closed_away_at_request_end_is_gone_from_a_pool(
    reused_alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The end of the request could not unlock (aborted transaction), closed the connection
    and logged the lock released "with the session"; on a pool the session went back to the
    pool with it."""
    with caplog.at_level(logging.ERROR, logger="leases.advisory"):
        assert serve(f"/leak-aborted/{reused_alias}") == b"leaked"
    record: Any
    (record,) = [r for r in caplog.records if getattr(r, "event", "") == "advisory_lock_leaked"]
    assert record.released
    with other_session() as other:
        wait_until(lambda: holders(other, "leaked-then-aborted") == 0, 10, "the lock to go")
    assert serve(f"/held/{reused_alias}") == b"0"
