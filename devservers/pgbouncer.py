"""A throwaway PgBouncer in front of a PostgreSQL server, on a free loopback port.

The database backend claims to work behind PgBouncer in any pooling mode (``docs/guide/
advisory.md``): with transaction pooling each transaction may run on another server session,
so session state (advisory locks, ``LISTEN``, named prepared statements) does not follow the
client. Tests check that claim against the real pooler, from Debian's ``pgbouncer`` package
(``scripts/test`` installs it when missing), never an imitation.

PgBouncer refuses to run as root, so as root it runs as the same unprivileged user as the
throwaway PostgreSQL (see :mod:`devservers.servers`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from devservers.servers import (
    _child_setup,
    _unprivileged_user,
    _wait_port,
    end_process,
    free_port,
)

__all__ = ["PgBouncer", "pgbouncer_binary"]


def pgbouncer_binary() -> str | None:
    """The ``pgbouncer`` executable, if installed."""
    return shutil.which("pgbouncer") or next(
        (path for path in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(path)),
        None,
    )


class PgBouncer:
    """PgBouncer listening on 127.0.0.1, passing every database of ``upstream_port`` through
    with ``pool_mode`` (``transaction`` or ``session``), owned by this process.

    Clients connect as ``postgres`` without a password (``auth_type = trust``, as the
    throwaway server). ``options`` is an ignored startup parameter, as PgBouncer's own docs
    advise for drivers that send it (the backend sends ``-c synchronous_commit=on`` there; the
    throwaway server's default is on anyway).
    """

    def __init__(
        self, upstream_port: int, *, pool_mode: str = "transaction", pool_size: int = 4
    ) -> None:
        binary = pgbouncer_binary()
        if binary is None:
            raise RuntimeError("pgbouncer is not installed")
        self.binary = binary
        self.port = free_port()
        self.user = _unprivileged_user()
        self.dir = Path(tempfile.mkdtemp(prefix="leases-pgbouncer-"))
        self.log = self.dir / "pgbouncer.log"
        users = self.dir / "users.txt"
        users.write_text('"postgres" ""\n')
        self.config = self.dir / "pgbouncer.ini"
        self.config.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={upstream_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            f"pool_mode = {pool_mode}\n"
            # Few server sessions per database, so transactions of one client do land on
            # sessions that another client's transactions used before it.
            f"default_pool_size = {pool_size}\n"
            "max_client_conn = 400\n"
            "ignore_startup_parameters = options,extra_float_digits\n"
            f"logfile = {self.log}\n"
        )
        if self.user is not None:
            for path in (self.dir, users, self.config):
                os.chown(path, self.user.pw_uid, self.user.pw_gid)
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def start(self, timeout: float = 15.0) -> PgBouncer:
        self.proc = subprocess.Popen(
            [self.binary, str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.dir,
            start_new_session=True,
            preexec_fn=_child_setup(signal.SIGKILL, self.user),
        )
        _wait_port(self.port, self.proc, timeout, "pgbouncer", self.log)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            end_process(self.proc)
        self.proc = None

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
