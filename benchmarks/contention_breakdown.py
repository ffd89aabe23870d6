"""Where the time of one grant goes when eight processes contend for one name (issue 14).

``python -m benchmarks.contention_breakdown [--rounds N] [--seconds S]`` (in the worktree's
environment) runs :mod:`benchmarks.handoff_limits`' three contended loops (the database
backend, the queue-lock prototype, django-pglock) on one throwaway server with
``pg_stat_statements``, alternating kinds, and reports per grant:

- the statements the server ran (calls and mean execution time, from ``pg_stat_statements``
  with utility statements tracked: ``LISTEN``, ``BEGIN``, ``COMMIT`` count too);
- for the backend, the client's round trips by kind and the wall time and client CPU its
  contenders spent in each step (instrumented in each contender: the room's entry, its waits,
  tries, releases);
- failed tries per grant;
- client CPU (``time.process_time`` of each contender) and server CPU (``utime + stime`` of
  every server process, from ``/proc``), each with its kernel part, and context switches, per
  grant. On a machine of two cores, eight contenders keep the CPU busy: grants per second then
  follow CPU per grant, not the latency of a hand-off's hops (which is why a hop fewer gained
  nothing), so CPU is what this reports first;
- how often the process that released takes the name straight back (the next grant in
  grant order is its own): a fair rotation of eight processes gives 0, chance about 1/8.

Not a ``bench_`` topic: it explains a figure, it is not one.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import multiprocessing
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.arguments import at_least, listed, positive_seconds
from benchmarks.handoff_limits import PROCESSES, _queue_lock
from devservers import PostgresServer

_TICK = os.sysconf("SC_CLK_TCK")
#: The contended loops this tool runs: the database backend, the queue-lock prototype
#: (:mod:`benchmarks.handoff_limits`), django-pglock.
KINDS = ("backend", "queue-lock", "pglock")


def _switches(pid: int | str = "self") -> int:
    """Context switches (voluntary: it slept, woken later; and involuntary) of ``pid`` so far."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return sum(int(line.split()[1]) for line in status if "ctxt_switches" in line)
    except OSError:
        return 0


def _server_cpu(postmaster: int) -> dict[int, tuple[float, int, float]]:
    """CPU seconds (user + system) and context switches of the postmaster and each of its
    children, by pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(entry), int(fields[1])
        if pid == postmaster or ppid == postmaster:
            system = int(fields[12]) / _TICK
            found[pid] = (int(fields[11]) / _TICK + system, _switches(pid), system)
    return found


class _Steps:
    """Calls and wall seconds per instrumented step, in one contender."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)

    def wrap(self, owner: Any, attribute: str, label: str | None = None) -> None:
        original = getattr(owner, attribute, None)
        if original is None:  # another protocol's branch: what it lacks is not counted
            return
        label = label or attribute

        def timed(*args: Any, **kwargs: Any) -> Any:
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.calls[label] += 1
                self.seconds[label] += time.perf_counter() - started
                self.seconds[f"cpu:{label}"] += time.thread_time() - cpu

        setattr(owner, attribute, timed)


def _instrument_backend(steps: _Steps) -> None:
    """Count the backend's round trips and time its steps in this (forked) process."""
    from leases.backends import _pgconn, _waiting_room, database

    steps.wrap(_pgconn.PrivateConnection, "run", "own conn: statement (1 RT)")
    steps.wrap(_waiting_room, "_execute", "room conn: simple statement (1 RT)")
    steps.wrap(_waiting_room, "run_prepared", "room conn: prepared try (1 RT)")
    steps.wrap(_waiting_room, "_send", "room conn: leave sent, reply not awaited")
    steps.wrap(_waiting_room, "_settle", "room conn: settle leave reply")
    steps.wrap(_waiting_room.WaitingRoom, "_enter", "room: enter (conn + queue + LISTEN + look)")
    steps.wrap(_waiting_room.WaitingRoom, "_connection", "room: get connection")
    steps.wrap(_waiting_room.WaitingRoom, "wait", "room: wait for NOTIFY")
    steps.wrap(_waiting_room.WaitingRoom, "_leave", "room: leave")
    steps.wrap(database.Backend, "try_acquire", "try_acquire")
    steps.wrap(database.Backend, "release", "release")
    steps.wrap(database.Backend, "wait_for_release", "wait_for_release")

    original = database.Backend.try_acquire

    def counted(self: Any, *args: Any) -> Any:
        grant = original(self, *args)
        steps.calls["try_acquire: refused" if grant is None else "try_acquire: granted"] += 1
        return grant

    database.Backend.try_acquire = counted  # type: ignore[method-assign,assignment]


