"""Right after PostgreSQL crashes and restarts, the public API raises only ``LeaseError``.

Every connection the package keeps to a server (the database backend's own, the sync and async
waiting rooms' idle and in-use ones, the Redlock token counter's) outlives a restart as a dead
socket. The first call after the restart must either reconnect (the dead session is found by
:func:`~leases.backends._pgconn.stale` before anything is sent) or fail as
:class:`~leases.errors.BackendUnavailable`: a psycopg ``OperationalError`` ("server closed the
connection unexpectedly") reaching the caller would break the API's one error contract, and
code written against it (``except LeaseError``) would crash instead of retrying.

Each cycle opens every kind of connection on a healthy server (a held grant, a room connection
left idle by a waiter that gave up, a waiter blocked in a room, Redlock's counter connection),
restarts the server ``immediate`` (SIGQUIT: a crash, no checkpoint) and at once renews,
releases and acquires through all of them, sync and async. Every outcome must be success or a
``LeaseError``; the tokens of each name, in grant order, must strictly increase across every
restart; and a name just granted must be refused to anyone else (never granted twice).
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.test import override_settings

from leases import LeaseError, LeaseUnavailable, aacquire, acquire, lease
from leases.backends import get_backend
from leases.errors import BackendUnavailable
from leases.handle import Lease
from tests.checker import check_grants
from tests.waiting import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.slow]

DB, REDLOCK = "restarts", "restarts-redlock"
#: Crash/restart cycles, and the wall-clock budget they may take (whichever ends first); at
#: least :data:`MIN_CYCLES` must run for the test to mean anything on a loaded machine.
CYCLES, BUDGET, MIN_CYCLES = 20, 150.0, 5
#: Long enough to outlive a restart on a loaded machine, so a renewal after it has a grant to
#: renew; names left held by a release that failed are freed by force at the next cycle.
TTL = 20.0
#: How long a waiter that is meant to give up waits in its room (its connection then goes
#: back to the room's idle pool, to be found dead after the restart).
GIVE_UP = 0.3


class Outcomes:
    """What every call after a restart did: its kind of outcome, and any that escaped the
    ``LeaseError`` contract (with where it was raised), and each name's tokens in grant order."""

    def __init__(self) -> None:
        self.kinds: Counter[str] = Counter()
        self.escaped: list[str] = []
        #: Why calls failed as ``BackendUnavailable`` (the driver's words), and how often.
        self.unavailable: Counter[str] = Counter()
        self.grants: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def _failed(self, label: str, exc: Exception) -> None:
        with self._lock:
            self.kinds[f"{label}: {type(exc).__name__}"] += 1
            if isinstance(exc, BackendUnavailable):
                self.unavailable[f"{label}: {str(exc).splitlines()[0][:120]}"] += 1
            if not isinstance(exc, LeaseError):
                self.escaped.append(f"{label}: {''.join(traceback.format_exception(exc))}")

    def _succeeded(self, label: str) -> None:
        with self._lock:
            self.kinds[f"{label}: ok"] += 1

    def granted(self, held: Lease) -> None:
        with self._lock:
            self.grants.setdefault(held.name, []).append(held.token)

    def call(self, label: str, call: Callable[[], Any]) -> Any:
        try:
            result = call()
        except Exception as exc:
            self._failed(label, exc)
            return None
        self._succeeded(label)
        return result

    async def acall(self, label: str, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            result = await call()
        except Exception as exc:
            self._failed(label, exc)
            return None
        self._succeeded(label)
        return result


def restart_backends(alias: str, nodes: list[str]) -> dict[str, Any]:
    """The suite's ``LEASES`` plus both backends on the server this test restarts."""
    current: dict[str, Any] = settings.LEASES
    backends: dict[str, Any] = {**current["BACKENDS"]}
    backends[DB] = {"ENGINE": "leases.backends.database", "DATABASE": alias}
    backends[REDLOCK] = {
        "ENGINE": "leases.backends.redlock",
        "NODES": nodes,
        "NODE_TIMEOUT": 0.5,
        "TOKEN_DATABASE": alias,
    }
    return {**current, "BACKENDS": backends}


@pytest.fixture
def restarting(
    fault_database: tuple[str, Any], redis_servers: Any
) -> Iterator[tuple[Any, asyncio.Runner]]:
    """The server to restart, with both backends on it, and one event loop for the whole test
    (so the async connections made before a restart are still there after it)."""
    alias, server = fault_database
    nodes = [node.url for node in redis_servers(3)]
    with override_settings(LEASES=restart_backends(alias, nodes)), asyncio.Runner() as runner:
        try:
            yield server, runner
        finally:
            for used in (DB, REDLOCK):
                runner.run(get_backend(used).aclose())
                get_backend(used).close()


def _free(name: str, backend: str) -> None:
    """Free ``name`` by force if a release lost to the last restart left it held."""
    store = get_backend(backend)
    info = store.inspect(name)
    if info is not None and info.held:
        store.force_release(name, info.token)


def _room_waiters(server: Any) -> int:
    """Sessions holding a room lock: a waiter is inside a room (the hammers never queue)."""
    with psycopg.connect(server.url, autocommit=True, connect_timeout=2) as admin:
        row = admin.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
        ).fetchone()
    return int(row[0]) if row else 0


