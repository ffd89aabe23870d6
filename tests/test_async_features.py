"""The async twins beyond the lease itself: ``aelect``, fenced ``aupdate``/``asave`` after a
blocked loop, and ``async with idempotency_key(...)``."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections, transaction

from idempotency import idempotency_key
from leases import LeaseLost, StaleFencingToken, aacquire, aelect, leader_of
from leases.backends import get_backend
from tests.lease_backends import lease_backend, lease_name
from tests.testapp.models_fencing import FencedRegister
from tests.testapp.models_idempotency import Charge

__all__ = ["lease_backend", "lease_name"]  # fixtures, re-exported for pytest


def test_aelect_leads_until_aresign(lease_backend: str, lease_name: str) -> None:
    async def main() -> None:
        async with await aelect(lease_name, ttl=2, backend=lease_backend) as leadership:
            assert leadership.is_leader
            leader = leader_of(lease_name, backend=lease_backend)
            assert leader is not None and leader.token == leadership.token
        assert leadership.lost.is_set() and not leadership.is_leader
        assert leader_of(lease_name, backend=lease_backend) is None
        await get_backend(lease_backend).aclose()

    asyncio.run(main())


def test_a_fenced_write_after_a_blocked_loop_is_rejected(
    transactional_db: None, lease_name: str
) -> None:
    """The loop sleeps past the validity while a successor takes the lease and writes: the
    paused holder's ``asave`` fails on its own clock, and a raw token write at the fence."""

    async def main() -> None:
        held = await aacquire(lease_name, ttl=0.6, keepalive=False)
        time.sleep(1.0)  # blocked loop: the lease runs out meanwhile
        successor = await aacquire(lease_name, ttl=5, holder="successor")
        await FencedRegister(name=lease_name, value="new").asave(fence=successor)
        with pytest.raises(LeaseLost):
            await FencedRegister(name=lease_name, value="old").asave(fence=held)
        with pytest.raises(StaleFencingToken):
            rows = FencedRegister.objects.filter(name=lease_name)
            await rows.fenced(held.token).aupdate(value="old")
        assert await rows.fenced(successor).aupdate(value="newer") == 1
        await successor.arelease()
        await get_backend("default").aclose()
        await sync_to_async(connections.close_all)()  # the ORM's worker thread's connection

    asyncio.run(main())
    row = FencedRegister.objects.get(name=lease_name)
    assert row.value == "newer"


def test_async_idempotency_key_runs_once(transactional_db: None, lease_name: str) -> None:
    calls: list[int] = []

    @idempotency_key(lambda amount: f"{lease_name}-{amount}", scope="aio-tests")
    async def charge(amount: int) -> int:
        calls.append(amount)
        made = await Charge.objects.acreate(amount=amount, key=lease_name)
        return int(made.pk)

    async def main() -> tuple[list[int], int]:
        async with idempotency_key(lease_name, scope="aio-tests") as op:
            assert not op.replayed
            op.result = {"done": True}
        async with idempotency_key(lease_name, scope="aio-tests") as again:
            assert again.replayed and again.result == {"done": True}
        results = [await charge(5), await charge(5)]
        await sync_to_async(connections.close_all)()  # the ORM's worker thread's connection
        return results, len(calls)

    results, ran = asyncio.run(main())
    assert results[0] == results[1] and ran == 1
    assert Charge.objects.filter(key=lease_name).count() == 1


