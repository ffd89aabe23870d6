"""``manage.py run_elected NAME -- COMMAND...``: run a command only while this process leads.

Campaigns for ``NAME``, starts ``COMMAND`` once elected, and stops it (SIGTERM to its process
group, SIGKILL after ``--grace`` seconds) as soon as leadership is lost, so a deposed leader's
job does not keep running beside its successor's. It cannot stop a job while this process is
itself paused, so the child gets the leadership's fencing token in ``LEASES_LEADER_TOKEN`` to
fence its writes with: that is what makes a late write of a deposed leader harmless.

Exit status: the command's own when it ends while leading (128 + N when a signal N killed it,
as a shell reports it); 75 (EX_TEMPFAIL) when leadership
was lost and the command had to be stopped, so a supervisor restarts the campaign; 127 when the
program does not exist and 126 when it cannot be executed (the shell's convention, so a
supervisor tells a typo from a job that failed); 1 with one ``CommandError`` line on bad input.
``-v 0`` silences the progress lines.

Once stopping has begun (leadership lost, or a first SIGTERM/SIGINT/SIGHUP), further signals
cannot cut the SIGTERM -> grace -> SIGKILL escalation short, and the leadership is resigned only
after the child is gone, and with it every process left in its group (a worker it started,
a background job). If this process itself dies (even by SIGKILL), the child and the
processes of its group are SIGKILLed (the child by its parent-death signal, the rest by a
watchdog: :func:`start_watchdog`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from leases.election import Leadership, elect
from leases.errors import LeaseError, LeaseUnavailable
from leases.management._options import at_least, lease_name, pause

LOST_EXIT_CODE = 75
#: How often, and after its SIGKILL how long, :func:`stop_stragglers` looks at the group.
STRAGGLER_POLL = 0.02
STRAGGLER_KILL_WAIT = 5.0
NOT_FOUND_EXIT_CODE = 127
NOT_EXECUTABLE_EXIT_CODE = 126
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """``preexec_fn``: the child is SIGKILLed if this process dies (SIGKILL included).

    SIGKILL, not SIGTERM: a supervisor that died uncleanly can no longer escalate, its lease
    will lapse within the TTL and a successor will start its own job, so a child that ignores
    SIGTERM must not be left running beside it.
    """
    _set_parent_death_signal(signal.SIGKILL)


def _set_parent_death_signal(sig: int) -> None:
    """In a ``preexec_fn``: ``sig`` to the child when this process dies (Linux; elsewhere
    nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


#: The watchdog (see :func:`start_watchdog`): ``argv`` is the command's process group, this
#: process's pid, then a marker that names it in ``ps``. SIGTERM (the parent-death signal)
#: arrives blocked from the ``preexec_fn``, so it waits until the handler is in place.
WATCHDOG = """
import os, signal, sys
group, parent = int(sys.argv[1]), int(sys.argv[2])
def reap(*_):
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os._exit(0)
signal.signal(signal.SIGTERM, reap)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
if os.getppid() != parent:
    reap()
while True:
    signal.pause()
"""


#: What names the watchdog in ``ps`` (an argument its code ignores).
WATCHDOG_MARK = "leases-run-elected-watchdog"


def _watch_parent() -> None:
    """``preexec_fn`` of the watchdog: SIGTERM when this process dies, held back (blocked)
    until the watchdog's handler is installed, so an early death is not lost."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    _set_parent_death_signal(signal.SIGTERM)


def start_watchdog(group: int) -> subprocess.Popen[bytes] | None:
    """A process that SIGKILLs the command's process ``group`` if this one dies.

    The parent-death signal of the command (:func:`_die_with_parent`) reaches the command
    alone: the workers it started itself (a shell script's commands, a pool's processes)
    would run on beside the successor's. The watchdog is told of this process's death by a
    parent-death signal of its own and takes the whole group down. It is stopped (SIGKILL,
    so it reaps nothing) when the command has ended here; ``None`` if it cannot start (the
    command's own parent-death signal still holds)."""
    try:
        return subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(group), str(os.getpid()), WATCHDOG_MARK],
            preexec_fn=_watch_parent,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
    except OSError:
        return None


def _stop_watchdog(watchdog: subprocess.Popen[bytes] | None) -> None:
    if watchdog is not None and watchdog.poll() is None:
        watchdog.kill()
        watchdog.wait()


def exit_status(returncode: int) -> int:
    """A child's exit code as a shell reports it: ``128 + N`` for a child killed by signal N
    (``Popen`` says ``-N``, which ``SystemExit`` would turn into ``256 - N``)."""
    return 128 - returncode if returncode < 0 else returncode


def stop_process_group(
    child: subprocess.Popen[bytes], grace: float, stopping: _Stopping | None = None
) -> int:
    """SIGTERM the child's process group, SIGKILL it after ``grace`` seconds; the exit code.

    Marks ``stopping`` first, so no signal can interrupt the escalation once it has begun.
    """
    if stopping is not None:
        stopping.begun = True
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        if child.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        try:
            return child.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    return child.wait()


def group_members(group: int) -> list[int]:
    """The live processes of process group ``group`` (zombies, which nothing can stop and an
    init that never reaps may keep, left out)."""
    if not os.path.isdir("/proc"):  # no procfs (macOS): whether the group has anyone at all
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [group]
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):  # it ended as we read
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) == group:
            members.append(int(entry.name))
    return members


