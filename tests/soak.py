"""The nemesis soak (``./scripts/soak``): many processes contend for leases while faults rain.

For each backend (database, redis, redlock, etcd, zookeeper) the controller starts servers of
its own, then 16 worker processes (``--procs``) that loop until the deadline (``--seconds``,
default 60): pick one of a few names, acquire it, write the shared fenced register of that name
(:mod:`tests.checker`) with the lease, sometimes write again after a pause, release. Half the
workers reach the servers through :class:`~devservers.proxy.FaultProxy` instances, half
directly, so a network fault splits them as a real partition would. Meanwhile a nemesis, driven
by a seeded random generator, injects one fault at a time:

- ``pause``: SIGSTOP a worker for 1.2-2x the TTL (past its validity), then SIGCONT it;
- ``kill``: SIGKILL a worker and start a new one in its place;
- ``blackhole``: the proxied half's traffic held (no answer, no reset) for 1-2x the TTL;
- ``delay``: the proxied half's traffic delayed 50-400 ms each way for 1-3 s;
- ``restart``: the store restarted (PostgreSQL crash-restart, Redis restarted empty, one
  Redlock node, one etcd or ZooKeeper member).

At the end the checker runs on every register's whole history: accepted tokens never go down,
no token accepted from two writers, every stale refusal explained, the register's row is the
last accepted write. The summary gives, per backend and in total, the critical sections (grants
that wrote at least once), the faults injected, the violations, and the workers that broke the
error contract (an exception from ``acquire`` or ``release`` that is not a ``LeaseError``, or a
worker that crashed or hung): both must be 0 (the exit status is 1 otherwise). The seed is
printed first; on a violation the history is saved to a JSON file that ``--check FILE`` runs
the checker on again.

Every loop is bounded by the deadline; every fault by its own duration; the workers are
SIGKILLed if they outlive the deadline by 20 s. Not part of ``.ci/run``: a few-second run on
one backend is (``tests/test_soak.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("database", "redis", "redlock", "etcd", "zookeeper")
FAULTS = ("pause", "kill", "blackhole", "delay", "restart")
#: Lease TTL in seconds (etcd's minimum with the test cluster's timings is 1 s; ZooKeeper's
#: session must lie within 1-10 s with a 500 ms tick).
TTL = 2.0
#: The longest the controller waits for its workers to be set up before it starts anyway.
SETUP_BOUND = 180.0
#: A worker's exit status when the package raised something other than ``LeaseError``.
FOREIGN_EXIT = 3


# -- the worker -------------------------------------------------------------------------------


def worker(index: int, names: list[str], seed: int) -> int:
    """Acquire, write, release, until the deadline the controller sends on stdin.

    Django's setup takes seconds of CPU, and 16 processes starting at once on a busy machine
    take tens of seconds: so a worker says ``ready`` when set up, and the controller starts the
    clock (``time.monotonic()``, system-wide on Linux) once every worker has.
    """
    import django

    django.setup()
    from leases import LeaseError, acquire
    from tests.checker import record_write

    print("ready", flush=True)
    until = float(sys.stdin.readline() or 0)

    rng = random.Random(seed * 1000 + index)
    holder = f"w{index}.{os.getpid()}"
    # Counts, and seconds (floats): typeshed's Counter holds only ints.
    stats = cast("dict[str, float]", Counter())
    foreign = 0  # errors from the package that are not LeaseError: a broken contract
    began = time.monotonic()
    while time.monotonic() < until:
        name = rng.choice(names)
        try:
            left = until - time.monotonic()
            t0 = time.monotonic()
            # Renewal threads cost CPU the soak needs for critical sections: a quarter of the
            # grants run one (and are renewed through faults), the rest live on their TTL.
            held = acquire(
                name,
                ttl=TTL,
                backend="soak",
                timeout=max(0.0, min(2 * TTL, left)),
                keepalive=rng.random() < 0.25,
            )
            stats["acquire_s"] += time.monotonic() - t0
            stats["acquired"] += 1
        except LeaseError:
            stats["acquire_s"] += time.monotonic() - t0
            stats["refused"] += 1
            continue
        except Exception as exc:  # a soak keeps going; the exit status reports it
            print(f"{holder}: acquire: {type(exc).__name__}: {exc}", file=sys.stderr)
            foreign += 1
            time.sleep(0.1)
            continue
        try:
            record_write(name, held, holder)
            if rng.random() < 0.1:  # a second write, a little later: faults land in between
                time.sleep(rng.uniform(0, 0.05))
                record_write(name, held, holder)
        except Exception as exc:
            print(f"{holder}: write: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            try:
                held.release()
            except LeaseError:
                pass
            except Exception as exc:
                print(f"{holder}: release: {type(exc).__name__}: {exc}", file=sys.stderr)
                foreign += 1
    if os.environ.get("SOAK_DEBUG"):
        print(holder, dict(stats), f"ran {time.monotonic() - began:.1f}s", file=sys.stderr)
    return FOREIGN_EXIT if foreign else 0


# -- servers and proxies ----------------------------------------------------------------------


@dataclass
class Store:
    """One backend's servers, a proxy in front of each, and how to restart them."""

    kind: str
    servers: list[Any]
    proxies: list[Any] = field(default_factory=list)

    def options(self, proxied: bool) -> dict[str, Any]:
        ports = [p.port for p in self.proxies] if proxied else self.ports()
        urls = [f"127.0.0.1:{port}" for port in ports]
        if self.kind == "database":
            return {"ENGINE": "leases.backends.database", "DATABASE": "locks"}
        if self.kind == "redis":
            return {"ENGINE": "leases.backends.redis", "URL": f"redis://{urls[0]}/0"}
        if self.kind == "redlock":
            nodes = [f"redis://{u}/0" for u in urls]
            return {"ENGINE": "leases.backends.redlock", "NODES": nodes, "NODE_TIMEOUT": 0.5}
        if self.kind == "etcd":
            endpoints = [f"http://{u}" for u in urls]
            return {"ENGINE": "leases.backends.etcd", "ENDPOINTS": endpoints, "REQUEST_TIMEOUT": 1}
        hosts = ",".join(urls)
        return {"ENGINE": "leases.backends.zookeeper", "HOSTS": hosts, "SESSION_TIMEOUT": 2}

    def ports(self) -> list[int]:
        if self.kind == "etcd":
            return [m.client_port for m in self.servers[0].members]
        if self.kind == "zookeeper":
            ensemble = self.servers[0]
            return [ensemble.ports[i] for i in ensemble.ids]
        return [s.port for s in self.servers]

    def locks_url(self, proxied: bool) -> str:
        if self.kind != "database":
            return ""
        port = self.proxies[0].port if proxied else self.servers[0].port
        return f"postgres://postgres@127.0.0.1:{port}/postgres"

    def restart(self, rng: random.Random) -> None:
        if self.kind == "database":
            self.servers[0].restart("immediate")
        elif self.kind in ("redis", "redlock"):
            rng.choice(self.servers).restart("kill")
        elif self.kind == "etcd":
            cluster = self.servers[0]
            cluster.restart(rng.randrange(len(cluster.members)))
        else:
            ensemble = self.servers[0]
            member = rng.choice(ensemble.ids)
            ensemble.restart(member)
            with contextlib.suppress(RuntimeError):
                ensemble.wait_ready(timeout=30, members=[member])

    def destroy(self) -> None:
        for proxy in self.proxies:
            proxy.close()
        for server in self.servers:
            server.destroy()