def _contender(
    kind: str, name: str, seconds: float, ready: Any, start: Any, done: Any, results: Any
) -> None:
    from django.db import connections

    connections.close_all()
    steps = _Steps()
    once: Callable[[], None]
    stamps: list[float] = []
    if kind == "backend":
        from leases import acquire

        def once() -> None:
            held = acquire(name, ttl=30, keepalive=False, timeout=30)
            stamps.append(time.monotonic())
            held.release()

    elif kind == "pglock":
        import pglock

        def once() -> None:
            with pglock.advisory(name, xact=True):
                stamps.append(time.monotonic())

    else:
        import psycopg

        take = _queue_lock(name, psycopg.connect(os.environ["DATABASE_URL"], autocommit=True))

        def once() -> None:
            release = take()
            stamps.append(time.monotonic())
            release()

    once()  # warm up (see handoff_limits._contender)
    if kind == "backend":
        _instrument_backend(steps)
    stamps.clear()
    ready.release()
    profile_to = os.environ.get("BREAKDOWN_PROFILE") if kind == "backend" else None
    profiler = None
    if profile_to:  # every contender, each to a file of its own
        import cProfile

        profiler = cProfile.Profile(time.process_time)  # CPU, not waits
    start.wait()
    cpu, switches, kernel = time.process_time(), _switches(), os.times().system
    deadline = time.monotonic() + seconds
    if profiler is not None:
        profiler.enable()
    while time.monotonic() < deadline:
        once()
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(f"{profile_to}.{os.getpid()}")
    cpu, switches = time.process_time() - cpu, _switches() - switches
    steps.seconds["(client CPU in the kernel)"] = os.times().system - kernel
    steps.calls["context switches (client)"] = switches
    results.put((os.getpid(), stamps, cpu, dict(steps.calls), dict(steps.seconds)))
    done.wait(60)  # keep the sessions open until the parent has read the server's CPU


def _session_kind(query: str) -> str:
    """Which of a contender's sessions ran ``query`` last (what ``pg_stat_activity`` shows)."""
    if "UNLISTEN" in query or "pg_advisory_lock" in query or "room_acquire" in query:
        return "room connections"
    if "leases_release" in query or "leases_acquire" in query:
        return "own connections"
    if "freed AS" in query or "INSERT INTO leases_lease" in query:
        return "prototype connections"
    if "pg_advisory_xact_lock" in query or query.strip() in {"BEGIN", "COMMIT"}:
        return "pglock connections"
    if "pg_stat_activity" in query:
        return "this report's session"
    return "other sessions"


def _statements(conn: Any) -> list[tuple[str, int, float, int]]:
    rows = conn.execute(
        "SELECT query, calls, total_exec_time, rows FROM pg_stat_statements "
        "WHERE query NOT ILIKE '%pg_stat_statements%' ORDER BY calls DESC"
    ).fetchall()
    return [(" ".join(q.split())[:70], int(c), float(t), int(r)) for q, c, t, r in rows]