def _give_up_in_room(name: str, backend: str) -> None:
    """A waiter that queues in ``name``'s room and gives up: its room connection is left idle."""
    with pytest.raises(LeaseUnavailable):
        acquire(name, ttl=TTL, backend=backend, timeout=GIVE_UP, holder="gives-up")


async def _agive_up_in_room(name: str, backend: str) -> None:
    with pytest.raises(LeaseUnavailable):
        await aacquire(name, ttl=TTL, backend=backend, timeout=GIVE_UP, holder="agives-up")


def _acquire_then_check(out: Outcomes, label: str, name: str, backend: str) -> None:
    """Acquire at once; granted, the name must be refused to another holder, then released."""
    held = out.call(
        label, lambda: acquire(name, ttl=TTL, backend=backend, timeout=0, keepalive=False)
    )
    if held is None:
        return
    out.granted(held)
    with pytest.raises(LeaseError):  # never granted twice (refused, or the store is gone)
        acquire(name, ttl=TTL, backend=backend, timeout=0, holder="intruder")
    out.call(f"{label} release", held.release)


async def _aacquire_then_check(out: Outcomes, label: str, name: str, backend: str) -> None:
    """:func:`_acquire_then_check`, awaited."""

    async def take() -> Lease:
        return await aacquire(name, ttl=TTL, backend=backend, timeout=0, keepalive=False)

    held = await out.acall(label, take)
    if held is None:
        return
    out.granted(held)
    with pytest.raises(LeaseError):
        await aacquire(name, ttl=TTL, backend=backend, timeout=0, holder="aintruder")
    await out.acall(f"{label} release", held.arelease)


class Hammer:
    """Calls in flight while the server goes down and comes back: a thread acquiring, renewing
    and releasing one name over and over for the whole test, sync, or async on an event loop of
    its own, so restarts cut statements at every step (mid-grant, mid-renewal, mid-release,
    while connecting) and not only on connections that were idle."""

    #: Short, so a grant whose release was cut off stops blocking the next ones soon.
    TTL = 2.0
    #: A pause between rounds, so a server that is down is not spun on.
    PAUSE = 0.01

    def __init__(self, out: Outcomes, name: str, backend: str, *, asynchronous: bool) -> None:
        self.out, self.name, self.backend = out, name, backend
        self.stop = threading.Event()
        target = self._arun if asynchronous else self._run
        self.thread = threading.Thread(target=target, name=f"hammer-{name}", daemon=True)

    def __enter__(self) -> Hammer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), f"{self.thread.name} hangs"

    def _run(self) -> None:
        label = f"hammer {self.backend}"
        while not self.stop.wait(self.PAUSE):
            held = self.out.call(
                f"{label} acquire",
                lambda: acquire(
                    self.name, ttl=self.TTL, backend=self.backend, timeout=0, keepalive=False
                ),
            )
            if held is not None:
                self.out.granted(held)
                self.out.call(f"{label} renew", held.renew)
                self.out.call(f"{label} release", held.release)

    def _arun(self) -> None:
        asyncio.run(self._amain())

    async def _amain(self) -> None:
        label = f"ahammer {self.backend}"

        async def take() -> Lease:
            return await aacquire(
                self.name, ttl=self.TTL, backend=self.backend, timeout=0, keepalive=False
            )

        try:
            while not self.stop.is_set():
                await asyncio.sleep(self.PAUSE)
                held = await self.out.acall(f"{label} aacquire", take)
                if held is not None:
                    self.out.granted(held)
                    await self.out.acall(f"{label} arenew", held.arenew)
                    await self.out.acall(f"{label} arelease", held.arelease)
        finally:
            await get_backend(self.backend).aclose()


