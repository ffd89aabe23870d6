"""Clock faults: the lock server's wall clock steps forward or backward while leases are held.

Each test owns its servers, started under libfaketime (:class:`devservers.clock.FakeClock`):
only their ``CLOCK_REALTIME`` moves, as with an NTP step, and the client's clocks are true.
Every write goes through the shared fenced register, so "the old holder could not harm its
successor" is checked on the history.

What the servers do, observed here (and written in ``docs/operating/hazards.md``):

- PostgreSQL: the database backend decides expiry with ``clock_timestamp()``, the wall clock,
  so a forward step expires grants early and a backward step stretches them.
- Redis 7 (7.0.15 here): a key's ``PX`` deadline is an absolute wall-clock time, so the same:
  a forward step of 2 x TTL deletes the lock key at once (``PTTL`` -2), a backward step of one hour
  adds an hour to ``PTTL``. The monotonic clock Redis uses for timers does not help leases.
- Redlock: each node has its own clock; one node's step is outvoted by the others, a step on a
  majority acts as on a single Redis.

A forward step therefore lets a successor in while the old holder still believes it holds
(no client can know the server's clock jumped): the safety that remains is the fencing token,
which these tests check is higher and enforced, and the old holder learning its loss at its next
renewal. A backward step only delays a successor (the holder's grant lasts longer on the server
than the holder believes), by at most the size of the step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings
from kazoo.exceptions import KazooException  # type: ignore[import-untyped]
from kazoo.handlers.threading import KazooTimeoutError  # type: ignore[import-untyped]

from devservers import PostgresServer, RedisServer
from devservers.clock import FakeClock, libfaketime
from devservers.etcd import EtcdCluster, etcd_binary
from devservers.zookeeper import ZooKeeperEnsemble, zookeeper_classpath
from leases import LeaseError, LeaseLost, LeaseUnavailable, acquire
from leases.backends import get_backend
from tests import checker
from tests.lease_backends import lease_name
from tests.waiting import wait_until

__all__ = ["lease_name"]

pytestmark = [pytest.mark.fault]

#: The alias of the backend under test (a holder and its successor both use it).
CLOCKED = "clocked"
#: How far ahead etcd is started to see whether libfaketime moves its clock (one day).
_PROBE_OFFSET = 86400.0


@dataclass
class Clocked:
    """Servers of one backend kind, each with the clock a test steps."""

    kind: str
    clocks: list[FakeClock]
    servers: list[Any] = field(default_factory=list)
    #: Extra seconds a successor may need on ZooKeeper: its JVM under libfaketime answered a
    #: request in 0.2-0.35 s on a loaded machine when the library re-read its offset file on
    #: every clock call (2-8 ms median on a quiet one, single replies up to 0.2 s).
    slack: float = 0.0

    def jump(self, seconds: float, nodes: int | None = None) -> None:
        """Step the wall clock of the first ``nodes`` servers (default: all) by ``seconds``,
        and return once the servers show the step."""
        for clock in self.clocks[: len(self.clocks) if nodes is None else nodes]:
            clock.jump(seconds)
        self.await_shown()

    def await_shown(self) -> None:
        """Wait until a server whose clock shows a step late (:attr:`FakeClock.lag`) shows its
        clock's offset: ZooKeeper's, read as the ``mtime`` it stamps on a write."""
        if self.kind != "zookeeper":
            return  # the other servers see a step at their next read of the clock
        offset = self.clocks[0].offset

        def shown() -> bool:
            before = time.time()
            try:
                stamped = float(get_backend(CLOCKED).zk.server_now()) / 1000  # type: ignore[attr-defined]
            except (LeaseError, KazooException, KazooTimeoutError):
                return False  # no reply in time on a loaded machine: not shown yet, ask again
            after = time.time()
            # Stamped between the two reads, on a clock ``offset`` away (ms granularity).
            return before + offset - 0.25 <= stamped <= after + offset + 0.25

        wait_until(shown, 15 + self.clocks[0].lag, f"the server's clock to show {offset:+.0f} s")


@pytest.fixture
def clock() -> Iterator[FakeClock]:
    if libfaketime() is None:
        pytest.skip("libfaketime is not installed (apt-get install libfaketime faketime)")
    with FakeClock() as made:
        yield made


@pytest.fixture
def pg_server(clock: FakeClock) -> Iterator[PostgresServer]:
    """The harness's ``pg_server`` (which ``fault_database`` migrates), under ``clock``."""
    server = PostgresServer(env=clock.env()).start()
    try:
        yield server
    finally:
        server.destroy()


