"""The admin section: who may see locks, who may take them away, and the audit it leaves."""

from __future__ import annotations

import html
import json
import re
import socket
import time
from typing import Any, cast

import pytest
from django.contrib.auth.models import Permission
from django.test import Client, override_settings
from django.urls import reverse

from leases._asking import ANSWER_BOUND
from leases.backends import get_backend
from leases.models import ForceRelease
from leases.operations import advisory_locks
from tests.factories import StaffUserFactory, UserFactory
from tests.locks_fixture import LockScene, lock_scene_fixture  # noqa: F401 - fixture

LEASES = reverse("admin:leases_lease_changelist")
ADVISORY = reverse("admin:leases_advisorylock_changelist")
EVERY_BACKEND = reverse("admin:leases_backendlease_changelist")


def login(client: Client, *codenames: str, staff: bool = True) -> Any:
    factory: Any = StaffUserFactory if staff else UserFactory
    user = factory()
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client.force_login(user)
    return user


RELEASE = reverse("admin:leases_backendlease_release")


def force_release_action(client: Client, name: str) -> Any:
    """Choose the action on the changelist: it only shows the confirmation page."""
    data = {"action": "force_release", "_selected_action": [name], "index": "0"}
    return client.post(LEASES, data, follow=True)


def confirm_release(client: Client, backend: str, name: str, token: int) -> Any:
    target = json.dumps([backend, name, token])
    data = {"confirm": "yes", "target": [target], "next": LEASES}
    return client.post(RELEASE, data, follow=True)


@pytest.mark.parametrize("page", [LEASES, ADVISORY, EVERY_BACKEND])
def test_non_staff_is_sent_to_the_login_page(
    client: Client, lock_scene: LockScene, page: str
) -> None:
    login(client, "view_lease", "force_release_lease", staff=False)
    response = client.get(page)
    assert response.status_code == 302 and "/login/" in response["Location"]


@pytest.mark.django_db
@pytest.mark.parametrize("page", [LEASES, ADVISORY, EVERY_BACKEND])
def test_staff_without_view_permission_is_refused(client: Client, page: str) -> None:
    login(client)
    assert client.get(page).status_code == 403


def test_staff_with_view_sees_leases_but_cannot_force_release(
    client: Client, lock_scene: LockScene
) -> None:
    login(client, "view_lease")
    page = client.get(LEASES).content.decode()
    assert lock_scene.held in page and "worker-1" in page and "4242" in page
    assert 'value="force_release"' not in page
    force_release_action(client, lock_scene.held)
    info = get_backend().inspect(lock_scene.held)
    assert info is not None and info.held and info.token == lock_scene.tokens[lock_scene.held]
    assert not ForceRelease.objects.exists()


def test_held_and_expired_filters(client: Client, lock_scene: LockScene) -> None:
    login(client, "view_lease")
    held = client.get(LEASES, {"state": "held"}).content.decode()
    expired = client.get(LEASES, {"state": "expired"}).content.decode()
    assert lock_scene.held in held and lock_scene.expired not in held
    assert lock_scene.expired in expired and lock_scene.held not in expired
    searched = client.get(LEASES, {"q": lock_scene.free}).content.decode()
    assert lock_scene.free in searched and lock_scene.held not in searched


def test_force_release_with_permission_revokes_and_is_recorded(
    client: Client, lock_scene: LockScene
) -> None:
    user = login(client, "view_lease", "force_release_lease")
    old = lock_scene.tokens[lock_scene.held]
    confirmation = force_release_action(client, lock_scene.held).content.decode()
    assert "Yes, force-release" in confirmation and lock_scene.held in confirmation
    assert json.dumps(["default", lock_scene.held, old]).replace('"', "&quot;") in confirmation
    assert get_backend().inspect(lock_scene.held).held  # type: ignore[union-attr]  # not yet
    response = confirm_release(client, "default", lock_scene.held, old)
    assert f"token {old} revoked" in response.content.decode()
    info = get_backend().inspect(lock_scene.held)
    assert info is not None and not info.held and info.token > old
    record = ForceRelease.objects.get()
    assert (record.name, record.by, record.via, record.token) == (
        lock_scene.held,
        user,
        "admin",
        old,
    )
    assert record.holder == lock_scene.holder and record.new_token == info.token