def _cycle(server: Any, runner: asyncio.Runner, out: Outcomes) -> None:
    """One restart between every kind of connection being opened and being used again."""
    names = {"sync": "pc-sync", "async": "pc-async", "rl": "pc-rl", "arl": "pc-arl"}
    for what, name in names.items():
        _free(name, REDLOCK if "rl" in what else DB)
    # Before: a grant on each backend's own connection, sync and async...
    held = acquire(names["sync"], ttl=TTL, backend=DB, keepalive=False)
    out.granted(held)
    aheld: Lease = runner.run(aacquire(names["async"], ttl=TTL, backend=DB, keepalive=False))
    out.granted(aheld)
    rheld = acquire(names["rl"], ttl=TTL, backend=REDLOCK, keepalive=False)
    out.granted(rheld)
    arheld: Lease = runner.run(aacquire(names["arl"], ttl=TTL, backend=REDLOCK, keepalive=False))
    out.granted(arheld)
    # ...idle room connections, sync and async, left by waiters that gave up...
    _give_up_in_room(names["sync"], DB)
    runner.run(_agive_up_in_room(names["async"], DB))
    # ...and a waiter inside the sync room when the server goes.
    waiter = threading.Thread(target=_wait_through_restart, args=(names["sync"], out))
    waiter.start()
    try:
        wait_until(lambda: _room_waiters(server) >= 1, 10, "the waiter to get into the room")
        server.restart("immediate")
        _after_restart(runner, out, names, (held, aheld, rheld, arheld))
    finally:
        waiter.join(timeout=30)
    assert not waiter.is_alive(), "the waiter outlived its own timeout"


def _wait_through_restart(name: str, out: Outcomes) -> None:
    held = out.call(
        "waiter in room", lambda: acquire(name, ttl=TTL, backend=DB, timeout=4, holder="waiter")
    )
    if held is not None:
        out.granted(held)
        out.call("waiter release", held.release)


def _after_restart(
    runner: asyncio.Runner, out: Outcomes, names: dict[str, str], held: tuple[Lease, ...]
) -> None:
    """Every call, at once, on the connections that were open before the restart."""
    sync, aheld, rheld, arheld = held
    out.call("db renew", sync.renew)
    out.call("db release", sync.release)
    _acquire_then_check(out, "db acquire", names["sync"], DB)
    out.call("rl renew", rheld.renew)
    out.call("rl release", rheld.release)
    _acquire_then_check(out, "rl acquire", names["rl"], REDLOCK)

    def with_lease() -> None:
        with lease(names["sync"], ttl=TTL, backend=DB, timeout=0, keepalive=False) as inside:
            out.granted(inside)

    out.call("db lease()", with_lease)

    async def asynchronous() -> None:
        await out.acall("db arenew", aheld.arenew)
        await out.acall("db arelease", aheld.arelease)
        await _aacquire_then_check(out, "db aacquire", names["async"], DB)
        await out.acall("rl arenew", arheld.arenew)
        await out.acall("rl arelease", arheld.arelease)
        await _aacquire_then_check(out, "rl aacquire", names["arl"], REDLOCK)

    runner.run(asynchronous())


def test_calls_right_after_a_restart_raise_only_lease_errors(
    restarting: tuple[Any, asyncio.Runner],
) -> None:
    server, runner = restarting
    out = Outcomes()
    started, cycles = time.monotonic(), 0
    with (
        Hammer(out, "pc-hammer", DB, asynchronous=False),
        Hammer(out, "pc-ahammer", DB, asynchronous=True),
        Hammer(out, "pc-rl-hammer", REDLOCK, asynchronous=False),
        Hammer(out, "pc-rl-ahammer", REDLOCK, asynchronous=True),
    ):
        while cycles < CYCLES and time.monotonic() - started < BUDGET:
            _cycle(server, runner, out)
            cycles += 1
    print(f"{cycles} restarts in {time.monotonic() - started:.1f}s:", sorted(out.kinds.items()))
    print("why unavailable:", sorted(out.unavailable.items()))
    assert not out.escaped, "\n".join(out.escaped)
    assert cycles >= MIN_CYCLES, f"only {cycles} restarts fit in {BUDGET}s"
    for tokens in out.grants.values():
        check_grants(tokens)