def _redis_under(clocks: list[FakeClock]) -> list[RedisServer]:
    return [RedisServer(env=c.env()).start() for c in clocks]


@pytest.fixture(scope="module")
def zookeeper_under_clock() -> Iterator[tuple[FakeClock, ZooKeeperEnsemble]]:
    """A standalone ZooKeeper server of this module's own under a fake clock (the session's
    shared ensemble is never stepped). One server, not three, started once for the module:
    the JVM runs several times slower under libfaketime, whose wrappers see every one of its
    many clock reads. Each test puts the clock back when it ends, and the next waits until the
    server shows it: the clock is a threaded one, whose steps show up to a second late."""
    if libfaketime() is None:
        pytest.skip("libfaketime is not installed (apt-get install libfaketime faketime)")
    if zookeeper_classpath() is None:
        pytest.skip("ZooKeeper: apt-get install zookeeper default-jre-headless")
    with FakeClock(threaded=True) as clock:
        server = ZooKeeperEnsemble(size=1, env=clock.env())
        try:
            server.start(timeout=300)
            yield clock, server
        finally:
            server.destroy()


def _etcd_under_clock() -> tuple[FakeClock, EtcdCluster]:
    """A one-member etcd under a fake clock, if libfaketime can move etcd's clock at all: it
    is started one day ahead and asked the time (its HTTP ``Date`` header). Go reads the wall
    clock through the vDSO, not through libc's ``clock_gettime``, so the preloaded library never
    sees the call: the test skips, saying what etcd answered."""
    if libfaketime() is None:
        pytest.skip("libfaketime is not installed (apt-get install libfaketime faketime)")
    if etcd_binary() is None:
        pytest.skip("etcd: no etcd binary installed (apt-get install etcd-server)")
    clock = FakeClock()
    clock.set(_PROBE_OFFSET)
    cluster = EtcdCluster(size=1, env=clock.env())
    try:
        cluster.start()
        url = f"{cluster.endpoints[0]}/version"
        with urllib.request.urlopen(url, timeout=10) as reply:  # our own member
            date = reply.headers["Date"]
        served = parsedate_to_datetime(date).timestamp() - time.time()
    except BaseException:
        cluster.destroy()
        clock.destroy()
        raise
    if served < _PROBE_OFFSET / 2:
        cluster.destroy()
        clock.destroy()
        pytest.skip(
            f"etcd: libfaketime cannot step its clock. Started {_PROBE_OFFSET:.0f} s ahead, it "
            f"answered Date: {date} ({served:+.0f} s from the real time): Go reads the wall "
            "clock through the vDSO, never through libc, so LD_PRELOAD cannot intercept it. "
            "(etcd expires leases on Go's monotonic clock, which a wall-clock step does not move.)"
        )
    clock.set(0)
    return clock, cluster