def stop_stragglers(group: int, grace: float) -> None:
    """SIGTERM what is left of the command's process group once the command itself has ended
    (a worker it started, a shell script's background job), SIGKILL it after ``grace``.

    The leadership is resigned after this: a straggler left running would do the job beside
    the successor's command. Polled, as nothing can wait for processes that are not one's own
    children; bounded by ``grace`` and a few seconds after the SIGKILL.
    """
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, STRAGGLER_KILL_WAIT)):
        if not group_members(group):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)
        deadline = time.monotonic() + wait
        while group_members(group) and time.monotonic() < deadline:
            time.sleep(STRAGGLER_POLL)


class _Stopping:
    """Whether stopping has begun: from then on, signals can no longer cut it short.

    The first SIGTERM/SIGINT/SIGHUP becomes a ``SystemExit`` so ``finally`` stops the child and
    then resigns; a second one arriving during the grace period (an impatient operator, a
    supervisor's own escalation) must not interrupt that wait, or SIGKILL would never be sent
    and the leadership would be released with the child still running.
    """

    def __init__(self) -> None:
        self.begun = False

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.begun:
            return
        self.begun = True
        raise SystemExit(128 + signum)


@contextlib.contextmanager
def _terminate_on(signals_: tuple[int, ...], stopping: _Stopping) -> Iterator[None]:
    """Route SIGTERM/SIGINT/SIGHUP to ``stopping`` for the duration of the block."""
    handler = stopping.handler

    previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
    for sig in signals_:
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class Command(BaseCommand):
    help = (
        "Run COMMAND only while elected leader of NAME; stop it when leadership is lost. "
        "Usage: run_elected NAME [--ttl S] [--grace S] [--backend ALIAS] -- COMMAND [ARGS...]"
    )
    #: The part of argv after ``--`` (argparse would try to parse the command's own options).
    command: tuple[str, ...] = ()
    stopping: _Stopping
    talk = True

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="election name")
        parser.add_argument("--ttl", type=float, default=None, help="leadership lease TTL (s)")
        parser.add_argument("--backend", default="default", help="lease backend alias")
        parser.add_argument("--grace", type=float, default=10.0, help="SIGTERM -> SIGKILL (s)")
        parser.add_argument("--timeout", type=float, default=None, help="give up campaigning")
        parser.add_argument("--poll", type=float, default=0.1, help=argparse.SUPPRESS)

    def run_from_argv(self, argv: list[str]) -> None:
        """Everything after the first ``--`` is the command, options and all, untouched."""
        if "--" in argv:
            split = argv.index("--")
            argv, self.command = argv[:split], tuple(argv[split + 1 :])
        super().run_from_argv(argv)

    def handle(self, *args: Any, **options: Any) -> None:
        command = list(self.command)
        if not command:
            raise CommandError("nothing to run: manage.py run_elected NAME -- COMMAND [ARGS...]")
        lease_name(options["name"])
        for option, inclusive in (("ttl", False), ("timeout", True)):
            if options[option] is not None:
                at_least(f"--{option}", options[option], 0, inclusive=inclusive)
        for option, inclusive in (("grace", True), ("poll", False)):  # waited for
            if options[option] is not None:
                pause(f"--{option}", options[option], inclusive=inclusive)
        self.talk = options["verbosity"] > 0
        self.stopping = _Stopping()
        with _terminate_on((signal.SIGTERM, signal.SIGINT, signal.SIGHUP), self.stopping):
            try:
                leadership = elect(
                    options["name"],
                    ttl=options["ttl"],
                    backend=options["backend"],
                    timeout=options["timeout"],
                )
            except LeaseUnavailable as exc:
                raise CommandError(f"not elected: {exc}") from exc
            except LeaseError as exc:  # a bad --backend, a TTL under the drift allowance...
                raise CommandError(str(exc)) from exc
            with leadership:
                code = self.supervise(leadership, command, options["grace"], options["poll"])
        if code:
            raise SystemExit(code)

    def say(self, line: str) -> None:
        if self.talk:
            self.stderr.write(line)

    def supervise(
        self, leadership: Leadership, command: list[str], grace: float, poll: float
    ) -> int:
        """Run ``command`` while ``leadership`` lasts; its exit code, or 75 once deposed."""
        env = {
            **os.environ,
            "LEASES_LEADER_NAME": leadership.name,
            "LEASES_LEADER_TOKEN": str(leadership.token),
            "LEASES_LEADER_BACKEND": leadership.backend,
        }
        try:
            child = subprocess.Popen(
                command, env=env, start_new_session=True, preexec_fn=_die_with_parent
            )
        except FileNotFoundError:
            self.stderr.write(f"run_elected: {command[0]}: command not found")
            return NOT_FOUND_EXIT_CODE
        except PermissionError:
            self.stderr.write(f"run_elected: {command[0]}: permission denied")
            return NOT_EXECUTABLE_EXIT_CODE
        except OSError as exc:  # a binary of another format, a path through a file, ...
            self.stderr.write(f"run_elected: {command[0]}: cannot execute: {exc.strerror}")
            return NOT_EXECUTABLE_EXIT_CODE
        watchdog = start_watchdog(child.pid)
        # Not "elected leader ...": elect() has logged that (leases.election, INFO), and an
        # operator logging it to this stderr would read the election twice. This line says
        # what the command adds: which process now runs under the leadership.
        self.say(
            f"leading {leadership.name!r} (token {leadership.token}): "
            f"started pid {child.pid}: {shlex.join(command)}"
        )
        try:
            while child.poll() is None:
                if not leadership.is_leader:
                    self.say(f"leadership of {leadership.name!r} lost; stopping pid {child.pid}")
                    stop_process_group(child, grace, self.stopping)
                    return LOST_EXIT_CODE
                leadership.lost.wait(poll)
            return exit_status(child.returncode)
        finally:
            if child.poll() is None:
                stop_process_group(child, grace, self.stopping)
            stop_stragglers(child.pid, grace)
            _stop_watchdog(watchdog)
