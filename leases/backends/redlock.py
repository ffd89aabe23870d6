"""Redlock: a lease held on a majority of N independent Redis servers.

Configuration (``LEASES["BACKENDS"][alias]``)::

    {"ENGINE": "leases.backends.redlock",
     "NODES": ["redis://a:6379/0", "redis://b:6379/0", "redis://c:6379/0"],
     "NODE_TIMEOUT": 0.05}

Options: ``NODES`` (URLs, or django-redis cache aliases, which keep their own timeouts),
``NODE_TIMEOUT`` (seconds all nodes have to answer a request, default 0.05), ``PREFIX`` (default
``"leases:"``), ``TOKEN_SOURCE`` (``"database"``, or the dotted path of a callable
``(name) -> int`` whose results strictly increase per name), ``TOKEN_DATABASE`` (default
``"default"``).

One try of :meth:`Backend.try_acquire` follows the Redlock algorithm: ``SET NX PX`` sent to
every node at once, then the replies read as they arrive, by one shared deadline (the node
timeout), until they settle the try: a quorum said yes, or so many said no that none can. So a
try costs about one round trip of the fastest quorum and hung nodes at most one node timeout,
however many (no thread per call; replies still owed, and a failed try's unlock replies, are
read by one persistent drain thread); the
lease is granted when a quorum (N // 2 + 1) said yes and time is left (validity = TTL - elapsed -
drift, drift = TTL * DRIFT_FACTOR + DRIFT_MIN, which :meth:`Grant.valid_until` computes from
``sent_at``). A failed try unlocks, with the same compare-and-delete a release uses, on
every node that accepted it and every node whose reply was not read (a node that timed out
may still have set the key); a node that refused has nothing to undo. The nodes that
accepted get it at once; the others from the drain thread once it has read the try's replies
still owed: a node orders only the commands of one connection, and an unlock sent at once on
another could run before the try's own ``SET`` and leave it there for a whole TTL. Renewal
extends on a quorum or reports the lease lost. The :class:`~leases.lease.Lease` layer retries
failed tries with jittered backoff; between them a waiter blocks in ``BLPOP`` on one node for
the wake-up every release pushes to all nodes.

**Fencing.** Redlock has no monotonic counter of its own: node values are random and a node that
restarts empty forgets everything (Kleppmann's objection: right after A's grant a node restarts,
and B gets a majority including it while A still believes it holds the lease). So every grant
takes its token, *after* winning the quorum, from a source with a global monotonic counter: by
default the database backend's ``leases_lease`` row for the name, bumped in one statement on a
connection of its own. B's token is then higher than A's, and the fence at the resource rejects
whatever A writes after B has written. Taking it after the quorum, not before, keeps the order
of tokens the order of grants (a try delayed in the network cannot win with an older token) and
spends no counter on failed tries; the price is one database statement per grant (prepared,
run by name: see :data:`~._counter.PREPARED_BUMP_LEASE`; an async grant awaits it on an async
connection of its event loop). If the source is unavailable or does not answer within its
reply deadline, the quorum is given back and the grant refused with
:class:`~leases.errors.FencingUnavailable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import redis
from django.utils.module_loading import import_string

from .. import conf
from ..errors import (
    BackendNotSupported,
    BackendUnavailable,
    LeaseLost,
    LeaseNotHeld,
    RevocationIncomplete,
)
from ._counter import DurableCounter
from ._options import seconds_problems
from ._redis_conn import Script, pack
from ._redis_io import (
    BLPOP_WAIT,
    Edge,
    blpop_command,
    blpop_timing,
    cache_problems,
    eviction_problems,
    expires,
    ms,
    pool_problems,
    prefix_problems,
    server_of,
    text,
    url_problems,
)
from ._redis_nodes import FAILED, Node, OnReply, Pending, ReplyDrain, gather, node_value
from ._redis_scripts import RELEASE_LUA, RENEW_LUA, WAKE_TTL_MS, LeaseKeys, Reply, lua
from ._redis_waiters import WaitClock, distinct, label, waiters
from ._redlock_async import AsyncRedlock
from .base import (
    FORGED,
    LIST_BATCH,
    Capability,
    Grant,
    LeaseBackend,
    LeaseInfo,
    LeaseWaiter,
    new_secret,
    not_revoked,
)

__all__ = ["REVOKE_LUA", "Backend", "node_value"]


#: KEYS: lock, wake. ARGV: the exact value a quorum holds, wake ttl ms. An operator's
#: revocation (:meth:`Backend.force_release`), after the token moved on: compare-and-delete the
#: value read, never whatever a node holds by now, then wake one waiter.
REVOKE_LUA = lua("""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('RPUSH', KEYS[2], '1')
  redis.call('LTRIM', KEYS[2], 0, 0)
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return OK
end
return LOST
""")


class _LateSets:
    """The ``SET`` commands of one try whose replies were left to the drain thread, and whether
    the grant was released (:meth:`Backend._unlock_everywhere`) meanwhile.

    A node runs the commands of different connections in no promised order: a release sent on
    a fresh connection can run *before* the grant's own ``SET`` sent earlier on another (one
    the server has not read yet, or not even accepted), find nothing to delete there, and the
    ``SET`` then lands and holds that node for a whole TTL. (A give-back of a failed try is
    sent by the drain itself, after it read the try's replies: see
    :meth:`Backend._give_back_later`.) So the drain, which reads those replies, gives back again
    on each node whose ``SET`` it reads as landed (or cannot tell) once the grant was released.
    Either the drain sees the mark, or the mark was made after the reply was read, and then
    the release that follows the mark runs after the ``SET``.
    """

    __slots__ = ("attempt", "backend", "given_back", "left")

    def __init__(self, backend: Backend, attempt: Grant, left: int) -> None:
        self.backend, self.attempt, self.left = backend, attempt, left
        self.given_back = False

    def __call__(self, node: Node, reply: Any) -> None:
        """The drain read ``node``'s reply (``None``: refused, nothing landed)."""
        self.left -= 1
        if self.left <= 0:
            self.backend._late.pop(self.attempt.secret, None)
        if self.given_back and reply is not None:
            self.backend._give_back_later(self.attempt, [node])