@pytest.fixture(params=["database", "redis", "redlock", "zookeeper", "etcd"])
def clocked(request: pytest.FixtureRequest, transactional_db: None) -> Iterator[Clocked]:
    """Backend ``"clocked"`` of one kind on servers whose wall clocks the test steps."""
    kind: str = request.param
    servers: list[Any] = []
    clocks: list[FakeClock] = []
    owned = kind not in ("database", "zookeeper")  # servers and clocks destroyed at the end
    if kind == "zookeeper":
        clock, server = request.getfixturevalue("zookeeper_under_clock")
        clocks, servers = [clock], [server]
        config: dict[str, Any] = {
            "ENGINE": "leases.backends.zookeeper",
            "HOSTS": server.hosts,
            "SESSION_TIMEOUT": 6.0,
            "REQUEST_TIMEOUT": 2.0,
            "CONNECT_TIMEOUT": 60.0,  # the JVM under libfaketime is slow to answer at first
        }
    elif kind == "etcd":
        clock, cluster = _etcd_under_clock()
        clocks, servers = [clock], [cluster]
        config = {"ENGINE": "leases.backends.etcd", "ENDPOINTS": cluster.endpoints}
    elif kind == "database":
        alias, server = request.getfixturevalue("fault_database")
        config = {"ENGINE": "leases.backends.database", "DATABASE": alias}
        clocks, servers = [request.getfixturevalue("clock")], [server]
    else:
        if libfaketime() is None:
            pytest.skip("libfaketime is not installed (apt-get install libfaketime faketime)")
        clocks = [FakeClock() for _ in range(1 if kind == "redis" else 3)]
        servers = _redis_under(clocks)
        if kind == "redis":
            config = {"ENGINE": "leases.backends.redis", "URL": servers[0].url}
        else:
            nodes = [s.url for s in servers]
            config = {"ENGINE": "leases.backends.redlock", "NODES": nodes, "NODE_TIMEOUT": 0.5}
    override = override_settings(
        LEASES={"BACKENDS": {"default": {"ENGINE": "leases.backends.database"}, CLOCKED: config}}
    )
    override.enable()
    try:
        if kind == "zookeeper":
            # Connected before the test (a first acquire's connection is bounded by its TTL),
            # to a JVM that libfaketime slows down most while it warms up.
            wait_until(_answers, 120, "the ZooKeeper server under libfaketime to answer")
        clocked = Clocked(kind, clocks, servers, slack=10.0 if kind == "zookeeper" else 0.0)
        clocked.await_shown()  # the module's server: put back to the true time, maybe late
        yield clocked
    finally:
        override.disable()
        if owned:
            for made in servers:
                made.destroy()
            for c in clocks:
                c.destroy()
        elif kind == "zookeeper":
            clocks[0].set(0)  # the module's server: back to the true time for the next test


def _answers() -> bool:
    try:
        get_backend(CLOCKED).inspect("warm-up")
    except LeaseError:
        return False
    return True


def holder_of(name: str) -> tuple[str, int] | None:
    info = get_backend(CLOCKED).inspect(name)
    return (info.holder, info.token) if info is not None and info.held else None