def contended(kind: str, seconds: float, server: PostgresServer, admin: Any) -> dict[str, Any]:
    from django.db import connections

    context = multiprocessing.get_context("fork")
    name = f"breakdown:{kind}:{uuid.uuid4().hex[:8]}"
    ready, start, done = context.Semaphore(0), context.Event(), context.Event()
    results = context.Queue()
    connections.close_all()
    procs = [
        context.Process(target=_contender, args=(kind, name, seconds, ready, start, done, results))
        for _ in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        if not ready.acquire(timeout=60):
            raise RuntimeError(f"{kind}: a contender did not get ready")
    assert server.proc is not None
    tracked = bool(
        admin.execute("SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements'").fetchall()
    )
    if tracked:
        admin.execute("SELECT pg_stat_statements_reset()")
    cpu_before = _server_cpu(server.proc.pid)
    start.set()
    found = [results.get(timeout=seconds + 60) for _ in procs]
    cpu_after = _server_cpu(server.proc.pid)
    sessions = admin.execute("SELECT pid, query FROM pg_stat_activity").fetchall()
    statements = _statements(admin) if tracked else []
    done.set()
    for proc in procs:
        proc.join(10)
    zero = (0.0, 0, 0.0)
    server_cpu = sum(cpu - cpu_before.get(pid, zero)[0] for pid, (cpu, *_) in cpu_after.items())
    server_switches = sum(n - cpu_before.get(pid, zero)[1] for pid, (_, n, _) in cpu_after.items())
    server_kernel = sum(k - cpu_before.get(pid, zero)[2] for pid, (*_, k) in cpu_after.items())
    by_session: collections.defaultdict[str, float] = collections.defaultdict(float)
    kinds = {pid: _session_kind(query or "") for pid, query in sessions}
    for pid, (cpu, *_) in cpu_after.items():
        by_session[kinds.get(pid, "server's own processes")] += cpu - cpu_before.get(pid, zero)[0]
    grants = sorted((stamp, pid) for pid, stamps, *_ in found for stamp in stamps)
    again = sum(1 for a, b in itertools.pairwise(grants) if a[1] == b[1])
    calls: collections.Counter[str] = collections.Counter()
    walls: collections.defaultdict[str, float] = collections.defaultdict(float)
    for *_, step_calls, step_seconds in found:
        calls.update(step_calls)
        for step, spent in step_seconds.items():
            walls[step] += spent
    calls["context switches (server)"] = server_switches
    walls["(server CPU in the kernel)"] = server_kernel
    return {
        "grants": len(grants),
        "rate": len(grants) / seconds,
        "shares": sorted((len(stamps) for _, stamps, *_ in found), reverse=True),
        "again": again / max(1, len(grants) - 1),
        "client_cpu": sum(cpu for _, _, cpu, *_ in found),
        "server_cpu": server_cpu,
        "by_session": by_session,
        "statements": statements,
        "calls": calls,
        "walls": walls,
    }


def report(kind: str, got: dict[str, Any], seconds: float) -> None:
    n = max(1, got["grants"])
    print(
        f"\n== {kind}: {got['rate']:.0f} grants/s, shares {'/'.join(map(str, got['shares']))}, "
        f"releaser took it again {got['again'] * 100:.0f} % (load {os.getloadavg()[0]:.1f})"
    )
    print(
        f"   per grant: client CPU {got['client_cpu'] / n * 1e6:.0f} us (all 8 processes; "
        f"{got['walls']['(client CPU in the kernel)'] / n * 1e6:.0f} in the kernel), "
        f"server CPU {got['server_cpu'] / n * 1e6:.0f} us "
        f"({got['walls']['(server CPU in the kernel)'] / n * 1e6:.0f} in the kernel), "
        f"wall {PROCESSES * seconds / n * 1e6:.0f}"
        f" us of process time ({seconds * 1e6 / n:.0f} us of elapsed time)"
    )
    print(
        "   server CPU per grant by session (from its last statement): "
        + ", ".join(
            f"{kind} {cpu / n * 1e6:.0f} us" for kind, cpu in sorted(got["by_session"].items())
        )
    )
    print("   statements per grant (pg_stat_statements): calls/grant, mean exec us, rows/call")
    for query, calls, total, rows in got["statements"]:
        if calls / n < 0.005:
            continue
        print(f"     {calls / n:6.2f}  {total / calls * 1e3:7.1f} us  {rows / calls:5.2f}  {query}")
    if got["calls"]:
        print(
            "   client steps per grant (all processes; nested steps overlap): calls/grant, "
            "wall us/grant, wall us/call, client CPU us/grant"
        )
        for step in sorted(got["calls"]):
            wall = got["walls"].get(step)
            calls = got["calls"][step]
            extra = "" if wall is None else f"{wall / n * 1e6:9.0f}  {wall / calls * 1e6:8.0f}"
            cpu = got["walls"].get(f"cpu:{step}")
            extra += "" if cpu is None else f"  {cpu / n * 1e6:6.0f}"
            print(f"     {calls / n:6.2f} {extra:27s}  {step}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.contention_breakdown")
    parser.add_argument("--rounds", type=at_least(1), default=1)
    parser.add_argument("--seconds", type=positive_seconds, default=3.0)
    parser.add_argument("--kinds", type=listed(str, KINDS), default=",".join(KINDS))
    parser.add_argument(
        "--plain", action="store_true", help="no pg_stat_statements (its cost off the CPU figures)"
    )
    parser.add_argument("--profile", help="cProfile one backend contender's window into this file")
    args = parser.parse_args(argv)
    if args.profile:
        os.environ["BREAKDOWN_PROFILE"] = args.profile
    settings = {
        "shared_preload_libraries": "pg_stat_statements",
        "pg_stat_statements.track": "all",
        "pg_stat_statements.track_utility": "on",
    }
    if args.plain:
        settings = {}
    server = PostgresServer(settings=settings).start()
    try:
        import psycopg

        os.environ["DATABASE_URL"] = server.url
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")
        os.environ.setdefault("DJANGO_DEBUG", "0")
        import django
        from django.core.management import call_command
        from django.test import override_settings

        django.setup()
        call_command("migrate", verbosity=0)
        admin = psycopg.connect(server.url, autocommit=True)
        if not args.plain:
            admin.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        backends = {"default": {"ENGINE": "leases.backends.database"}}
        with override_settings(DEBUG=False, LEASES={"BACKENDS": backends}):
            for round_ in range(args.rounds):
                for kind in args.kinds:
                    print(f"\n--- round {round_}", end="")
                    report(kind, contended(kind, args.seconds, server, admin), args.seconds)
                    sys.stdout.flush()
        admin.close()
        return 0
    finally:
        server.destroy()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