def test_a_request_cancelled_while_its_key_is_claimed_leaves_the_key_free(
    transactional_db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ASGI a client that goes away cancels its request's task. Cancelled while its key
    was being claimed (a thread runs the claim, and goes on), the key was claimed for
    nobody: no view ran, nothing gave the key up, and the client's retries got 409 until
    ``LOCK_TIMEOUT``. The claim is given up once the thread is done with it."""
    from django.contrib.auth.models import AnonymousUser
    from django.contrib.sessions.backends.db import SessionStore
    from django.http import HttpRequest, JsonResponse
    from django.test import RequestFactory

    from idempotency import idempotent, views

    ran: list[str] = []

    @idempotent
    async def view(request: HttpRequest) -> JsonResponse:
        ran.append("view")
        return JsonResponse({"ok": True}, status=201)

    claimed, cancelled = threading.Event(), threading.Event()
    real_open = views._Guard.open

    def open_until_cancelled(self: Any, *args: Any, **kwargs: Any) -> Any:
        opened = real_open(self, *args, **kwargs)
        claimed.set()
        assert cancelled.wait(10)  # the client goes away while the claim is in hand
        return opened

    session = SessionStore()
    session.create()

    def request() -> HttpRequest:
        made = RequestFactory().post(
            "/", b"{}", content_type="application/json", HTTP_IDEMPOTENCY_KEY="gone-1"
        )
        made.session, made.user = session, AnonymousUser()
        return made

    async def cancelled_request() -> None:
        task = asyncio.ensure_future(view(request()))
        await asyncio.to_thread(claimed.wait, 10)
        task.cancel()
        cancelled.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    monkeypatch.setattr(views._Guard, "open", open_until_cancelled)
    asyncio.run(cancelled_request())
    monkeypatch.undo()
    retried: list[Any] = []
    retry = threading.Thread(target=lambda: retried.append(asyncio.run(view(request()))))
    retry.daemon = True
    retry.start()
    retry.join(30)
    assert retried, "the retry did not finish: the key's claim was still open"
    assert retried[0].status_code == 201 and ran == ["view"]


def _connection_state() -> tuple[bool, bool]:
    db = connections["default"]
    return db.in_atomic_block, db.get_autocommit()


def _close_thread_connection() -> None:
    """Hygiene for a failure: roll back blocks a leaked attempt left open, then close."""
    db = connections["default"]
    while db.atomic_blocks:
        transaction.set_rollback(True)
        db.atomic_blocks[-1].__exit__(None, None, None)
    db.close()


@pytest.mark.parametrize("in_transaction", [False, True], ids=["row", "in_transaction"])
def test_a_task_cancelled_while_its_operation_claims_leaves_nothing_behind(
    transactional_db: None, monkeypatch: pytest.MonkeyPatch, in_transaction: bool
) -> None:
    """``async with idempotency_key(...)`` cancelled while its claim ran in the ORM's thread
    (asyncio.timeout, a client gone away) lost the operation, but the thread went on: the
    key stayed started until its lock lapsed (claimed in the transaction, its advisory lock
    stayed for the connection's life), and the attempt's atomic block stayed open on the
    connection, under every later write of the thread, which never committed."""
    from idempotency import IdempotencyKeyInProgress, store

    claimed, cancelled = threading.Event(), threading.Event()
    real_begin = store.begin

    def begin_until_cancelled(*args: Any, **kwargs: Any) -> Any:
        begun = real_begin(*args, **kwargs)
        claimed.set()
        assert cancelled.wait(10)  # the task is cancelled while the claim is in hand
        return begun

    def retry_elsewhere() -> tuple[str, int]:
        try:
            with idempotency_key("cut", scope="aio-tests", claim_in_transaction=in_transaction):
                pass
            return "ran", Charge.objects.count()
        except IdempotencyKeyInProgress:
            return "in progress", Charge.objects.count()
        finally:
            connections.close_all()

    async def main() -> tuple[tuple[bool, bool], tuple[str, int]]:
        once = idempotency_key("cut", scope="aio-tests", claim_in_transaction=in_transaction)
        task = asyncio.ensure_future(once.__aenter__())
        try:
            await asyncio.to_thread(claimed.wait, 10)
            task.cancel()
            cancelled.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            state = await sync_to_async(_connection_state)()
            await Charge.objects.acreate(amount=7)  # a later write of the thread
            return state, await asyncio.to_thread(retry_elsewhere)
        finally:
            await sync_to_async(_close_thread_connection)()

    monkeypatch.setattr(store, "begin", begin_until_cancelled)
    state, retried = asyncio.run(main())
    assert state == (False, True), "the cancelled claim left its block open on the connection"
    assert retried == ("ran", 1)