def test_a_threaded_servers_clock_shows_its_step_to_every_thread() -> None:
    """Eight threads of one process read a fake clock set 1,000 s behind, at once, for three
    seconds: not one read shows the true time. With the offset file re-read on every call
    about 1 read in 16,000 did (25 in three seconds here), and a ZooKeeper server stamped such
    a read on a write: a successor got in 3.25 s after a grant of 2 s whose server clock had
    stepped 3 s back, and a CI run failed."""
    if libfaketime() is None:
        pytest.skip("libfaketime is not installed (apt-get install libfaketime faketime)")
    readers = Path(__file__).with_name("clock_readers.py")
    with FakeClock(threaded=True) as clock:
        clock.set(-1000.0)
        limit = time.time() - 500  # a faked read is 1,000 s behind, a true one after this
        ran = subprocess.run(
            [sys.executable, str(readers), str(limit), "3"],
            env={**os.environ, **clock.env()},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    reads, wrong = (int(n) for n in ran.stdout.split())
    assert reads > 10_000, ran.stdout  # the threads really read, many times
    assert wrong == 0, f"{wrong} of {reads} reads showed the true time"


def test_forward_jump_lets_a_successor_in_and_the_old_holder_is_fenced(
    clocked: Clocked, lease_name: str
) -> None:
    """The server's clock steps forward 2 x TTL: its grant is gone at once, a successor gets a
    higher token while the old holder still believes it holds; the old holder's write after
    the successor's is refused, and its next renewal tells it that it lost."""
    ttl, register = 3.0, checker.new_register()
    fired: list[object] = []
    old = acquire(lease_name, ttl=ttl, backend=CLOCKED, holder="old", on_lost=fired.append)
    assert checker.record_write(register, old, "old")
    clocked.jump(2 * ttl)
    jumped_at = time.monotonic()
    new = acquire(lease_name, ttl=30, backend=CLOCKED, timeout=ttl + clocked.slack, holder="new")
    assert new.token > old.token
    assert checker.record_write(register, new, "new")
    assert not checker.record_write(register, old, "old")  # stale, or it already knows
    assert not checker.record_write(register, old.token, "old")  # the bare token: stale
    # The old holder learns at its next renewal (every TTL/3), never later than its validity.
    assert old.lost.wait(ttl + 2.0), "the old holder never learned that it lost"
    assert time.monotonic() - jumped_at <= ttl + 2.0
    wait_until(lambda: fired, 5, "on_lost to be called")
    with pytest.raises(LeaseLost):
        old.ensure_held()
    assert holder_of(lease_name) == ("new", new.token)
    new.release()
    summary = checker.check_history(register, [old.token, new.token])
    assert summary.accepted == 2 and summary.stale + summary.lost == 2


@dataclass
class ServerReads:
    """Every reading of a ZooKeeper server's clock the backend takes (``server_now()``, the
    ``mtime`` of a write), with the true time read around it. libfaketime, re-reading its
    offset file as a new second starts while several JVM threads read the clock, now and then
    hands one thread the true time: a stepped server then stamps one write unstepped (see
    :mod:`devservers.clock`). Such a reading is the fault injection failing, not the backend:
    a test that sees one runs its scenario again instead of judging the backend on it."""

    offset: float
    wrong: list[str] = field(default_factory=list)

    def watch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        session = get_backend(CLOCKED).zk  # type: ignore[attr-defined]
        read = session.server_now

        def server_now() -> int:
            before = time.time()
            stamped: int = read()
            self.check("server_now()", before, stamped / 1000, time.time())
            return stamped

        monkeypatch.setattr(session, "server_now", server_now)

    def check(self, what: str, before: float, stamped: float, after: float) -> None:
        """Record ``stamped`` (server seconds) as wrong unless it lies between the two true
        times, moved by the clock's offset (ms granularity, a generous half second)."""
        if not before + self.offset - 0.5 <= stamped <= after + self.offset + 0.5:
            self.wrong.append(
                f"{what} read {stamped - before:+.2f} s from the true time, "
                f"offset {self.offset:+.1f} s"
            )


def test_backward_jump_only_delays_a_successor(
    clocked: Clocked, lease_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's clock steps back J seconds under a holder that then vanishes (no renewal,
    no release): no successor gets in before the TTL, and one gets in within TTL + J (plus
    slack). On Redlock one node's step is outvoted: the successor waits only the TTL.

    On ZooKeeper the server's readings of its clock are checked too (:class:`ServerReads`):
    a run in which libfaketime handed the server the true time is run again, at most twice."""
    ttl, step = 2.0, 3.0
    delay = 0.0 if clocked.kind == "redlock" else step
    for attempt in range(3):
        name = f"{lease_name}:{attempt}"
        reads = ServerReads(offset=clocked.clocks[0].offset)
        before = time.time()
        abandoned = acquire(name, ttl=ttl, backend=CLOCKED, keepalive=False, holder="gone")
        started = abandoned.grant.sent_at
        if clocked.kind == "zookeeper":
            granted_ms = abandoned.grant.expires_at.timestamp() - ttl  # type: ignore[union-attr]
            reads.check("the grant's mtime", before, granted_ms, time.time())
        clocked.jump(-step, nodes=1)  # returns once the server shows it
        if clocked.kind == "zookeeper":
            reads.offset -= step
            reads.watch(monkeypatch)
        with pytest.raises(LeaseUnavailable):  # well inside the TTL: still held
            acquire(name, ttl=ttl, backend=CLOCKED, timeout=0, holder="early")
        successor = acquire(
            name, ttl=ttl, backend=CLOCKED, timeout=ttl + step + 10 + clocked.slack, holder="b"
        )
        waited = time.monotonic() - started
        successor.release()
        monkeypatch.undo()
        clocked.clocks[0].set(0.0)
        clocked.await_shown()
        if not reads.wrong:
            break
        print(f"attempt {attempt}: the fake clock failed the server: {reads.wrong}; again")
    else:
        pytest.fail(f"the fake clock failed the server in every attempt: {reads.wrong}")
    assert successor.token > abandoned.token
    assert waited >= ttl, f"a successor got in {waited:.2f}s after the grant, TTL {ttl}s"
    assert waited >= ttl + delay - 0.5, f"the step of {step}s did not delay ({waited:.2f}s)"
    bound = ttl + delay + 5.0 + clocked.slack
    assert waited <= bound, f"waited {waited:.2f}s, bound {ttl + delay}s + slack"


@pytest.mark.parametrize("clocked", ["redlock"], indirect=True)
def test_redlock_one_node_jump_is_outvoted_a_majority_jump_is_fenced(
    clocked: Clocked, lease_name: str
) -> None:
    """One of three nodes steps forward 2 x TTL: its key expires, but the two others still hold,
    so no successor gets a quorum and the holder keeps its lease through renewals. A second
    node steps too: the majority has forgotten the grant, a successor acquires with a higher
    token, and the fence refuses the old holder."""
    ttl, register = 3.0, checker.new_register()
    old = acquire(lease_name, ttl=ttl, backend=CLOCKED, holder="old")
    assert checker.record_write(register, old, "old")
    clocked.jump(2 * ttl, nodes=1)
    with pytest.raises(LeaseUnavailable):
        acquire(lease_name, ttl=ttl, backend=CLOCKED, timeout=ttl / 2, holder="outvoted")
    renewed_after = time.monotonic()
    wait_until(
        lambda: old.grant.sent_at > renewed_after or old.lost.is_set(),
        2 * ttl,
        "a renewal after the first node's step",
    )
    old.ensure_held()
    assert checker.record_write(register, old, "old")
    clocked.clocks[1].jump(2 * ttl)
    new = acquire(lease_name, ttl=30, backend=CLOCKED, timeout=ttl, holder="new")
    assert new.token > old.token
    assert checker.record_write(register, new, "new")
    assert not checker.record_write(register, old.token, "old")
    assert old.lost.wait(ttl + 2.0), "the old holder never learned that it lost"
    new.release()
    checker.check_history(register, [old.token, new.token])


@pytest.mark.parametrize("clocked", ["zookeeper"], indirect=True)
def test_zookeeper_session_outlives_clock_steps(clocked: Clocked, lease_name: str) -> None:
    """ZooKeeper expires sessions on its monotonic clock: steps of the server's wall clock (a
    minute forward, then two back) move the ``mtime`` it stamps, but leave the session, and
    with it the znodes of every grant made on it, alive past the session timeout."""
    store = get_backend(CLOCKED)
    session = store.zk.session()  # type: ignore[attr-defined]
    session_timeout = store.zk.session_timeout  # type: ignore[attr-defined]
    for step in (60.0, -120.0):
        clocked.jump(step)  # returns once the server stamps its writes with the step
        time.sleep(session_timeout + 1)  # an expiry on the wall clock would have happened
        assert store.zk.session() == session  # type: ignore[attr-defined]
        assert store.inspect(lease_name) is None  # and the session still serves