def start_store(kind: str) -> Store:
    from devservers import PostgresServer, RedisServer
    from devservers.etcd import EtcdCluster, etcd_binary
    from devservers.proxy import FaultProxy
    from devservers.zookeeper import ZooKeeperEnsemble, zookeeper_classpath

    servers: list[Any]
    if kind == "database":
        servers = [PostgresServer().start()]
    elif kind == "redis":
        servers = [RedisServer().start()]
    elif kind == "redlock":
        servers = [RedisServer().start() for _ in range(3)]
    elif kind == "etcd":
        if etcd_binary() is None:
            raise Unavailable("etcd is not installed (apt-get install etcd-server)")
        servers = [EtcdCluster().start()]
    else:
        if zookeeper_classpath() is None:
            raise Unavailable("ZooKeeper is not installed (apt-get install zookeeper)")
        servers = [ZooKeeperEnsemble().start()]
    store = Store(kind, servers)
    store.proxies = [FaultProxy(port, max_connections=1024) for port in store.ports()]
    return store


class Unavailable(RuntimeError):
    """A backend's servers are not installed: that backend is skipped, and the run says so."""


# -- the nemesis ------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    sections: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    broken: int = 0
    seconds: float = 0.0
    saved: str = ""
    skipped: str = ""

    def line(self) -> str:
        if self.skipped:
            return f"soak {self.kind}: skipped ({self.skipped})"
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items()))
        saved = f"; history saved to {self.saved}" if self.saved else ""
        return (
            f"soak {self.kind}: {self.sections} critical sections, "
            f"{sum(self.faults.values())} faults ({kinds or 'none'}), "
            f"{len(self.violations)} violations, {self.broken} workers broke the error "
            f"contract, {self.seconds:.1f} s{saved}"
        )