def _token_source_problems(alias: str, source: object) -> list[str]:
    """``"database"`` or the dotted path of a callable: imported here, because a bad path would
    otherwise surface as an ``ImportError`` at the first grant."""
    if source == "database":
        return []
    where = f'LEASES["BACKENDS"][{alias!r}]["TOKEN_SOURCE"] = {source!r}'
    try:
        found = import_string(str(source))
    except ImportError as exc:
        return [f'{where} cannot be imported ({exc}); use "database" or a callable\'s path']
    if not callable(found):
        return [f"{where} is not a callable (name) -> int"]
    return []


class Backend(LeaseBackend):
    """Leases on a quorum of independent Redis servers, fenced by a durable token source."""

    #: Waiters block in ``BLPOP`` on one node; only when that node is down do they sleep out
    #: the wait (bounded by the Lease layer's backoff) instead of being woken.
    capabilities = frozenset({Capability.WAIT_WITHOUT_POLLING, Capability.FORCE_RELEASE})
    wait_at_least = BLPOP_WAIT

    known_options = frozenset({"NODES", "NODE_TIMEOUT", "PREFIX", "TOKEN_SOURCE", "TOKEN_DATABASE"})

    @classmethod
    def check_options(cls, alias: str, options: Mapping[str, Any]) -> list[str]:
        """Also: ``NODES`` is a non-empty list of well-formed Redis URLs or django-redis cache
        aliases, ``NODE_TIMEOUT`` is positive, ``PREFIX`` is usable. (Fewer than 3 nodes is a
        deploy warning: it works, but one node's failure stops every grant.)"""
        problems = super().check_options(alias, options)
        nodes = options.get("NODES")
        if not isinstance(nodes, list | tuple) or not nodes:
            problems.append(
                f'LEASES["BACKENDS"][{alias!r}]["NODES"] must be a non-empty list of Redis URLs '
                "or cache aliases (3 or 5 independent servers)"
            )
            nodes = []
        servers: dict[object, list[str]] = {}
        for node in nodes:
            if isinstance(node, str) and "://" in node:
                found = url_problems(alias, "NODES", node)
                problems += found
                server: object = node if found else server_of(node)
            else:
                problems += cache_problems(alias, "NODES", node)
                server = str(node)
            servers.setdefault(server, []).append(str(node))
        repeated = [" and ".join(spelt) for spelt in servers.values() if len(spelt) > 1]
        if repeated:
            problems.append(
                f'LEASES["BACKENDS"][{alias!r}]["NODES"] lists one server more than once '
                f"({'; '.join(repeated)}): each listing is a vote, so a quorum needs "
                "independent servers"
            )
        problems += seconds_problems(alias, "NODE_TIMEOUT", options.get("NODE_TIMEOUT", 0.05))
        problems += prefix_problems(alias, options.get("PREFIX", "leases:"))
        problems += _token_source_problems(alias, options.get("TOKEN_SOURCE", "database"))
        return problems

    @classmethod
    def capabilities_of(cls, options: Mapping[str, Any]) -> frozenset[Capability]:
        """No :attr:`~Capability.FORCE_RELEASE` with a custom ``TOKEN_SOURCE``: nothing knows a
        name's current token to compare (see :meth:`force_release`)."""
        if options.get("TOKEN_SOURCE", "database") == "database":
            return cls.capabilities
        return cls.capabilities - {Capability.FORCE_RELEASE}

    @classmethod
    def check_limits(cls, alias: str, options: Mapping[str, Any]) -> list[str]:
        """A node given as a cache alias whose pool is too small for the sync traffic (see
        :func:`~._redis_io.pool_problems`); a URL node's pool is ours."""
        return [
            problem
            for node in options["NODES"]
            if "://" not in str(node)
            for problem in pool_problems(alias, "NODES", str(node))
        ]

    @classmethod
    def databases(cls, options: Mapping[str, Any]) -> frozenset[str]:
        """The token source's database (read by :meth:`inspect` and :meth:`force_release`)."""
        return frozenset({str(options.get("TOKEN_DATABASE", "default"))})

    def __init__(self, alias: str, options: Mapping[str, Any]) -> None:
        super().__init__(alias, options)
        self.locations = [str(node) for node in options["NODES"]]
        self.quorum = len(self.locations) // 2 + 1
        #: How many nodes meet every quorum: a value gone from that many can no longer be
        #: renewed on a quorum, and that many answering show every name a quorum holds.
        self.overlap = len(self.locations) - self.quorum + 1
        self.prefix: str = options.get("PREFIX", "leases:")
        self.node_timeout = float(options.get("NODE_TIMEOUT", 0.05))
        (tokens,) = self.databases(options)
        self.counter = DurableCounter(alias, tokens)
        source = options.get("TOKEN_SOURCE", "database")
        self._source_is_database = source == "database"
        self.next_token: Callable[[str], int] = (
            self.counter.bump_lease if self._source_is_database else import_string(str(source))
        )
        self._nodes: list[Node] | None = None
        #: Sent by SHA1, loaded on a node's connection where the node lacks them.
        self.release_script, self.renew_script = Script(RELEASE_LUA), Script(RENEW_LUA)
        self._revoke_script = Script(REVOKE_LUA)
        self._drain = ReplyDrain(alias)
        self._async = AsyncRedlock(self)
        self.waits = WaitClock()
        #: Tries whose ``SET`` replies the drain has yet to read, by secret (see
        #: :class:`_LateSets`).
        self._late: dict[str, _LateSets] = {}

    @property
    def nodes(self) -> list[Node]:
        """Clients made on first use (never at import); a race makes spare clients, no harm."""
        if self._nodes is None:
            scripts = (self.release_script, self.renew_script, self._revoke_script)
            self._nodes = [
                Node(self.alias, loc, self.node_timeout, scripts) for loc in self.locations
            ]
        return self._nodes

    def _send_all(self, command: tuple[object, ...], packed: bytes = b"") -> Pending:
        """Send ``command`` (``packed`` if given) to every node at once; replies are due one
        node timeout from now.

        Sending never waits on a node (connections make no handshake), so the nodes work in
        parallel and a hung one costs no more than a live one until the replies are read."""
        deadline = time.monotonic() + self.node_timeout
        packed = packed or pack(command)
        return [(node, node.send(command, packed=packed)) for node in self.nodes], command, deadline

    def _fan_out(
        self,
        *command: object,
        decided: Callable[[list[Any]], bool] | None = None,
        packed: bytes = b"",
        on_unread: Callable[[int], OnReply] | None = None,
        unsent: list[Node] | None = None,
        said: list[tuple[Node, Any]] | None = None,
    ) -> list[Any]:
        """Send ``command`` to every node, then read every reply by one shared deadline.

        A try costs about one round trip, and at most one node timeout however many nodes
        hang (each read gets what is left of the deadline, not a timeout of its own), without
        a thread per call. A node that fails or does not answer in time answers :data:`FAILED`.

        With ``decided``, replies are read as they arrive only until the ones read settle the
        outcome (see :func:`~._redis_nodes.gather`); the rest are left to the drain thread, so
        a grant, renewal or release waits for the fastest quorum, never for the slowest node,
        and answer :data:`FAILED` here. ``decided`` must not be settled by ``FAILED`` answers
        alone (only by real ones), or a store nobody answered would look merely busy.
        ``on_unread``, given how many were left, makes what the drain calls with each of their
        replies. ``unsent``, if given, gets the nodes the command could not be sent to, and
        ``said`` each node whose reply was read here, with the reply.
        """
        pending = self._send_all(command, packed)
        if unsent is not None:
            unsent += [node for node, connection in pending[0] if connection is None]
        if decided is None:
            sent, _, deadline = pending
            return [node.answer(connection, command, deadline) for node, connection in sent]
        answers, unread = gather(pending, decided, said)
        if unread:
            deadline = time.monotonic() + self.node_timeout
            told = None if on_unread is None else on_unread(len(unread))
            self._drain.put((unread, command, deadline), told)
        # Unread is unknown, as a node that did not answer: it may have run the command.
        return answers + [FAILED] * len(unread)

    def _granted(self, answers: list[Any]) -> bool:
        """A quorum said yes to ``SET NX`` (the nodes not read yet cannot undo that)."""
        return sum(answer is True for answer in answers) >= self.quorum

    def _settled(self, answers: list[Any]) -> bool:
        """A try is granted, or so many nodes said no that no quorum can say yes (the try's
        unlock then goes to every node, the unread ones included)."""
        refused = sum(answer is not True and answer is not FAILED for answer in answers)
        return self._granted(answers) or refused > len(self.locations) - self.quorum

    def _done(self, answers: list[Any]) -> bool:
        """A quorum ran the compare-and-extend or compare-and-delete."""
        return sum(bool(answer == Reply.OK) for answer in answers) >= self.quorum

    def _unlock_everywhere(self, grant: Grant, *, confirm: bool = True) -> list[Any]:
        """Compare-and-delete on every node (a timed-out ``SET`` may still have landed).

        Without ``confirm`` (giving up a failed try or renewal) the drain thread sends it and
        reads the replies (:meth:`_give_back_later`), so hung nodes cost the caller nothing
        more; and the script goes with its text (:meth:`give_back`), not by SHA1. With it (a
        release), a ``SET`` of the grant whose reply is still unread is marked first, for the
        drain to undo where it lands after the release (:class:`_LateSets`), and nodes it
        could not be sent to get it from the drain."""
        if not confirm:
            self._give_back_later(grant, self.nodes)
            return []
        late = self._late.get(grant.secret)
        if late is not None:
            late.given_back = True
        keys, args = self.unlock_call(grant)
        unsent: list[Node] = []
        answers = self._fan_out(
            *self.release_script.command(keys, args),
            decided=self._done,
            packed=self.release_script.packed(keys, args),
            unsent=unsent,
        )
        if unsent:  # no connection to spare (a busy pool) or a node down: once more, later
            self._give_back_later(grant, unsent)
        return answers

    def _give_back_later(self, grant: Grant, nodes: list[Node]) -> None:
        """:meth:`give_back` to ``nodes``, sent by the drain thread after the replies queued
        before it are read: a try's ``SET`` whose reply was still unread has then run, so the
        give-back cannot run before it on any node (a node orders only the commands of one
        connection: sent at once on another, it could, and the ``SET`` would then hold that
        node for a whole TTL); and it goes out on connections those reads gave back, where
        under contention a new one may be refused (the pool's limit) and the give-back lost."""
        self._drain.later(lambda: self._send_give_back(grant, nodes))

    def _send_give_back(self, grant: Grant, nodes: list[Node]) -> Pending:
        """Send :meth:`give_back` to ``nodes`` (packed once); its replies are the drain's."""
        command = self.give_back(grant)
        packed = pack(command)
        deadline = time.monotonic() + self.node_timeout
        return [(node, node.send(command, packed=packed)) for node in nodes], command, deadline

    def give_back(self, grant: Grant) -> tuple[object, ...]:
        """The unlock of a failed try or a lost renewal: :data:`RELEASE_LUA` by its text
        (``EVAL``), because nobody may read its reply in time. A slow node that lacks the
        script would answer an ``EVALSHA`` with ``NOSCRIPT`` after the node timeout, too late
        to load it and run it again, and keep what the try set for a whole TTL."""
        keys, args = self.unlock_call(grant)
        return ("EVAL", RELEASE_LUA, len(keys), *keys, *args)

    def unlock_call(self, grant: Grant) -> tuple[list[str], list[object]]:
        """Keys and arguments of :data:`RELEASE_LUA` for ``grant``: its owner's proof (the
        nodes' values have no token prefix), then the wake-up's TTL."""
        keys = LeaseKeys.of(self.prefix, grant.name)
        return [keys.lock, keys.wake], ["", grant.holder, grant.secret, WAKE_TTL_MS]

    def renew_call(self, grant: Grant, ttl: float) -> tuple[list[str], list[object]]:
        """Keys and arguments of :data:`RENEW_LUA` for ``grant``, extended to ``ttl``."""
        keys = LeaseKeys.of(self.prefix, grant.name)
        return [keys.lock], ["", grant.holder, grant.secret, ms(ttl)]

    def _run_everywhere(
        self,
        script: Script,
        keys: list[str],
        args: list[object],
        decided: Callable[[list[Any]], bool] | None = None,
    ) -> list[Any]:
        """:meth:`_fan_out` of ``script`` by its SHA1 (``EVALSHA``), packed once for every
        node: its text crosses the network only to a node that lacks it (restarted, ``SCRIPT
        FLUSH``), which loads it on that connection and runs it again (:meth:`Node.answer`)."""
        command = script.command(keys, args)
        return self._fan_out(*command, decided=decided, packed=script.packed(keys, args))

    def refusal(self, grant: Grant, answers: list[Any], what: str) -> LeaseLost | LeaseNotHeld:
        """Why a quorum refused. The nodes know holders but no tokens, so "holder matches,
        secret does not" is a forged grant only if ``grant`` is still valid by its own clock and
        its token is the name's current one (one more statement, on this failure path only);
        otherwise another grant, perhaps of the same holder name, took over: the lease was lost.
        """
        forged = self._maybe_forged(grant, answers) and (
            not self._source_is_database or self.counter.current_lease(grant.name) == grant.token
        )
        return self._refused(grant, forged, what)

    async def arefusal(
        self, grant: Grant, answers: list[Any], what: str
    ) -> LeaseLost | LeaseNotHeld:
        """:meth:`refusal`, its statement awaited on the loop's token connection."""
        forged = self._maybe_forged(grant, answers) and (
            not self._source_is_database
            or await self.counter.acurrent_lease(grant.name) == grant.token
        )
        return self._refused(grant, forged, what)

    def _maybe_forged(self, grant: Grant, answers: list[Any]) -> bool:
        """A quorum knew the holder but not the secret, and ``grant`` is still valid."""
        refused = sum(answer == Reply.NOT_OWNER for answer in answers) >= self.quorum
        return refused and self.valid(grant)

    @staticmethod
    def _refused(grant: Grant, forged: bool, what: str) -> LeaseLost | LeaseNotHeld:
        if forged:
            return LeaseNotHeld(grant.name, FORGED)
        return LeaseLost(grant.name, grant.token, f"a quorum of nodes refused the {what}")

    def valid(self, grant: Grant) -> bool:
        settings = conf.get()
        return time.monotonic() < grant.valid_until(settings.drift_factor, settings.drift_min)

    def try_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        keys = LeaseKeys.of(self.prefix, name)
        secret = new_secret()
        sent_at = time.monotonic()
        value = node_value(holder, secret)
        attempt = Grant(name, holder, 0, ttl, sent_at, secret=secret)

        def late(left: int) -> OnReply:
            self._late[secret] = found = _LateSets(self, attempt, left)
            return found

        said: list[tuple[Node, Any]] = []
        answers = self._fan_out(
            "SET",
            keys.lock,
            value,
            "NX",
            "PX",
            ms(ttl),
            decided=self._settled,
            on_unread=late,
            said=said,
        )

        def give_back(grant: Grant, *, confirm: bool = False) -> None:
            self._give_back_tried(grant, said)

        if self._granted(answers):
            try:
                token = self.next_token(name)
            except BaseException:
                give_back(attempt)
                raise
            grant = Grant(name, holder, token, ttl, sent_at, expires(ttl), secret=secret)
            if self.valid(grant):
                return grant
        self.lost_try(attempt, answers, give_back)
        return None

    def _give_back_tried(self, attempt: Grant, said: list[tuple[Node, Any]]) -> None:
        """Give back a failed try: at once on the nodes that said yes (their ``SET`` has run),
        by the drain thread after it read the replies still owed on those whose reply was not
        read (:meth:`_give_back_later`); nothing on those that said no."""
        now = [node for node, answer in said if answer is True]
        read = {id(node) for node, answer in said if answer is not FAILED}
        if now:
            self._drain.put(self._send_give_back(attempt, now))
        later = [node for node in self.nodes if id(node) not in read]
        if later:
            self._give_back_later(attempt, later)

    def lost_try(self, attempt: Grant, answers: list[Any], unlock: Callable[..., object]) -> None:
        """Give back what a failed try may hold: a node that said no has nothing to undo, one
        that said yes or timed out might. No node answering is an unreachable store."""
        if any(answer is True or answer is FAILED for answer in answers):
            unlock(attempt, confirm=False)
        if all(answer is FAILED for answer in answers):
            raise BackendUnavailable(self.alias, "no Redlock node answered")

    def renew(self, grant: Grant, ttl: float) -> Grant:
        """Extend on a quorum within the new validity, or give the lease up everywhere."""
        sent_at = time.monotonic()
        answers = self._run_everywhere(self.renew_script, *self.renew_call(grant, ttl), self._done)
        renewed = replace(grant, ttl=ttl, sent_at=sent_at, expires_at=expires(ttl))
        if self._done(answers) and self.valid(renewed):
            return renewed
        self.unless_refused(answers, "renewal")
        refusal = self.refusal(grant, answers, "renewal")
        if isinstance(refusal, LeaseLost):
            self._unlock_everywhere(grant, confirm=False)
        raise refusal

    def release(self, grant: Grant) -> None:
        answers = self._unlock_everywhere(grant)
        if not self._done(answers):
            self.unless_refused(answers, "release")
            raise self.refusal(grant, answers, "release")

    def unless_refused(self, answers: list[Any], what: str) -> None:
        """``BackendUnavailable`` unless a quorum of nodes answered and refused.

        Nodes that did not answer in time (a reset, a lost reply) said nothing about the
        lease: calling that a loss would give up a lease a retry could keep (the keepalive
        retries within the validity left), and would say "lost" of a release that may have
        landed. Only refusals prove the grant is gone."""
        refused = sum(answer is not FAILED and answer != Reply.OK for answer in answers)
        if refused < self.quorum:
            unanswered = sum(answer is FAILED for answer in answers)
            raise BackendUnavailable(
                self.alias, f"{unanswered} of {len(answers)} nodes did not answer the {what}"
            )

    def wait_for_release(self, name: str, timeout: float) -> bool:
        """``BLPOP`` on one node, picked at random, for the wake-up every release pushes.

        A wait that runs out ends on the node's timer, keeping its connection, or on the
        client's deadline if the node does not answer in time (see
        :func:`~leases.backends._redis_io.blpop_timing`). A dead or hung node only costs
        this one wait, after which the Lease layer tries again; so a release usually wakes the
        waiter at once, and a lost wake-up costs at most one retry delay.
        """
        if timeout < 0.001:
            return False
        started = time.monotonic()
        node = random.choice(self.nodes)
        wake = LeaseKeys.of(self.prefix, name).wake
        command = blpop_command(wake, timeout)
        named = label(wake, self.waits.since(name, timeout))
        deadline = started + blpop_timing(timeout)[1]
        reply = node.answer(node.send(command, named), command, deadline)
        if reply is FAILED:  # the deadline, or a dead node: never a busy retry
            time.sleep(max(0.0, timeout - (time.monotonic() - started)))
            return False
        return reply is not None

    # -- async: redis.asyncio, every node at once (leases/backends/_redlock_async.py) -------

    async def atry_acquire(self, name: str, holder: str, ttl: float) -> Grant | None:
        return await self._async.try_acquire(name, holder, ttl)

    async def arenew(self, grant: Grant, ttl: float) -> Grant:
        return await self._async.renew(grant, ttl)

    async def arelease(self, grant: Grant) -> None:
        await self._async.release(grant)

    async def await_for_release(self, name: str, timeout: float) -> bool:
        return await self._async.wait_for_release(name, timeout)

    async def anext_token(self, name: str) -> int:
        """:attr:`next_token`, awaited: the database source's statement on the loop's own
        async connection; a custom ``TOKEN_SOURCE`` (a plain callable, which may block) on a
        worker thread."""
        if self._source_is_database:
            return await self.counter.abump_lease(name)
        return await asyncio.to_thread(self.next_token, name)

    async def aclose(self) -> None:
        """The running loop's node clients and token connection."""
        try:
            await self._async.aclose()
        finally:
            await self.counter.aclose()

    def waiters(self) -> list[LeaseWaiter]:
        """The waits blocked on any node now (a waiter waits on one node picked at random);
        a node that does not answer only hides its own."""
        found: list[LeaseWaiter] = []
        for node in self.nodes:
            try:
                listed = node.client.client_list(_type="normal")
            except (redis.RedisError, OSError):
                continue
            found += waiters(self.alias, self.prefix, listed, f"redlock node {node.location}")
        return distinct(found)

    def force_release(self, name: str, token: int) -> LeaseInfo:
        """Compare-and-revoke: the token source decides, then the nodes give the grant up.

        The nodes know no tokens (a grant takes its token after winning them), so the compare
        happens where the token lives: one conditional statement on the name's database row.
        Only once that moved the token on is the value a quorum holds compare-and-deleted on
        every node, so the evicted holder's renewals fail.

        Not with a custom ``TOKEN_SOURCE``: it only hands tokens out, so nothing knows a name's
        current token to compare (the database row it never writes refused every revocation
        as "never granted"); :class:`~leases.errors.BackendNotSupported` says so, and the
        backend does not declare the capability then (:meth:`capabilities_of`).

        Nothing is revoked unless the nodes that answer tell who holds the name
        (:meth:`_held_value`); and the revocation is reported done only once the value is gone
        from so many nodes that the holder no longer has a quorum to renew on, else
        :class:`~leases.errors.RevocationIncomplete` says the token moved but the grant stands
        (reporting success there left the holder renewing, the name held, and nobody with the
        new token).
        """
        if not self._source_is_database:
            raise BackendNotSupported(
                self.alias, f"{Capability.FORCE_RELEASE.value} with a custom TOKEN_SOURCE"
            )
        keys = LeaseKeys.of(self.prefix, name)
        held = self._held_value(name, self._fan_out("GET", keys.lock), ", nothing was revoked")
        new, current = self._revoke_token(name, token)
        if new is None:
            raise LeaseNotHeld(name, not_revoked(token, current))
        if held is not None:
            revoke = [held, WAKE_TTL_MS]
            answers = self._run_everywhere(self._revoke_script, [keys.lock, keys.wake], revoke)
            gone = sum(answer is not FAILED for answer in answers)
            if gone < self.overlap:
                detail = f"{gone} of {len(self.nodes)} Redlock nodes confirmed the deletion"
                raise RevocationIncomplete(self.alias, name, new, detail)
        return LeaseInfo(name, "", new, False, self.alias)

    def _held_value(self, name: str, answers: list[Any], consequence: str = "") -> str | None:
        """The value a quorum of nodes holds for ``name`` (``None``: no grant holds one),
        from the answers to a ``GET`` on every node.

        ``BackendUnavailable`` (its message ending with ``consequence``) when the answers
        cannot tell: fewer than a quorum answered, or a value is on fewer than a quorum of the
        answers but would be on a quorum with the nodes that did not answer (its holder may
        well have them). The one rule for :meth:`inspect` and :meth:`force_release`, so an
        operator is never shown a name free, or held by someone, that a revocation would
        refuse to judge."""
        found = [answer for answer in answers if answer is not FAILED]
        missing = len(answers) - len(found)
        counts = Counter(text(value) for value in found if value is not None)
        held = [value for value, count in counts.items() if count >= self.quorum]
        if len(found) < self.quorum or (
            not held and any(count + missing >= self.quorum for count in counts.values())
        ):
            raise BackendUnavailable(
                self.alias,
                f"{len(found)} of {len(answers)} Redlock nodes answered: not enough to tell "
                f"who holds {name!r}{consequence}",
            )
        return held[0] if held else None

    def _revoke_token(self, name: str, token: int) -> tuple[int | None, int | None]:
        """Advance ``name``'s token if it is ``token``, atomically in the database row."""
        return self.counter.revoke_lease(name, token)

    def inspect(self, name: str) -> LeaseInfo | None:
        """What the nodes that answer can establish (:meth:`_held_value`): the holder whose
        value a quorum holds, or a free name when no value could be on a quorum even with the
        nodes that did not answer. Otherwise ``BackendUnavailable``: fewer than a quorum
        answering, read as "not held", made a Redlock with every node down look healthy to
        the health check while every acquire failed; and a value short of a quorum only for
        want of answers, read as "free", hid a holder still renewing on its quorum."""
        answers = self._fan_out("GET", LeaseKeys.of(self.prefix, name).lock)
        return self._info(name, answers, self.current_token(name))

    def _info(self, name: str, answers: list[Any], token: int) -> LeaseInfo | None:
        """:meth:`inspect`'s answer from every node's value of ``name``'s lock, and its token."""
        held = self._held_value(name, answers)
        if held is not None:
            return LeaseInfo(name, held.split(":", 1)[1], token, True, self.alias)
        seen = any(answer is not None and answer is not FAILED for answer in answers)
        return LeaseInfo(name, "", token, False, self.alias) if seen or token else None

    def _inspected(self, names: list[str]) -> list[LeaseInfo | None]:
        """:meth:`inspect` of each of ``names``: one ``MGET`` sent to every node at once, and
        the tokens in one statement (a fan-out and a query per name made a listing of a few
        thousand names take seconds)."""
        locks = [LeaseKeys.of(self.prefix, name).lock for name in names]
        replies = self._fan_out("MGET", *locks)
        # A custom TOKEN_SOURCE keeps its tokens to itself (see current_token): 0, unknown.
        tokens = self.counter.current_leases(names) if self._source_is_database else {}
        return [
            self._info(
                name,
                [FAILED if reply is FAILED else reply[i] for reply in replies],
                tokens.get(name, 0),
            )
            for i, name in enumerate(names)
        ]

    def current_token(self, name: str) -> int:
        """``name``'s latest token from the database row; 0 (unknown) with a custom
        ``TOKEN_SOURCE``, which keeps its tokens to itself (the row, never written by it, could
        only show a stale token from before the source changed)."""
        if not self._source_is_database:
            return 0
        return self.counter.current_lease(name) or 0

    def inspect_all(self) -> list[LeaseInfo]:
        """Names with a lock key on any live node, by ``SCAN`` (never ``KEYS``).

        A held name is on a quorum of nodes, so the nodes that answer show every one of them
        only if they are more than the rest (N - quorum + 1): fewer, and the listing could miss
        any held name, so the store is unavailable, never an empty listing of it. So is a name
        :meth:`inspect` cannot judge with the nodes that answer."""
        pattern = LeaseKeys.pattern(self.prefix, "lock")
        names: set[str] = set()
        answered = 0
        for node in self.nodes:
            try:
                found = list(node.client.scan_iter(match=pattern, count=1000))
            except redis.RedisError:
                continue
            answered += 1
            for key in found:
                names.add(LeaseKeys.name_of(self.prefix, text(key), "lock"))
        if answered < self.overlap:
            raise BackendUnavailable(
                self.alias,
                f"inspect_all: {answered} of {len(self.nodes)} nodes answered, "
                f"{self.overlap} are needed to see every held name",
            )
        ordered = sorted(names)
        infos = [
            info
            for start in range(0, len(ordered), LIST_BATCH)
            for info in self._inspected(ordered[start : start + LIST_BATCH])
        ]
        return [info for info in infos if info is not None]

    def store_checks(self) -> list[str]:
        """Per-node eviction policies, of the nodes that answer."""
        problems: list[str] = []
        for node in self.nodes:
            with contextlib.suppress(BackendUnavailable):
                found = eviction_problems(self.alias, node.client)
                problems += [f"node {node.location}: {problem}" for problem in found]
        return problems

    def deploy_checks(self) -> list[str]:
        """Nodes that do not answer; an error when fewer than a quorum do."""
        problems: list[str] = []
        down = 0
        for node in self.nodes:
            try:
                with Edge(self.alias, "deploy check"):
                    node.client.ping()
            except BackendUnavailable as exc:
                problems.append(f"node {node.location}: {exc}")
                down += 1
        if len(self.locations) - down < self.quorum:
            raise BackendUnavailable(self.alias, f"fewer than {self.quorum} nodes answer")
        if len(self.locations) < 3:
            problems.append(f"{len(self.locations)} node(s): Redlock needs 3 or more nodes")
        return problems

    def close(self) -> None:
        self._drain.stop()
        nodes, self._nodes = self._nodes, None
        for node in nodes or ():
            node.close()
        self.counter.close()
