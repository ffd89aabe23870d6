"""A throwaway RabbitMQ node on free loopback ports, for the Celery tests' AMQP broker.

Kept apart from :mod:`devservers` (same shape as its ``RedisServer``) because a RabbitMQ node
needs more around it: Erlang distribution, an ``epmd``, a cookie and a pile of paths, all of
which must be this node's own so the machine's RabbitMQ (if any) is neither used nor disturbed.

- Every path (Mnesia, logs, config, plugins, ``HOME`` and so the ``.erlang.cookie``) lives in a
  temporary directory, and the machine's ``rabbitmq-env.conf``/``rabbitmq.conf`` are replaced by
  files of ours, so nothing under ``/etc/rabbitmq`` or ``/var/lib/rabbitmq`` is read or written.
- The node registers with an ``epmd`` of its own on a free loopback port, started here in the
  foreground (``-start_epmd false`` stops Erlang from daemonising one that would outlive us).
- The broker is the real ``rabbitmq-server`` script (not the distribution's ``su`` wrapper) run
  with ``RABBITMQ_ALLOW_INPUT`` so it ``exec``\\s the VM: the process we start *is* ``beam.smp``
  and carries ``PR_SET_PDEATHSIG``, instead of a shell whose background VM would be orphaned.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from devservers.servers import _child_setup, _wait_port, free_port

__all__ = ["RabbitMQServer", "rabbitmq_binary"]

#: Places a distribution installs the real (not ``su``-wrapping) start script.
_BINDIRS = ("/usr/lib/rabbitmq/bin", "/usr/local/lib/rabbitmq/bin", "/opt/rabbitmq/sbin")

#: Low enough that a nearly full disk of a CI runner does not block every publisher.
_CONFIG = """\
disk_free_limit.absolute = 10MB
vm_memory_high_watermark.relative = 0.8
log.console = false
log.file.level = warning
"""


def rabbitmq_binary() -> str | None:
    """The ``rabbitmq-server`` start script, or ``None`` when RabbitMQ is not installed.

    Debian's ``/usr/sbin/rabbitmq-server`` is a wrapper that ``su``\\s to the ``rabbitmq`` user
    and logs under ``/var/log``; the script it wraps sits next to the wrapper's target.
    """
    candidates = [os.environ.get("RABBITMQ_SERVER") or ""]
    candidates += [str(Path(d) / "rabbitmq-server") for d in _BINDIRS]
    found = shutil.which("rabbitmq-server")
    if found:
        candidates.append(str(Path(found).resolve().parent / "rabbitmq-server"))
    for candidate in candidates:
        path = Path(candidate)
        runnable = candidate and path.is_file() and os.access(path, os.X_OK)
        if runnable and path.resolve().name != "rabbitmq-script-wrapper":
            return str(path)
    return None


def _epmd_binary() -> str:
    found = shutil.which("epmd")
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/erlang").glob("erts-*/bin/epmd"), reverse=True):
        return str(candidate)
    raise RuntimeError("RabbitMQ is installed but no epmd (Erlang) was found")


class RabbitMQServer:
    """A RabbitMQ node with its own ``epmd``, data and cookie, owned by this process."""

    def __init__(self, *, port: int | None = None) -> None:
        binary = rabbitmq_binary()
        if binary is None:
            raise RuntimeError("no rabbitmq-server found: install RabbitMQ or set a broker URL")
        self.binary = binary
        self.port = port or free_port()
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.node = f"leases-{self.port}@localhost"
        self.dir = Path(tempfile.mkdtemp(prefix="leases-rabbitmq-"))
        self.log = self.dir / "rabbitmq-server.log"
        (self.dir / "rabbitmq.conf").write_text(_CONFIG)
        (self.dir / "rabbitmq-env.conf").write_text("")
        (self.dir / "enabled_plugins").write_text("[].\n")  # no management plugin
        self.proc: subprocess.Popen[bytes] | None = None
        self.epmd: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def env(self) -> dict[str, str]:
        """The environment of the node (and of any ``rabbitmqctl -n NODE`` aimed at it)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        d = self.dir
        env.update(
            HOME=str(d),  # the VM writes its own .erlang.cookie here
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_EPMD_ADDRESS="127.0.0.1",
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_USE_LONGNAME="false",
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_CONF_ENV_FILE=str(d / "rabbitmq-env.conf"),
            RABBITMQ_CONFIG_FILE=str(d / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(d / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(d / "enabled_plugins"),
            RABBITMQ_PLUGINS_EXPAND_DIR=str(d / "plugins-expand"),
            RABBITMQ_MNESIA_BASE=str(d / "mnesia"),
            RABBITMQ_LOG_BASE=str(d / "log"),
            RABBITMQ_PID_FILE=str(d / "rabbitmq.pid"),
            RABBITMQ_ALLOW_INPUT="true",  # exec the VM; -noinput below keeps it headless
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=(
                "-noinput -start_epmd false -kernel inet_dist_use_interface {127,0,0,1}"
            ),
        )
        return env

    def _start_epmd(self) -> None:
        if self.epmd is not None and self.epmd.poll() is None:
            return
        self.epmd = subprocess.Popen(
            [_epmd_binary(), "-port", str(self.epmd_port), "-address", "127.0.0.1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_child_setup(signal.SIGKILL),
        )
        _wait_port(self.epmd_port, self.epmd, 10, "epmd")

    def start(self, timeout: float = 40.0) -> RabbitMQServer:
        """Start the node and return once an AMQP client completes a handshake."""
        self._start_epmd()
        log = open(self.log, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            [self.binary],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=self.env(),
            cwd=self.dir,
            start_new_session=True,
            preexec_fn=_child_setup(signal.SIGKILL),
        )
        log.close()
        try:
            self._wait_ready(self.proc, timeout)
        except BaseException:
            self.stop("kill")
            raise
        return self

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        """An open port is not yet a broker that takes work: wait for a real AMQP handshake."""
        import amqp  # py-amqp, which Celery's kombu already depends on

        deadline = time.monotonic() + timeout
        _wait_port(self.port, proc, timeout, "rabbitmq-server")
        while True:
            try:
                with amqp.Connection(f"127.0.0.1:{self.port}", connect_timeout=2) as conn:
                    conn.channel().close()
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    tail = self.log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"RabbitMQ not ready ({exc!r}): {tail}") from exc
                time.sleep(0.1)

    def stop(self, mode: str = "fast") -> None:
        """Stop the node: ``fast`` (SIGTERM, a clean shutdown) or ``kill`` (SIGKILL)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL if mode == "kill" else signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # erl_child_setup, inet_gethost, monitors
        self.proc = None

    def kill(self) -> None:
        self.stop("kill")

    def restart(self, mode: str = "kill") -> None:
        """Stop and start again on the same ports and data (durable queues survive)."""
        self.stop(mode)
        self.start()

    def destroy(self) -> None:
        self.stop("fast")
        if self.epmd is not None:
            self.epmd.kill()
            self.epmd.wait()
            self.epmd = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RabbitMQServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
