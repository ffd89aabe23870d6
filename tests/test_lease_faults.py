"""Leases under faults: paused, killed and resumed holders, an unreachable or crashed store.

Holders are real processes (``tests/lease_worker.py``) paused with SIGSTOP and killed with
SIGKILL; every write goes through the shared fenced register and its checker.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from leases import BackendUnavailable, LeaseLost, LeaseUnavailable, acquire, lease
from leases.backends import get_backend
from tests.checker import STALE, check_history, history, new_register, record_write
from tests.lease_backends import lease_backend, lease_name
from tests.waiting import wait_until

__all__ = ["lease_backend", "lease_name"]

pytestmark = pytest.mark.fault


class Workers:
    """Child processes of ``tests.lease_worker`` and the JSON events they print."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.python, self.env = python, env
        self.procs: list[subprocess.Popen[str]] = []
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def spawn(self, *args: object) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [self.python, "-m", "tests.lease_worker", *map(str, args)],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        return proc

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                with self._lock:
                    self.events.append({"pid": proc.pid, **json.loads(line)})

    def of(self, event: str, pid: int | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e["event"] == event and pid in (None, e["pid"])]

    def of_pid(self, pid: int) -> list[dict[str, Any]]:
        """Every event of process ``pid``."""
        with self._lock:
            return [e for e in self.events if e["pid"] == pid]

    def wait_for(self, event: str, pid: int | None = None, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.of(event, pid)
            if found:
                return found[-1]
            time.sleep(0.02)
        raise AssertionError(f"no {event!r} event within {timeout}s; events: {self.events}")

    def holder(self) -> dict[str, Any] | None:
        """The latest acquisition not yet followed by a release or loss from that process."""
        with self._lock:
            state: dict[int, dict[str, Any] | None] = {}
            for e in self.events:
                if e["event"] == "acquired":
                    state[e["pid"]] = e
                elif e["event"] in ("released", "lost"):
                    state[e["pid"]] = None
        current = [e for pid, e in state.items() if e is not None and alive(pid)]
        return max(current, key=lambda e: e["at"], default=None)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with_suppressed(os.kill, proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=10)


def alive(pid: int) -> bool:
    """Running and not a zombie (a killed worker may not be reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):  # ESRCH: it exited mid-read
        return False
    return state not in ("Z", "X")


def with_suppressed(fn: Any, *args: Any) -> None:
    with contextlib.suppress(ProcessLookupError):
        fn(*args)


@pytest.fixture
def workers(python: str, child_env: dict[str, str]) -> Iterator[Workers]:
    pool = Workers(python, child_env)
    try:
        yield pool
    finally:
        pool.kill_all()


def test_contenders_paused_and_killed_never_break_the_fence(
    lease_backend: str, lease_name: str, workers: Workers
) -> None:
    """8 processes contend; holders are paused until taken over or killed at random.

    The fenced register's history passes every check, grants' tokens strictly increase, and a
    killed holder's lease is taken over within its TTL plus a small slack. Every fault is
    followed by what it must cause (a takeover, the paused holder's late step) before the
    workers are told to stop: waited for, not slept.
    """
    ttl, slack = 1.0, 1.5
    seconds = 120.0  # only a bound: the workers stop when told
    register = new_register()
    # One process forks the 8: eight interpreters setting Django up took longer than the faults.
    forker = workers.spawn("contenders", lease_backend, lease_name, register, ttl, seconds, 8)
    workers.wait_for("acquired")
    rng = random.Random()
    kills: list[tuple[float, dict[str, Any]]] = []
    resumed: list[tuple[float, dict[str, Any]]] = []  # when each paused holder was resumed
    # Faults for 4.5 s (at most 5); each pause lasts until another process was granted the
    # lease (so the paused holder's next write comes after its successor's grant), and a little
    # longer at random.
    end = time.monotonic() + 4.5
    while time.monotonic() < end and len(kills) + len(resumed) < 5:
        time.sleep(rng.uniform(0.2, 0.5))
        current = workers.holder()
        if current is None:
            continue
        if len(resumed) <= len(kills):
            os.kill(current["pid"], signal.SIGSTOP)
            wait_until(lambda: _taken_over(workers, current), 30, f"a successor of {current}")
            time.sleep(rng.uniform(0, 0.5) * ttl)
            os.kill(current["pid"], signal.SIGCONT)
            resumed.append((time.monotonic(), current))
        elif len(kills) < 2:
            os.kill(current["pid"], signal.SIGKILL)
            kills.append((time.monotonic(), current))
    killed = {victim["pid"] for _, victim in kills}

    def consequences_seen() -> bool:
        taken_over = all(_taken_over(workers, victim, after=at) for at, victim in kills)
        stepped = all(
            any(e["at"] > at for e in workers.of_pid(paused["pid"]))
            for at, paused in resumed
            if paused["pid"] not in killed
        )
        accepted = [e for e in workers.of("wrote") if e["accepted"]]
        writers = {e["pid"] for e in accepted}
        return taken_over and stepped and len(accepted) >= 5 and len(writers) >= 3

    wait_until(consequences_seen, 60, "the takeovers and late steps the faults must cause")
    assert forker.stdin is not None
    forker.stdin.write("stop\n")
    forker.stdin.flush()
    forker.wait(timeout=60)
    assert len(resumed) >= 2 and kills, (resumed, kills)
    grants = sorted(workers.of("acquired"), key=lambda e: e["sent"])
    summary = check_history(register, grants=[e["token"] for e in grants])
    # Liveness, not throughput: every pause and kill forces a takeover by another writer, so
    # at least that many accepted writes by at least three writers must appear even when a
    # loaded machine runs the contenders slowly (the checker above is what proves safety).
    assert summary.accepted >= 5 and len(summary.writers) >= 3, summary
    for killed_at, victim in kills:
        later = [e for e in grants if e["token"] > victim["token"] and e["at"] > killed_at]
        assert later, f"nobody took over {victim} after it was killed"
        assert later[0]["at"] - killed_at <= ttl + slack, (victim, later[0], killed_at)


def _taken_over(workers: Workers, holder: dict[str, Any], after: float = 0.0) -> bool:
    """Whether another grant with a higher token than ``holder``'s came after ``after``."""
    return any(
        e["token"] > holder["token"] and e["at"] > after and e["pid"] != holder["pid"]
        for e in workers.of("acquired")
    )


def test_paused_holder_is_fenced_off_and_cannot_harm_its_successor(
    lease_backend: str, lease_name: str, workers: Workers
) -> None:
    """Kleppmann's scenario: pause the holder for 2x its TTL while another takes over."""
    ttl = 1.0
    register = new_register()
    paused = workers.spawn("hold", lease_backend, lease_name, register, ttl)
    first = workers.wait_for("acquired", paused.pid)
    assert first["accepted"]
    os.kill(paused.pid, signal.SIGSTOP)
    time.sleep(2 * ttl)
    successor = acquire(lease_name, ttl=5, backend=lease_backend, timeout=5, holder="successor")
    assert successor.token > first["token"]
    assert record_write(register, successor, "successor")
    os.kill(paused.pid, signal.SIGCONT)
    assert paused.stdin is not None
    paused.stdin.write("go\n")
    paused.stdin.flush()
    resumed = workers.wait_for("resumed", paused.pid, timeout=30)
    assert resumed["write"] is False
    late = [a for a in history(register) if a.writer == first["holder"]][-1]
    assert late.outcome == STALE and late.stored == successor.token
    assert resumed["ensure_held"] == "LeaseLost" and resumed["release"] == "LeaseLost"
    info = get_backend(lease_backend).inspect(lease_name)
    assert info is not None and info.held
    assert (info.holder, info.token) == ("successor", successor.token)
    successor.ensure_held()
    successor.release()
    check_history(register, grants=[first["token"], successor.token])


def fault_backends(alias: str) -> dict[str, Any]:
    leases: dict[str, Any] = settings.LEASES
    backends = dict(leases["BACKENDS"])
    backends["fault"] = {"ENGINE": "leases.backends.database", "DATABASE": alias}
    return {**leases, "BACKENDS": backends}


@pytest.mark.parametrize("fault", ["stop", "pause"])
def test_unreachable_store_fires_on_lost_within_the_ttl(
    fault_database: tuple[str, Any], fault: str
) -> None:
    """The store stops (connections refused) or hangs (SIGSTOP): loss is reported in time.

    A hung store blocks the renewal call itself, so this also proves the watchdog reports the
    loss without waiting for the stuck renewal.
    """
    alias, server = fault_database
    ttl = 1.0
    fired: list[float] = []
    with override_settings(LEASES=fault_backends(alias)):
        held = acquire(
            "renewal-failure",
            ttl=ttl,
            backend="fault",
            on_lost=lambda _: fired.append(time.monotonic()),
        )
        try:
            time.sleep(0.2)
            faulted_at = time.monotonic()
            if fault == "stop":
                server.stop("immediate")
            else:
                server.pause()  # postmaster and every backend, the lease's session included
            deadline = time.monotonic() + 3 * ttl
            while not fired and time.monotonic() < deadline:
                time.sleep(0.01)
            assert fired, "on_lost never fired"
            assert fired[0] - faulted_at <= ttl + 0.2
            assert held.lost.is_set() and held.remaining() == 0
            with pytest.raises(LeaseLost):
                held.ensure_held()
        finally:
            server.resume()
        with pytest.raises((LeaseLost, BackendUnavailable)):
            held.release()


def test_tokens_never_go_backwards_across_an_immediate_restart(
    fault_database: tuple[str, Any],
) -> None:
    alias, server = fault_database
    with override_settings(LEASES=fault_backends(alias)):
        before: dict[str, int] = {}
        for name in ("restart-a", "restart-b"):
            for _ in range(3):
                with lease(name, ttl=1, backend="fault", timeout=0) as held:
                    before[name] = held.token
        kept = acquire("restart-held", ttl=30, backend="fault", keepalive=False)
        server.restart("immediate")
        for name in ("restart-a", "restart-b"):
            with lease(name, ttl=1, backend="fault", timeout=5) as held:
                assert held.token > before[name]
        info = get_backend("fault").inspect("restart-held")
        assert info is not None and info.held and info.token == kept.token
        with pytest.raises(LeaseUnavailable):
            acquire("restart-held", ttl=1, backend="fault", timeout=0, holder="other")
        kept.release()
        with lease("restart-held", ttl=1, backend="fault", timeout=0) as successor:
            assert successor.token > kept.token


def test_a_short_store_outage_is_retried_within_the_validity(
    fault_database: tuple[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Renewal fails while the server is down, is retried with backoff, and succeeds in time."""
    alias, server = fault_database
    lost: list[Any] = []
    with override_settings(LEASES=fault_backends(alias)), caplog.at_level("WARNING", "leases"):
        held = acquire("outage", ttl=6, backend="fault", on_lost=lost.append)
        server.stop("fast")
        time.sleep(2.6)  # the renewal due at 2 s has failed at least once
        assert "retrying" in caplog.text
        held.ensure_held()
        restarted = time.monotonic()
        server.start()
        deadline = time.monotonic() + 4
        while held.grant.sent_at < restarted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held.grant.sent_at >= restarted, "no renewal succeeded after the outage"
        held.ensure_held()
        assert not lost
        held.release()