class Run:
    """The workers of one backend and the nemesis that torments them."""

    def __init__(self, store: Store, args: argparse.Namespace, rng: random.Random) -> None:
        self.store, self.args, self.rng = store, args, rng
        tag = f"soak-{store.kind}-{args.seed}-{uuid.uuid4().hex[:6]}"
        self.names = [f"{tag}-{i}" for i in range(max(2, args.procs // args.per_name))]
        self.until = 0.0  # set when every worker is ready
        self.procs: dict[int, tuple[subprocess.Popen[bytes], bool]] = {}
        self.next_index = 0
        self.faults: Counter[str] = Counter()
        self.broken = 0  # workers that exited with an error of their own, not the nemesis's

    def spawn(self, proxied: bool) -> None:
        index, self.next_index = self.next_index, self.next_index + 1
        env = dict(os.environ)
        env.update(
            DJANGO_SETTINGS_MODULE="tests.soak_settings",
            SOAK_BACKEND=json.dumps(self.store.options(proxied)),
            SOAK_LOCKS_URL=self.store.locks_url(proxied),
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        )
        cmd = [sys.executable, "-m", "tests.soak", "--worker", str(index)]
        cmd += ["--seed", str(self.args.seed), *self.names]
        proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.procs[index] = (proc, proxied)
        if self.until:
            self.go(proc)

    def go(self, proc: subprocess.Popen[bytes]) -> None:
        """Tell a worker the deadline (it reads it once it is set up)."""
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.write(f"{self.until!r}\n".encode())
            proc.stdin.close()

    def start(self) -> None:
        """Spawn the workers, wait (bounded) until every one is set up, start the clock."""
        for i in range(self.args.procs):
            self.spawn(proxied=i % 2 == 0)
        give_up = time.monotonic() + SETUP_BOUND
        for proc, _ in self.procs.values():
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], give_up - time.monotonic())
            if ready:
                proc.stdout.readline()  # "ready", or "" if it died
        self.until = time.monotonic() + self.args.seconds
        for proc, _ in self.procs.values():
            self.go(proc)

    def run(self) -> None:
        self.start()
        actions: dict[str, Callable[[], None]] = {
            "pause": self.pause,
            "kill": self.kill,
            "blackhole": self.blackhole,
            "delay": self.delay,
            "restart": self.restart,
        }
        allowed = [f for f in FAULTS if f in self.args.faults]
        try:
            while self.sleep(self.rng.uniform(0.5, 1.5) * self.args.interval):
                fault = self.rng.choice(allowed)
                actions[fault]()
                self.faults[fault] += 1
        finally:
            for proxy in self.store.proxies:
                proxy.pass_through()
            self.finish()

    def sleep(self, seconds: float) -> bool:
        """Sleep, but not past the deadline (less 2 TTLs, so the last fault ends in time)."""
        left = self.until - 2 * TTL - time.monotonic()
        time.sleep(max(0.0, min(seconds, left)))
        return left > seconds

    def live(self) -> list[int]:
        return [i for i, (p, _) in self.procs.items() if p.poll() is None]

    def pause(self) -> None:
        live = self.live()
        if not live:
            return
        proc, _ = self.procs[self.rng.choice(live)]
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(self.rng.uniform(1.2, 2.0) * TTL)
            os.kill(proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        live = self.live()
        if not live:
            return
        index = self.rng.choice(live)
        proc, proxied = self.procs.pop(index)
        proc.kill()
        proc.wait()
        self.spawn(proxied)

    def blackhole(self) -> None:
        for proxy in self.store.proxies:
            proxy.blackhole()
        time.sleep(self.rng.uniform(1.0, 2.0) * TTL)
        for proxy in self.store.proxies:
            proxy.pass_through()

    def delay(self) -> None:
        ms = self.rng.uniform(50, 400)
        for proxy in self.store.proxies:
            proxy.delay(ms)
        time.sleep(self.rng.uniform(1.0, 3.0))
        for proxy in self.store.proxies:
            proxy.pass_through()

    def restart(self) -> None:
        self.store.restart(self.rng)

    def finish(self) -> None:
        deadline = self.until + 20
        for proc, _ in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        for proc, _ in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # A worker the nemesis did not kill exits 0; anything else (a crash, or an error from
        # outside LeaseError, FOREIGN_EXIT) is a broken contract even if the history is sound.
        self.broken = sum(1 for proc, _ in self.procs.values() if proc.returncode != 0)


def check(names: list[str]) -> tuple[int, list[str], list[dict[str, Any]]]:
    """Critical sections, violations and the saved history of every register."""
    from tests import checker

    sections, violations, saved = 0, [], []
    for name in names:
        attempts = checker.history(name)
        sections += len({(a.writer, a.token) for a in attempts})
        saved += [{**asdict(a), "at": a.at.isoformat() if a.at else None} for a in attempts]
        try:
            checker.check_history(name)
        except AssertionError as exc:
            violations.append(f"{name}: {exc}")
    return sections, violations, saved


def soak_backend(kind: str, args: argparse.Namespace, rng: random.Random) -> Outcome:
    started = time.monotonic()
    try:
        store = start_store(kind)
    except Unavailable as exc:
        return Outcome(kind, skipped=str(exc))
    try:
        if kind == "database":
            migrate_locks(store.locks_url(proxied=False))
        run = Run(store, args, rng)
        run.run()
        sections, violations, saved = check(run.names)
        outcome = Outcome(kind, sections, run.faults, violations, run.broken)
        if violations:
            path = Path(args.save_dir) / f"soak-{kind}-seed{args.seed}.json"
            path.write_text(json.dumps(saved, indent=1))
            outcome.saved = str(path)
            for violation in violations:
                print(f"VIOLATION ({kind}): {violation}", file=sys.stderr)
    finally:
        store.destroy()
    outcome.seconds = time.monotonic() - started
    return outcome


def migrate_locks(url: str) -> None:
    from django.core.management import call_command
    from django.db import connections

    from devservers import database_settings

    default = connections["default"].settings_dict
    connections.settings["locks"] = {**default, **database_settings(url)}
    call_command("migrate", database="locks", verbosity=0)
    connections["locks"].close()


def replay(path: str) -> int:
    """Run the checker again on a saved history (``--check FILE``)."""
    from datetime import datetime

    from tests.checker import Attempt, check_attempts

    rows = json.loads(Path(path).read_text())
    failures = 0
    for register in sorted({row["register"] for row in rows}):
        attempts = [
            Attempt(**{**row, "at": datetime.fromisoformat(row["at"]) if row["at"] else None})
            for row in rows
            if row["register"] == register
        ]
        try:
            summary = check_attempts(attempts)
            print(f"{register}: ok ({summary.attempts} attempts)")
        except AssertionError as exc:
            failures += 1
            print(f"{register}: VIOLATION: {exc}")
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    parser.add_argument("--seconds", type=float, default=60.0, help="per backend (default 60)")
    parser.add_argument("--procs", type=int, default=16, help="workers per backend (16-32)")
    parser.add_argument("--seed", type=int, default=None, help="the nemesis's seed (replay)")
    parser.add_argument("--per-name", type=int, default=2, help="workers per lease name")
    parser.add_argument("--interval", type=float, default=2.0, help="mean s between faults")
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated")
    parser.add_argument("--save-dir", default=".", help="where a failing history is saved")
    parser.add_argument("--check", metavar="FILE", help="re-check a saved history and exit")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker, args.names, args.seed)
    if args.check:
        return replay(args.check)
    args.seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    args.faults = args.faults.split(",")
    print(f"soak: seed {args.seed} (replay the nemesis with --seed {args.seed})", flush=True)
    from devservers import PostgresServer

    history = PostgresServer().start()
    try:
        os.environ["SOAK_HISTORY_URL"] = history.url
        os.environ["DJANGO_SETTINGS_MODULE"] = "tests.soak_settings"
        os.environ.pop("SOAK_LOCKS_URL", None)
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", run_syncdb=True, verbosity=0)
        rng = random.Random(args.seed)
        outcomes = []
        for kind in args.backends.split(","):
            outcome = soak_backend(kind, args, rng)
            print(outcome.line(), flush=True)
            outcomes.append(outcome)
    finally:
        from django.db import connections

        connections.close_all()
        history.destroy()
    ran = [o for o in outcomes if not o.skipped]
    faults = sum(sum(o.faults.values()) for o in ran)
    violations = sum(len(o.violations) for o in ran)
    broken = sum(o.broken for o in ran)
    print(
        f"soak total: {sum(o.sections for o in ran)} critical sections on {len(ran)} backends, "
        f"{faults} faults, {violations} violations, {broken} workers broke the error contract, "
        f"seed {args.seed}",
        flush=True,
    )
    return 1 if violations or broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
