"""The Redlock backend's async round trips: ``redis.asyncio``, every node asked at once.

One set of node clients per event loop (:class:`~leases.backends._aio.PerLoop`), each with the
connections it keeps between round trips (:class:`~._redis_kept.Kept`, as the async Redis
backend); a request goes to every node concurrently (``asyncio.gather``) and each answer is
bounded by one node timeout, so hung nodes cost a try at most that, however many. A node's
connection that failed, timed out or was cancelled before its reply was read is dropped, so a
late reply is never read as the answer to a later command. Only :mod:`leases.backends.redlock` uses
this module: it is that backend's ``atry_acquire``, ``arenew``, ``arelease`` and
``await_for_release``, deciding with the backend's own quorum and validity rules. The database
statements (a grant's token, a refusal's check of the current token) are awaited on the loop
too, on the token counter's async connection (:meth:`~._counter.DurableCounter.abump_lease`):
no worker thread on any path, except for a custom ``TOKEN_SOURCE``, a plain callable.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol

import redis

from ..errors import LeaseLost, LeaseNotHeld
from ._aio import PerLoop
from ._redis_conn import Script, pack
from ._redis_io import ablpop, aconnect, expires, ms
from ._redis_kept import Kept
from ._redis_nodes import FAILED, node_value
from ._redis_scripts import LeaseKeys, Reply
from ._redis_waiters import WaitClock, label
from .base import Grant, new_secret

__all__ = ["AsyncRedlock", "Owner"]


class Owner(Protocol):
    """What :class:`AsyncRedlock` takes from the backend it serves
    (:class:`leases.backends.redlock.Backend`): the nodes and their timeout, the quorum, the
    scripts, and the backend's rules for a try, a renewal and a refusal, so both halves decide
    alike. A protocol, for the reason :class:`~._redis_async.Owner` is one."""

    alias: str
    prefix: str
    locations: list[str]
    node_timeout: float
    quorum: int
    release_script: Script
    renew_script: Script
    waits: WaitClock

    def unlock_call(self, grant: Grant) -> tuple[list[str], list[object]]: ...
    def renew_call(self, grant: Grant, ttl: float) -> tuple[list[str], list[object]]: ...
    def give_back(self, grant: Grant) -> tuple[object, ...]: ...
    def valid(self, grant: Grant) -> bool: ...
    def lost_try(
        self, attempt: Grant, answers: list[Any], unlock: Callable[..., object]
    ) -> None: ...
    def unless_refused(self, answers: list[Any], what: str) -> None: ...
    async def anext_token(self, name: str) -> int: ...
    async def arefusal(
        self, grant: Grant, answers: list[Any], what: str
    ) -> LeaseLost | LeaseNotHeld: ...


#: One node's ``redis.asyncio`` client and the connections kept out of its pool.
_Node = tuple[Any, Kept]


async def _aclose_all(nodes: list[_Node]) -> None:
    for client, kept in nodes:
        await kept.close()
        await client.aclose()


class AsyncRedlock:
    """``backend``'s round trips on the running event loop."""

    def __init__(self, backend: Owner) -> None:
        self.backend = backend
        self._clients: PerLoop[list[_Node]] = PerLoop(self._make, _aclose_all)
        #: Unlocks nobody awaits (a failed try's), referenced until they end.
        self._unlocking: set[asyncio.Future[Any]] = set()

    def _make(self) -> list[_Node]:
        timeout = self.backend.node_timeout
        nodes = []
        for loc in self.backend.locations:
            url = loc if "://" in loc else None
            client = aconnect(self.backend.alias, None if url else loc, url, timeout)
            nodes.append((client, Kept(client.connection_pool, timeout)))
        return nodes

    async def _fan_out(self, *command: object) -> list[Any]:
        """``command`` on every node (see :meth:`_each`), packed once for all of them."""
        packed = pack(command)
        return await self._each(lambda client, kept: kept.call(client, command, packed))

    async def _run_everywhere(
        self, script: Script, keys: list[str], args: list[object]
    ) -> list[Any]:
        """``script`` on every node by its SHA1 (``EVALSHA``; loaded on a connection whose
        server lacks it), packed once for all of them: the script's text only crosses the
        network after a server restart or ``SCRIPT FLUSH``, as the sync Redis backend's."""
        packed = script.packed(keys, args)
        return await self._each(lambda client, kept: kept.run(script, keys, args, packed))

    async def _each(self, round_trip: Callable[[Any, Kept], Awaitable[Any]]) -> list[Any]:
        """The backend's ``_fan_out`` on the event loop: every node asked concurrently, every
        answer bounded by one node timeout; a node that fails or is late answers ``FAILED``.

        Each node's round trip runs on one of its kept connections (bounded by the node timeout
        there, see :class:`~._redis_kept.Bound`), in that node's own task of the ``gather``, so
        the node timeout cancels that task only; a connection whose round trip did not end with
        its reply read (failed, late, cancelled) is dropped. A node whose reply waited in its
        socket while the event loop stalled past the node timeout is not late: its reply is
        read (validity still counts from ``sent_at``, before the stall)."""

        async def ask(client: Any, kept: Kept) -> Any:
            try:
                return await round_trip(client, kept)
            except (redis.RedisError, OSError, TimeoutError):
                return FAILED

        return list(await asyncio.gather(*(ask(*node) for node in self._clients.get())))

    def _unlock_everywhere(self, grant: Grant, *, confirm: bool = True) -> Any:
        """Compare-and-delete on every node; without ``confirm`` it runs as a task nobody
        awaits (kept referenced until it ends), so hung nodes cost the caller nothing, with
        the script's text (see the backend's ``give_back``)."""
        backend = self.backend
        if confirm:
            return self._run_everywhere(backend.release_script, *backend.unlock_call(grant))
        task = asyncio.ensure_future(self._fan_out(*backend.give_back(grant)))
        self._unlocking.add(task)
        task.add_done_callback(self._unlocking.discard)
        return None

    async def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        """The token is taken after the quorum's ``SET``s, as the sync try takes it (see the
        backend's *Fencing*): one prepared statement awaited on the loop's own database
        connection, bounded by that connection's reply deadline. Whatever ends the try there
        (no token in time, a cancellation) gives the quorum back before it is raised."""
        backend = self.backend
        keys = LeaseKeys.of(backend.prefix, name)
        secret = new_secret()
        sent_at = time.monotonic()
        value = node_value(holder, secret)
        answers = await self._fan_out("SET", keys.lock, value, "NX", "PX", ms(ttl))
        attempt = Grant(name, holder, 0, ttl, sent_at, secret=secret)
        if sum(answer is True for answer in answers) >= backend.quorum:
            try:
                token = await backend.anext_token(name)
            except BaseException:
                self._unlock_everywhere(attempt, confirm=False)
                raise
            grant = replace(attempt, token=token, expires_at=expires(ttl))
            if backend.valid(grant):
                return grant
        backend.lost_try(attempt, answers, self._unlock_everywhere)
        return None

    async def renew(self, grant: Grant, ttl: float) -> Grant:
        backend = self.backend
        sent_at = time.monotonic()
        answers = await self._run_everywhere(backend.renew_script, *backend.renew_call(grant, ttl))
        renewed = replace(grant, ttl=ttl, sent_at=sent_at, expires_at=expires(ttl))
        if sum(answer == Reply.OK for answer in answers) >= backend.quorum and backend.valid(
            renewed
        ):
            return renewed
        backend.unless_refused(answers, "renewal")  # unanswered is not refused: not a loss
        refusal = await backend.arefusal(grant, answers, "renewal")
        if isinstance(refusal, LeaseLost):
            self._unlock_everywhere(grant, confirm=False)
        raise refusal

    async def release(self, grant: Grant) -> None:
        answers = await self._unlock_everywhere(grant)
        if sum(answer == Reply.OK for answer in answers) < self.backend.quorum:
            self.backend.unless_refused(answers, "release")
            raise await self.backend.arefusal(grant, answers, "release")

    async def wait_for_release(self, name: str, timeout: float) -> bool:
        """``BLPOP`` on one node picked at random, bounded by ``timeout`` (see the backend's
        ``wait_for_release``); a dead node sleeps out the wait instead of spinning."""
        if timeout < 0.001:
            return False
        started = time.monotonic()
        client = random.choice(self._clients.get())[0]
        wake = LeaseKeys.of(self.backend.prefix, name).wake
        named = label(wake, self.backend.waits.since(name, timeout))
        try:
            reply = await ablpop(client, wake, timeout, named)
        except (redis.RedisError, OSError):
            await asyncio.sleep(max(0.0, timeout - (time.monotonic() - started)))
            return False
        return reply is not None

    async def aclose(self) -> None:
        await self._clients.aclose()
