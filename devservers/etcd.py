"""A throwaway 3-member etcd cluster on free loopback ports, for the etcd lease backend's tests.

Kept in a module of its own (same shape as :class:`devservers.RedisServer`) because a cluster is
several processes that must agree on one static ``--initial-cluster``. Each member has its own
data directory (on ``/dev/shm`` when there is one: etcd fsyncs every commit, and a loaded CI disk
turns that into seconds) and dies with the thread that started it (``PR_SET_PDEATHSIG``).

Heartbeat 100 ms and election timeout 600 ms keep etcd's minimum lease TTL at 1 s
(``ceil(1.5 x election timeout)``), so a test's one-second lease is granted as asked. Fault
tests ``kill()``, ``pause()`` and ``restart()`` single members; ``leader()`` says which one leads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from devservers.servers import ServerStartFailed, _child_setup, _wait_port, free_port

__all__ = ["EtcdCluster", "TlsFiles", "etcd_binary", "make_certificates"]

#: Tuned for a loaded 2-core machine with a minimum lease TTL of one second (see above).
HEARTBEAT_MS = 100
ELECTION_MS = 600
#: Memory-backed, so fsync is free; each cluster still gets its own private mkdtemp directory.
_SHM = "/dev/shm"  # noqa: S108


def etcd_binary() -> str | None:
    """``etcd`` from ``ETCD_BINARY`` or PATH (Debian's ``etcd-server``), or ``None``."""
    return os.environ.get("ETCD_BINARY") or shutil.which("etcd")


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a throwaway CA, a server certificate for 127.0.0.1 and a client one."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def context(self) -> ssl.SSLContext:
        """An SSL context that trusts the CA and presents the client certificate."""
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


def make_certificates(directory: Path) -> TlsFiles:
    """A CA, a server certificate (``IP:127.0.0.1``) and a client certificate, made now with
    ``openssl`` and valid for a day: nothing secret is kept in the repository."""
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", "ca.key",
            "-out", "ca.crt", "-subj", "/CN=leases test CA")  # fmt: skip
    for who, usage, alt in (
        ("server", "serverAuth,clientAuth", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "clientAuth", ""),
    ):
        (directory / f"{who}.ext").write_text(f"{alt}\nextendedKeyUsage={usage}\n")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{who}.key", "-out",
                f"{who}.csr", "-subj", f"/CN=leases-{who}")  # fmt: skip
        openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "1", "-out", f"{who}.crt",
                "-extfile", f"{who}.ext")  # fmt: skip
    return TlsFiles(
        directory / "ca.crt",
        directory / "server.crt",
        directory / "server.key",
        directory / "client.crt",
        directory / "client.key",
    )


class _Member:
    def __init__(self, name: str, base: Path, scheme: str = "http") -> None:
        self.name = name
        self.scheme = scheme
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data = base / name
        self.log = base / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"


