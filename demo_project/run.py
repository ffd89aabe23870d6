"""Run the demo end to end: servers (configured or throwaway), migrations, scenarios.

``python -m demo_project.run [manage.py arguments]``; with no arguments it runs ``demo``.
``runserver`` also gets a demo superuser whose login is printed.

A configured ``DATABASE_URL`` or ``REDIS_URL`` that does not answer is an error, never quietly
replaced by a throwaway server. SIGTERM and Ctrl-C stop the command and every server this run
started, without a traceback: the command runs in its own process group, which gets the
signal forwarded (then SIGKILL after a grace period), and the servers are destroyed on the way
out; should this process be SIGKILLed, the command and the servers die with it
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

from devservers import PostgresServer, RedisServer, configured_or_throwaway
from devservers.servers import ServerUnreachable, _child_setup

GRACE = 10.0


class Stopped(Exception):
    """SIGTERM or SIGINT arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def signals_handled_by(handler: Any) -> Iterator[None]:
    """SIGTERM and SIGINT go to ``handler`` inside the block: :func:`_raise_stopped` (cleanup
    runs, no ``KeyboardInterrupt`` traceback) or ``SIG_IGN`` (while servers are destroyed)."""
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def manage(args: list[str], env: dict[str, str]) -> int:
    """``manage.py ARGS`` in a process group of its own; a signal to us is forwarded to it."""
    child = subprocess.Popen(
        [sys.executable, "manage.py", *args],
        env=env,
        start_new_session=True,
        preexec_fn=_child_setup(signal.SIGTERM),
    )
    try:
        return child.wait()
    except Stopped as stopped:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, stopped.signum)
        try:
            child.wait(GRACE)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        raise


def admin_url(args: list[str]) -> str:
    """Where ``runserver ARGS`` listens, for the printed login (its default: 127.0.0.1:8000)."""
    given = next((arg for arg in args[1:] if not arg.startswith("-")), "127.0.0.1:8000")
    host, _, port = given.rpartition(":")
    return f"http://{host or '127.0.0.1'}:{port}/admin/"


def main(argv: list[str]) -> int:
    args = argv or ["demo"]
    owned: list[PostgresServer | RedisServer] = []
    try:
        with signals_handled_by(_raise_stopped):
            urls = configured_or_throwaway(owned)
            for server in owned:
                print(f"started a throwaway {type(server).__name__[:-6]} at {server.url}")
            env = {**os.environ, **urls, "DJANGO_SETTINGS_MODULE": "demo_project.settings"}
            steps = [["migrate", "--verbosity", "0"]]
            if args[0] == "runserver":
                steps.append(["demo_admin", "--url", admin_url(args)])
            code = 0
            for step in [*steps, args]:
                code = manage(step, env)
                if code:
                    break
            return code
    except ServerUnreachable as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    except Stopped as stopped:
        print(f"demo: stopped ({signal.Signals(stopped.signum).name})", file=sys.stderr)
        return 128 + stopped.signum
    finally:
        with signals_handled_by(signal.SIG_IGN):
            for server in owned:
                server.destroy()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