def test_every_backend_page_lists_and_releases(client: Client, lock_scene: LockScene) -> None:
    redis = get_backend("redis")
    grant = redis.try_acquire(f"{lock_scene.held}-redis", lock_scene.holder, 300)
    assert grant is not None
    login(client, "view_lease")
    page = client.get(EVERY_BACKEND).content.decode()
    assert lock_scene.held in page and grant.name in page and "force-release" not in page
    for name, state in [(lock_scene.held, "held"), (lock_scene.expired, "expired")]:
        assert f'data-name="{name}">\n<td>{name}</td><td class="state">{state}</td>' in page
    seen: dict[str, str | int] = {"name": grant.name, "backend": "redis", "token": grant.token}
    assert client.get(RELEASE, seen).status_code == 403
    target = json.dumps(["redis", grant.name, grant.token])
    assert client.post(RELEASE, {"confirm": "yes", "target": [target]}).status_code == 403

    login(client, "view_lease", "force_release_lease")
    page = client.get(EVERY_BACKEND).content.decode()
    assert "force-release" in page and f'name="token" value="{grant.token}"' in page
    confirmation = client.get(RELEASE, seen).content.decode()
    assert "Yes, force-release" in confirmation and grant.name in confirmation
    assert redis.inspect(grant.name).held  # type: ignore[union-attr]  # a GET changes nothing
    client.post(RELEASE, {"confirm": "yes", "target": [target]})
    info = redis.inspect(grant.name)
    assert info is not None and not info.held and info.token > grant.token
    record = ForceRelease.objects.get(name=grant.name)
    assert (record.backend, record.via, record.token) == ("redis", "admin", grant.token)


def test_every_backend_page_shows_stores_that_do_not_answer_as_unreachable(
    client: Client, lock_scene: LockScene, silent: socket.socket
) -> None:
    """An etcd and a ZooKeeper that never answer, whose own timeouts (30 s and 8 s) are far
    above the page's bound: backends are asked at once, so the page comes back in about the
    bound, not after the sum of their timeouts, and shows both unreachable beside the leases of
    the backend that answered. (ZooKeeper's is shorter only because closing its backend at the
    end waits for a client still starting.)"""
    hung, silent_port = 30.0, silent.getsockname()[1]
    backends = {
        "default": {"ENGINE": "leases.backends.database"},
        "etcd-down": {
            "ENGINE": "leases.backends.etcd",
            "ENDPOINTS": [f"http://127.0.0.1:{silent_port}"],
            "CONNECT_TIMEOUT": hung,
            "REQUEST_TIMEOUT": hung,
        },
        "zookeeper-down": {
            "ENGINE": "leases.backends.zookeeper",
            "HOSTS": f"127.0.0.1:{silent_port}",
            "CONNECT_TIMEOUT": 8.0,
            "REQUEST_TIMEOUT": 8.0,
        },
    }
    login(client, "view_lease")
    with override_settings(LEASES={"BACKENDS": backends}):
        started = time.monotonic()
        page = client.get(EVERY_BACKEND).content.decode()
        took = time.monotonic() - started
        silent.close()  # the stuck calls end before their backends are closed
    # A bound with slack for a loaded machine, well below one store's own timeout.
    assert took < ANSWER_BOUND + 15, f"the page took {took:.1f}s"
    assert lock_scene.held in page
    for alias in ("etcd-down", "zookeeper-down"):
        assert f"Backend {alias}: lease backend &#x27;{alias}&#x27; is unavailable" in page
    assert page.count(f"unreachable: no answer within {ANSWER_BOUND:g}s") == 2


def test_advisory_page_shows_names_holders_and_waiters(
    client: Client, lock_scene: LockScene
) -> None:
    login(client, "view_lease")
    page = client.get(ADVISORY).content.decode()
    assert lock_scene.advisory in page and "WAITING" in page and "lock-waiter" in page
    assert "terminate session" not in page
    terminate = reverse("admin:leases_advisorylock_terminate", args=[lock_scene.holder_pid])
    assert client.get(terminate).status_code == 403
    assert client.post(terminate, {"confirm": "yes"}).status_code == 403