class EtcdCluster:
    """Three ``etcd`` processes forming one cluster, owned by this process."""

    def __init__(
        self, size: int = 3, tls: TlsFiles | None = None, env: Mapping[str, str] | None = None
    ) -> None:
        """``tls``: serve clients over HTTPS with these files and require a client certificate
        signed by their CA (peers keep plain HTTP on loopback). ``env``: extra environment for
        every member (a fake clock: :mod:`devservers.clock`)."""
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd binary: apt-get install etcd-server (or set ETCD_BINARY)")
        self.binary = binary
        self.env = dict(env or {})
        shm = _SHM if os.access(_SHM, os.W_OK) else None
        self.dir = Path(tempfile.mkdtemp(prefix="leases-etcd-", dir=shm))
        self.tls = tls
        scheme = "https" if tls else "http"
        self.members = [_Member(f"m{i}", self.dir, scheme) for i in range(size)]
        self.token = self.dir.name

    @property
    def endpoints(self) -> list[str]:
        return [member.client_url for member in self.members]

    def _args(self, member: _Member, state: str) -> list[str]:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        return [
            self.binary,
            f"--name={member.name}",
            f"--data-dir={member.data}",
            f"--listen-client-urls={member.client_url}",
            f"--advertise-client-urls={member.client_url}",
            f"--listen-peer-urls={member.peer_url}",
            f"--initial-advertise-peer-urls={member.peer_url}",
            f"--initial-cluster={initial}",
            f"--initial-cluster-state={state}",
            f"--initial-cluster-token={self.token}",
            f"--heartbeat-interval={HEARTBEAT_MS}",
            f"--election-timeout={ELECTION_MS}",
            "--log-level=warn",
            "--logger=zap",
            *self._tls_args(),
        ]

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        return [
            f"--cert-file={self.tls.server_cert}",
            f"--key-file={self.tls.server_key}",
            f"--trusted-ca-file={self.tls.ca}",
            "--client-cert-auth",
        ]

    def _spawn(self, member: _Member, state: str) -> None:
        log = open(member.log, "ab")  # noqa: SIM115 - handed to the child
        member.proc = subprocess.Popen(
            self._args(member, state),
            stdout=log,
            stderr=log,
            env={**os.environ, **self.env},
            start_new_session=True,
            preexec_fn=_child_setup(signal.SIGKILL),
        )
        log.close()

    def start(self, timeout: float = 60.0, attempts: int = 3) -> EtcdCluster:
        """Start every member and wait for a leader. A member that exits while starting (its
        log is quoted) gets the whole cluster started again, on fresh ports and data, up to
        ``attempts`` times: a bootstrap is all-or-nothing, since the members agreed on one
        ``--initial-cluster``."""
        for attempt in range(attempts):
            try:
                for member in self.members:
                    self._spawn(member, "new")
                for member in self.members:
                    assert member.proc is not None
                    _wait_port(
                        member.client_port, member.proc, timeout, f"etcd {member.name}", member.log
                    )
                self.wait_for_leader(timeout)
            except ServerStartFailed as failure:
                if attempt == attempts - 1:
                    raise
                sys.stderr.write(f"etcd cluster start failed, starting it again: {failure}\n")
                self._reset()
            else:
                return self
        raise AssertionError("unreachable")

    def _reset(self) -> None:
        """Kill every member and give each fresh ports and an empty data directory."""
        for index in range(len(self.members)):
            self.kill(index)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir()
        self.members = [_Member(m.name, self.dir, m.scheme) for m in self.members]

    def status(self, index: int, timeout: float = 1.0) -> dict[str, object]:
        """The member's ``/v3/maintenance/status`` (its id, the leader's, the raft term)."""
        request = urllib.request.Request(  # noqa: S310 - our own member's http:// URL
            f"{self.members[index].client_url}/v3/maintenance/status",
            data=b"{}",
            headers={"Content-Type": "application/json"},
        )
        context = self.tls.context() if self.tls else None
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:  # noqa: S310
            status: dict[str, object] = json.loads(response.read())
        return status

    def leader(self, timeout: float = 1.0) -> int | None:
        """Index of the member every live member agrees leads, else ``None``."""
        found: set[str] = set()
        ids: dict[str, int] = {}
        for index, member in enumerate(self.members):
            if member.proc is None or member.proc.poll() is not None:
                continue
            try:
                status = self.status(index, timeout)
            except OSError:
                continue
            header = status.get("header")
            if isinstance(header, dict):
                ids[str(header.get("member_id"))] = index
            found.add(str(status.get("leader", "0")))
        if len(found) != 1 or "0" in found:
            return None
        return ids.get(found.pop())

    def wait_for_leader(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leader = self.leader()
            if leader is not None:
                return leader
            time.sleep(0.05)
        logs = "\n".join(m.log.read_text(errors="replace")[-1500:] for m in self.members)
        raise ServerStartFailed(f"etcd cluster elected no leader within {timeout}s:\n{logs}")

    def kill(self, index: int) -> None:
        """SIGKILL one member: a crash, its data directory kept for :meth:`restart`."""
        member = self.members[index]
        if member.proc is not None:
            self.resume(index)
            member.proc.kill()
            member.proc.wait()
            member.proc = None

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Kill (if alive) and start the member again on its ports and data."""
        self.kill(index)
        member = self.members[index]
        self._spawn(member, "existing")
        assert member.proc is not None
        _wait_port(member.client_port, member.proc, timeout, f"etcd {member.name}", member.log)

    def pause(self, index: int) -> None:
        """SIGSTOP one member: it hangs, as a stalled host (connections open, no answers)."""
        proc = self.members[index].proc
        if proc is not None:
            os.kill(proc.pid, signal.SIGSTOP)

    def resume(self, index: int) -> None:
        proc = self.members[index].proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)

    def destroy(self) -> None:
        for index in range(len(self.members)):
            self.kill(index)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
