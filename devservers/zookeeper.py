"""A throwaway 3-member ZooKeeper ensemble on free loopback ports (Debian's ``zookeeper``).

A module of its own beside ``servers.py``: the JVM members need a class path, a config per
member and a quorum check that PostgreSQL and Redis do not. Each member is a child process of
the thread that started it and dies with it (``PR_SET_PDEATHSIG``), so fault tests can kill,
pause and restart one member while the other two keep the quorum.

Start-up is split (:meth:`ZooKeeperEnsemble.launch` returns at once, :meth:`wait_ready` blocks
until a quorum serves) so the harness can launch the JVMs while the test database is made.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from devservers.servers import _child_setup, free_port

__all__ = ["ZooKeeperEnsemble", "serving", "wait_serving", "zookeeper_classpath"]

#: Small heap, quick start: three JVMs share a loaded 2-core CI machine with everything else.
JVM_OPTIONS = [
    "-Xmx128m",
    "-Xms16m",
    "-Xss512k",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:-UsePerfData",
    "-Dzookeeper.admin.enableServer=false",
    "-Dzookeeper.jmx.log4j.disable=true",
]


def zookeeper_classpath() -> str | None:
    """The server's class path (Debian's jar lists its dependencies), or ``None``."""
    jar = Path(os.environ.get("ZOOKEEPER_JAR", "/usr/share/java/zookeeper.jar"))
    java = shutil.which("java")
    if not jar.exists() or java is None:
        return None
    return f"/etc/zookeeper/conf:{jar}"


def four_letter(port: int, word: str, timeout: float = 1.0) -> str:
    """A four-letter-word command's answer (``srvr``, ``ruok``), or ``""`` if none came."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(word.encode())
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
            return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""


def serving(hosts: str) -> bool:
    """Whether every member named in ``hosts`` (``h:p,h:p``) serves as leader or follower."""
    for host in hosts.split("/", 1)[0].split(","):
        port = int(host.rsplit(":", 1)[1])
        if "Mode: leader" not in (answer := four_letter(port, "srvr")) and (
            "Mode: follower" not in answer
        ):
            return False
    return True


def wait_serving(hosts: str, timeout: float = 90.0) -> None:
    """Block until :func:`serving`; the harness launches the JVMs early and waits here late."""
    deadline = time.monotonic() + timeout
    while not serving(hosts):
        if time.monotonic() > deadline:
            raise RuntimeError(f"ZooKeeper ensemble {hosts} not serving within {timeout}s")
        time.sleep(0.1)


class ZooKeeperEnsemble:
    """Three ZooKeeper members (ids 1-3) on loopback, each with its own data dir and myid."""

    def __init__(
        self, size: int = 3, tick_ms: int = 500, env: Mapping[str, str] | None = None
    ) -> None:
        """``env``: extra environment for every member's JVM (a fake clock:
        :mod:`devservers.clock`)."""
        classpath = zookeeper_classpath()
        if classpath is None:
            raise RuntimeError(
                "no ZooKeeper found: apt-get install zookeeper default-jre-headless "
                "(or set LEASES_ZOOKEEPER_HOSTS)"
            )
        self.classpath = classpath
        self.env = dict(env or {})
        self.dir = Path(tempfile.mkdtemp(prefix="leases-zk-"))
        self.ids = list(range(1, size + 1))
        self.ports = {i: free_port() for i in self.ids}
        peers = {i: (free_port(), free_port()) for i in self.ids}
        self.procs: dict[int, subprocess.Popen[bytes] | None] = dict.fromkeys(self.ids)
        for i in self.ids:
            data = self.dir / f"member{i}"
            data.mkdir()
            (data / "myid").write_text(f"{i}\n")
            lines = [
                f"tickTime={tick_ms}",
                "initLimit=20",
                "syncLimit=4",
                f"dataDir={data}",
                f"clientPort={self.ports[i]}",
                "clientPortAddress=127.0.0.1",
                "maxClientCnxns=0",
                "4lw.commands.whitelist=srvr,ruok,stat",
                "admin.enableServer=false",
                "snapCount=100000",
                "forceSync=no",
            ]
            lines += [f"server.{j}=127.0.0.1:{p}:{e}" for j, (p, e) in peers.items()]
            (data / "zoo.cfg").write_text("\n".join(lines) + "\n")

    @property
    def hosts(self) -> str:
        return ",".join(f"127.0.0.1:{self.ports[i]}" for i in self.ids)

    def host(self, member: int) -> str:
        return f"127.0.0.1:{self.ports[member]}"

    def launch(self, member: int | None = None) -> ZooKeeperEnsemble:
        """Start the JVM of ``member`` (every member if ``None``) without waiting."""
        for i in [member] if member is not None else self.ids:
            data = self.dir / f"member{i}"
            log = open(data / "server.log", "ab")  # noqa: SIM115 - handed to the child
            self.procs[i] = subprocess.Popen(
                [
                    "java",
                    *JVM_OPTIONS,
                    f"-Dzookeeper.log.dir={data}",
                    "-cp",
                    self.classpath,
                    "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                    str(data / "zoo.cfg"),
                ],
                stdout=log,
                stderr=log,
                cwd=data,
                env={**os.environ, **self.env},
                start_new_session=True,
                preexec_fn=_child_setup(signal.SIGKILL),
            )
            log.close()
        return self

    def mode(self, member: int) -> str:
        """``leader``, ``follower`` or ``""`` (not serving: starting, paused, out of quorum)."""
        for line in four_letter(self.ports[member], "srvr").splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return ""

    def leader(self) -> int | None:
        return next((i for i in self.live() if self.mode(i) == "leader"), None)

    def live(self) -> list[int]:
        return [i for i, proc in self.procs.items() if proc is not None and proc.poll() is None]

    def wait_ready(self, timeout: float = 90.0, members: list[int] | None = None) -> None:
        """Block until every live member (or ``members``) serves as leader or follower."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = [i for i in members or self.live() if not self.mode(i)]
            if not waiting:
                return
            for i in waiting:
                proc = self.procs[i]
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"ZooKeeper member {i} exited: {self._tail(i)}")
            if time.monotonic() > deadline:
                tail = self._tail(waiting[0])
                raise RuntimeError(f"ZooKeeper members {waiting} not serving: {tail}")
            time.sleep(0.1)

    def _tail(self, member: int) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / f"member{member}" / "server.log").read_text()[-1500:]
        return ""

    def start(self, timeout: float = 90.0) -> ZooKeeperEnsemble:
        self.launch()
        self.wait_ready(timeout)
        return self

    def kill(self, member: int) -> None:
        """SIGKILL one member, as a crashed host."""
        proc = self.procs[member]
        if proc is not None and proc.poll() is None:
            self.resume(member)
            proc.kill()
            proc.wait()
        self.procs[member] = None

    def restart(self, member: int) -> None:
        self.kill(member)
        self.launch(member)

    def pause(self, member: int) -> None:
        proc = self.procs[member]
        if proc is not None:
            os.kill(proc.pid, signal.SIGSTOP)

    def resume(self, member: int) -> None:
        proc = self.procs[member]
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)

    def destroy(self) -> None:
        for i in self.ids:
            self.kill(i)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ZooKeeperEnsemble:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