def test_terminate_needs_its_own_permission_and_a_confirmation(
    client: Client, lock_scene: LockScene
) -> None:
    login(client, "view_lease", "force_release_lease")
    terminate = reverse("admin:leases_advisorylock_terminate", args=[lock_scene.holder_pid])
    assert client.post(terminate, {"confirm": "yes"}).status_code == 403

    user = login(client, "view_lease", "terminate_lock_session")
    confirmation = client.get(terminate).content.decode()
    assert f"Yes, terminate session {lock_scene.holder_pid}" in confirmation
    assert any(row.pid == lock_scene.holder_pid for row in advisory_locks())  # not yet
    client.post(terminate, {"confirm": "yes", "started": shown_start(confirmation)})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = advisory_locks()
        if not any(row.pid == lock_scene.holder_pid for row in rows):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the terminated session still holds its lock")
    record = ForceRelease.objects.get(action="terminate")
    assert record.by == user and lock_scene.advisory in record.name


def test_audit_and_idempotency_links_on_every_page(client: Client, lock_scene: LockScene) -> None:
    login(client, "view_lease")
    for page in (LEASES, ADVISORY, EVERY_BACKEND):
        content = client.get(page).content.decode()
        assert reverse("admin:leases_forcerelease_changelist") in content
        assert "Idempotency keys" in content or "idempotency" not in _registered_apps()


def _registered_apps() -> set[str]:
    from django.contrib import admin

    return {model._meta.app_label for model in admin.site._registry}


def test_a_confirmed_release_of_a_lease_that_changed_hands_releases_nothing(
    client: Client, lock_scene: LockScene
) -> None:
    """The page showed token N; by the click a successor holds N+1: it must be left alone."""
    store = get_backend()
    name = f"{lock_scene.held}-handover"
    seen = store.try_acquire(name, "first-holder", 300)
    assert seen is not None
    login(client, "view_lease", "force_release_lease")
    confirmation = client.get(
        RELEASE,
        cast("dict[str, str | int]", {"name": name, "backend": "default", "token": seen.token}),
    ).content.decode()
    assert "Yes, force-release" in confirmation
    store.release(seen)
    successor = store.try_acquire(name, "successor", 300)
    assert successor is not None
    changed = client.get(
        RELEASE,
        cast("dict[str, str | int]", {"name": name, "backend": "default", "token": seen.token}),
    ).content.decode()
    assert "changed:" in changed and "it will be left alone" in changed
    response = confirm_release(client, "default", name, seen.token).content.decode()
    assert f"now {successor.token}, not {seen.token}" in response
    info = store.inspect(name)
    assert info is not None and info.held and info.token == successor.token
    assert not ForceRelease.objects.filter(name=name).exists()
    store.release(successor)


@pytest.mark.parametrize(
    "target",
    [
        '["default", "x"]',
        "not json",
        '["nope", "x", 1]',
        '["default", "x", "1"]',
        # An unhashable backend: a 500 (TypeError), not a refusal.
        '[["default"], "x", 1]',
        '[{"a": 1}, "x", 1]',
    ],
)
def test_malformed_or_unknown_release_targets_are_refused(
    client: Client, lock_scene: LockScene, target: str
) -> None:
    login(client, "view_lease", "force_release_lease")
    response = client.post(RELEASE, {"confirm": "yes", "target": [target]})
    assert response.status_code in (400, 403)
    assert not ForceRelease.objects.exists()


@pytest.mark.django_db(transaction=True, databases=["default", "replica", "other"])
def test_advisory_pages_follow_the_database_the_leases_tables_live_in(
    client: Client, lock_scene: LockScene
) -> None:
    from django.db import connections
    from django.test import override_settings
    from django.test.utils import CaptureQueriesContext

    user = login(client, "view_lease", "terminate_lock_session")
    with override_settings(DATABASE_ROUTERS=["tests.routers.LeasesElsewhereRouter"]):
        with CaptureQueriesContext(connections["other"]) as on_other:
            page = client.get(ADVISORY).content.decode()
        assert any("pg_locks" in q["sql"] for q in on_other.captured_queries)
        assert "Database <code>other</code>" in page and lock_scene.advisory in page
        terminate = reverse("admin:leases_advisorylock_terminate", args=[lock_scene.holder_pid])
        confirmation = client.get(terminate, {"database": "other"}).content.decode()
        assert f"Terminate database session {lock_scene.holder_pid} on &#x27;other&#x27;?" in (
            confirmation
        )
        assert client.get(terminate, {"database": "replica"}).status_code == 403
    assert user is not None


def test_no_page_shows_the_grant_secret_or_its_hash(client: Client, lock_scene: LockScene) -> None:
    """Renew and release need the grant's secret; operators never need it or its hash."""
    from leases.models import Lease

    row = Lease.objects.get(name=lock_scene.held)
    assert row.secret_hash  # the store has it ...
    login(client, "view_lease", "force_release_lease")
    detail = reverse("admin:leases_lease_change", args=[lock_scene.held])
    for page in (LEASES, EVERY_BACKEND, detail):
        content = client.get(page).content.decode()
        assert "secret" not in content.lower()  # ... no page shows it
        assert bytes(row.secret_hash).hex() not in content


@pytest.mark.django_db(transaction=True)
def test_lease_waiters_are_listed_and_their_rooms_labelled(client: Client) -> None:
    """Two waiters for a held lease: the one in the waiting room is next in line, the other
    queues behind it; the advisory page names the room instead of showing a bare key."""
    import threading
    import uuid

    from leases.lease import acquire
    from leases.operations import lease_waiters
    from tests.clusters import etcd_ready, zookeeper_ready
    from tests.waiting import wait_until

    # The every-backend page asks each configured backend; one whose cluster has not started
    # in this worker answers only after its connect timeout, long enough for the queued
    # waiter to leave the room before the page is read. Start them first.
    etcd_ready()
    zookeeper_ready()
    name = f"waited-{uuid.uuid4().hex[:8]}"
    held = acquire(name, ttl=30)
    got: list[Any] = []

    def wait_for_it() -> None:
        from django.db import connection

        try:
            lease = acquire(name, ttl=30, timeout=20, holder=f"waiter-{threading.get_ident()}")
            got.append(lease)
            lease.release()
        finally:
            connection.close()

    waiters = [threading.Thread(target=wait_for_it) for _ in range(2)]
    try:
        for thread in waiters:
            thread.start()
        wait_until(lambda: len(lease_waiters()) == 2, 10, "two waiters in the room's queue")
        rows = lease_waiters()
        assert {row.room_of for row in rows} == {name}
        inside = [row for row in rows if row.granted]
        queued = [row for row in rows if not row.granted]
        assert len(inside) == 1 and len(queued) == 1
        assert inside[0].pid in queued[0].blocked_by

        login(client, "view_lease")
        page = client.get(EVERY_BACKEND).content.decode()
        assert f'<tr class="lease-waiter" data-name="{name}">' in page
        assert "next in line" in page and f"queued behind pid {inside[0].pid}" in page
        assert f'data-name="{name}">\n<td>{name}</td><td class="state">held</td>' in page
        advisory = client.get(ADVISORY).content.decode()
        assert f"waiting room of lease &#x27;{name}&#x27;" in advisory
    finally:
        held.release()
        for thread in waiters:
            thread.join(30)
    assert len(got) == 2


def test_the_confirmation_of_more_leases_than_a_form_may_carry_fields_releases_them_all(
    client: Client, lock_scene: LockScene
) -> None:
    """Past ``DATA_UPLOAD_MAX_NUMBER_FIELDS`` (1,000) leases, the confirmation page's one
    hidden field per lease made Django refuse the confirmed POST (400): the page offered a
    release it could not do. The targets now travel in one field."""
    store = get_backend()
    names = [f"{lock_scene.held}-bulk-{i}" for i in range(12)]
    grants = [store.try_acquire(name, "bulk-holder", 300) for name in names]
    assert all(grants)
    login(client, "view_lease", "force_release_lease")
    data = {"action": "force_release", "_selected_action": names, "index": "0"}
    page = client.post(LEASES, data)
    assert page.status_code == 200 and page.content.decode().count('"release-target"') == 12
    form = re.search(r'name="targets" value="([^"]*)"', page.content.decode())
    assert form is not None
    fields = {"confirm": "yes", "targets": html.unescape(form[1]), "next": LEASES}
    with override_settings(DATA_UPLOAD_MAX_NUMBER_FIELDS=10):  # 12 leases, 4 fields
        done = client.post(RELEASE, fields)
    assert done.status_code == 302
    assert ForceRelease.objects.filter(name__in=names).count() == 12
    assert not any(info is not None and info.held for info in map(store.inspect, names))


@pytest.mark.django_db(transaction=True)
def test_the_pages_of_proxy_models_have_no_per_object_views(client: Client) -> None:
    """The "Leases on every backend" page (a proxy of the lease table) had Django's change page
    reachable by URL with the view permission, showing a shared lease's raw ``meta``: its
    readers' secret hashes. Only each page's own views are routed now."""
    import hashlib
    import uuid

    from leases import lease

    login(client, "view_lease")
    name = f"admin-proxy-{uuid.uuid4().hex[:8]}"
    with lease(name, ttl=30, keepalive=False, shared=True) as reader:
        reader_hash = hashlib.sha256(str(reader.grant.secret).encode()).hexdigest()
        for model in ("backendlease", "advisorylock"):
            for view in ("change", "history", "delete"):
                page = client.get(f"/admin/leases/{model}/{name}/{view}/")
                assert page.status_code == 404, (model, view)
                assert reader_hash not in page.content.decode()
            assert client.get(reverse(f"admin:leases_{model}_changelist")).status_code == 200


@pytest.mark.django_db(transaction=True)
def test_a_leases_page_shows_no_secret_hash_and_refuses_filters_on_one(client: Client) -> None:
    """A shared lease's change page showed its readers' secret hashes (its ``meta`` raw, while
    listings hide them), and ``?secret_hash=...`` reached the database adapter: a 500."""
    import hashlib
    import uuid

    from leases import lease

    login(client, "view_lease")
    name = f"admin-shared-{uuid.uuid4().hex[:8]}"
    with lease(name, ttl=30, keepalive=False, shared=True) as reader:
        reader_hash = hashlib.sha256(str(reader.grant.secret).encode()).hexdigest()
        page = client.get(reverse("admin:leases_lease_change", args=[name]))
        assert page.status_code == 200 and reader_hash not in page.content.decode()
        assert "readers" in page.content.decode()  # what is public of them is shown
        for lookup in ("secret_hash", "secret_hash__isnull", "meta__readers__icontains"):
            assert client.get(LEASES, {lookup: "x"}).status_code == 400, lookup


@pytest.mark.django_db(transaction=True)
def test_a_lease_expiring_past_the_year_9999_is_listed_and_clamped_by_migrating(
    client: Client,
) -> None:
    """A row expiring past the year 9999 (a TTL before TTLs were capped; a direct backend call
    with ``ttl=1e12`` still commits one before failing to read it back) made the "Leases"
    changelist and change page answer 500: psycopg cannot load the date. Every ORM read now
    clamps it, and migration 0008 brings stored ones within the cap; a sane expiry is kept."""
    import uuid

    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    from leases.models import Lease

    store = get_backend("default")
    far, sane = (f"admin-{kind}-{uuid.uuid4().hex[:8]}" for kind in ("far", "sane"))
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO leases_lease (name, holder, token, acquired_at, expires_at, meta)"
            " VALUES (%s, 'old@host:1:2:abcd', 7, clock_timestamp(),"
            " clock_timestamp() + make_interval(secs => 1e12), '{}')",
            [far],
        )
    kept = store.try_acquire(sane, "new@host:1:2:abcd", 60)
    assert kept is not None
    login(client, "view_lease")
    client.raise_request_exception = False
    assert far in client.get(LEASES, {"q": far}).content.decode()
    assert client.get(reverse("admin:leases_lease_change", args=[far])).status_code == 200
    expires = Lease.objects.get(name=far).expires_at
    assert expires is not None and expires.year == 9999

    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("leases")
    executor.migrate([("leases", "0007_lease_holder_cover_index")])
    MigrationExecutor(connection).migrate(latest)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT name, expires_at FROM leases_lease WHERE name IN (%s, %s)", [far, sane]
        )
        stored = dict(cursor.fetchall())
    assert stored[far].year < 9999
    assert stored[sane] == kept.expires_at
    info = store.inspect(far)
    assert info is not None and info.held and info.token == 7


@pytest.mark.django_db(transaction=True)
def test_a_shared_lease_is_shown_as_its_readers_not_the_groups_internal_holder(
    client: Client,
) -> None:
    """A group of readers is stored under an internal holder (U+241F, ``shared``) that is
    nobody's identity: every page showed it as the holder. They say how many readers hold the
    name where the page reads them (the lease table's ``meta``), and the audit names them."""
    import uuid

    from leases import acquire

    login(client, "view_lease", "force_release_lease")
    name = f"admin-readers-{uuid.uuid4().hex[:8]}"
    readers = [
        acquire(name, ttl=30, holder=f"reader-{i}", shared=True, keepalive=False) for i in (1, 2)
    ]
    pages = {
        "table": client.get(LEASES, {"q": name}).content.decode(),
        "every backend": client.get(EVERY_BACKEND).content.decode(),
        "confirmation": force_release_action(client, name).content.decode(),
    }
    # The every-backend page lists other tests' leases too (semaphore slots' names contain
    # U+241F): only this name's rows count there.
    pages["every backend"] = "".join(
        row for row in pages["every backend"].split("<tr") if name in row
    )
    for page, text in pages.items():
        assert "\u241f" not in text and "&#9247;" not in text.lower(), page
    assert "shared (2 readers)" in pages["table"]
    assert "shared (readers)" in pages["every backend"]  # the listing reads no meta
    assert "held by shared (2 readers)" in pages["confirmation"]
    confirm_release(client, "default", name, readers[1].token)
    record = ForceRelease.objects.get(name=name)
    assert record.holder == "shared (2 readers: reader-1, reader-2)"


@pytest.mark.django_db(transaction=True)
def test_the_confirmation_shows_a_holder_given_explicitly_as_it_is(client: Client) -> None:
    """A holder that is not ``acquire()``'s identity had parts it does not have filled in:
    ``held by nightly job (pid ?, no label)``."""
    import uuid

    from leases import acquire

    login(client, "view_lease", "force_release_lease")
    held = acquire(f"admin-custom-{uuid.uuid4().hex[:8]}", ttl=30, holder="nightly job")
    try:
        page = force_release_action(client, held.name).content.decode()
        assert "held by nightly job\n" in page and "pid ?" not in page
    finally:
        held.release()


def test_a_force_release_of_more_leases_than_the_limit_is_refused_whole(
    client: Client, lock_scene: LockScene, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Select all" over a table of every name ever used asked for a confirmation page (an
    ``inspect`` per lease) and then a release of each (several round trips each) in one
    request, however many: thousands timed out half-way. Past ``FORCE_RELEASE_LIMIT`` leases
    the action and a confirmed POST say so and release nothing."""
    from leases import admin as leases_admin

    monkeypatch.setattr(leases_admin, "FORCE_RELEASE_LIMIT", 3)
    store = get_backend()
    names = [f"{lock_scene.held}-many-{i}" for i in range(4)]
    grants = [store.try_acquire(name, "many-holder", 300) for name in names]
    assert all(grants)
    login(client, "view_lease", "force_release_lease")
    every = {"action": "force_release", "_selected_action": names[:1], "select_across": "1"}
    for data in (every, {"action": "force_release", "_selected_action": names}):
        page = client.post(LEASES, data, follow=True).content.decode()
        assert '"release-target"' not in page
        assert "at most 3 leases at a time" in page, page
    targets = json.dumps([["default", g.name, g.token] for g in grants if g is not None])
    done = client.post(RELEASE, {"confirm": "yes", "targets": targets, "next": LEASES}, follow=True)
    assert "at most 3 leases at a time" in done.content.decode()
    assert all(info is not None and info.held for info in map(store.inspect, names))
    assert not ForceRelease.objects.exists()
    three = {"action": "force_release", "_selected_action": names[:3]}
    assert client.post(LEASES, three).content.decode().count('"release-target"') == 3


def shown_start(confirmation: str) -> str:
    """The start of the session a terminate confirmation page shows (its form sends it)."""
    shown = re.search(r'name="started" value="([^"]+)"', confirmation)
    assert shown is not None, confirmation
    return html.unescape(shown[1])


def test_a_confirmed_terminate_ends_only_the_session_the_page_showed(
    client: Client, lock_scene: LockScene
) -> None:
    """The confirmation named the session by pid alone: if it ended and the server gave its pid
    to a new session holding an advisory lock before the operator clicked, the new one was
    terminated. The page names the session's start too, and the termination checks both in
    its one statement; a session that started at another moment is left alone."""
    from datetime import datetime, timedelta

    login(client, "view_lease", "terminate_lock_session")
    pid = lock_scene.holder_pid
    terminate = reverse("admin:leases_advisorylock_terminate", args=[pid])
    started = datetime.fromisoformat(shown_start(client.get(terminate).content.decode()))
    other = (started - timedelta(microseconds=1)).isoformat()  # the pid's previous session
    done = client.post(terminate, {"confirm": "yes", "started": other}, follow=True)
    assert "not terminated" in done.content.decode()
    assert any(row.pid == pid for row in advisory_locks())
    assert not ForceRelease.objects.exists()
    assert client.post(terminate, {"confirm": "yes"}).status_code == 400  # no start: no guess
    client.post(terminate, {"confirm": "yes", "started": started.isoformat()})
    assert ForceRelease.objects.filter(action="terminate").count() == 1
