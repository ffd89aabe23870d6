"""``manage.py run_elected NAME -- COMMAND...``: run a command only while this process leads.

Campaigns for ``NAME``, starts ``COMMAND`` once elected, and stops it (SIGTERM to its process
group, SIGKILL after ``--grace`` seconds) as soon as leadership is lost, so a deposed leader's
job does not keep running beside its successor's. It cannot stop a job while this process is
itself paused, so the child gets the leadership's fencing token in ``LEASES_LEADER_TOKEN`` to
fence its writes with: that is what makes a late write of a deposed leader harmless.

Exit status: the command's own when it ends while leading (128 + N when a signal N killed it,
as a shell reports it); 75 (EX_TEMPFAIL) when leadership was lost while it ran (it is stopped;
one that exited by itself as the loss was found counts as lost too, see
:meth:`Command.outcome`), so a supervisor restarts the campaign; 127 when the
program does not exist and 126 when it cannot be executed (the shell's convention, so a
supervisor tells a typo from a job that failed); 1 with one ``CommandError`` line on bad input.
``-v 0`` silences the progress lines.

SIGTERM/SIGINT/SIGHUP stop the campaign at once; once elected, they are only noted (see
:class:`_Stopping`) and acted on by the supervision loop, so none can cut starting, stopping or
resigning short. Stopping is one SIGTERM -> grace -> SIGKILL for the whole process group (the
command and every process left in it: a worker it started, a background job), SIGKILL coming
``--grace`` seconds after the SIGTERM whoever ended first, and the leadership is resigned only
after the group is gone. If this process itself dies (even by SIGKILL), the child and the
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

from leases.backends import get_backend
from leases.election import Leadership, elect, election_lease_name
from leases.errors import LeaseError, LeaseUnavailable
from leases.handle import held_by, holder_key
from leases.management._options import at_least, lease_name, pause

LOST_EXIT_CODE = 75
#: How often, and after its SIGKILL how long, :func:`stop_process_group` looks at the group.
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


def stop_process_group(child: subprocess.Popen[bytes], grace: float) -> int:
    """SIGTERM the child's process group, SIGKILL what is left of it ``grace`` seconds later;
    the child's exit code. Nothing is sent once the child has ended and its group is empty.

    One deadline for the whole group, from the SIGTERM: waiting for the child, then for the
    rest of the group with a grace period of its own, let a worker that ignores SIGTERM
    outlive ``--grace`` by up to twice over. Also what is left after a child that ended by
    itself (a worker it started, a shell script's background job): the leadership is resigned
    after this, and a straggler left running would do the job beside the successor's.
    """
    group = child.pid
    if child.poll() is not None and not group_members(group):
        return child.returncode
    deadline = time.monotonic() + grace
    _signal_group(group, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(max(0.0, deadline - time.monotonic()))
    if _group_outlives(group, deadline):
        _signal_group(group, signal.SIGKILL)
        _group_outlives(group, time.monotonic() + STRAGGLER_KILL_WAIT)
    return child.wait()


def _signal_group(group: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def _group_outlives(group: int, deadline: float) -> bool:
    """Whether process ``group`` still has a live member at ``deadline``. Polled, as nothing
    can wait for processes that are not one's own children."""
    while group_members(group):
        if time.monotonic() >= deadline:
            return True
        time.sleep(STRAGGLER_POLL)
    return False


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


class _Stopping:
    """What SIGTERM/SIGINT/SIGHUP do: interrupt the campaign, or, once elected, ask to stop.

    Campaigning, a signal raises ``SystemExit``: there is nothing to stop yet. Once the
    election is won, a ``SystemExit`` raised wherever the signal lands would skip what must
    follow (between the election and ``with leadership``: the leadership left unresigned;
    between starting the command and the ``try`` that stops it: the command left running
    unled; during the grace period: no SIGKILL). So from then on the first signal is only
    noted in ``requested`` for the supervision loop, and later ones are ignored. "Won" is
    asked of the lease registry (``won``), not of ``elect()`` returning: the lease is held
    a few steps before that.
    """

    def __init__(self) -> None:
        self.won: Callable[[], bool] = lambda: False
        self.elected = False
        self.requested: int | None = None

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if not (self.elected or self.won()):
            raise SystemExit(128 + signum)
        self.elected = True
        if self.requested is None:
            self.requested = signum


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


#: The signals that stop run_elected (see :class:`_Stopping`).
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _campaign_won(name: str, backend: str) -> Callable[[], bool]:
    """Whether this thread holds the election's lease, asked of the lease registry: true from
    the moment the campaign won, before ``elect()`` has returned (see :class:`_Stopping`)."""
    key = holder_key(get_backend(backend), election_lease_name(name), None)
    return lambda: held_by(key) is not None


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
        with _terminate_on(SIGNALS, self.stopping):
            try:
                # Before campaigning (and a bad --backend refused here, as by elect()).
                self.stopping.won = _campaign_won(options["name"], options["backend"])
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
            # For good: the lease leaves the registry as the resignation begins, and a signal
            # raised into the release would leave the grant to run out by its TTL.
            self.stopping.elected = True
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
        if self.stopping.requested is not None:  # asked to stop as the election was won
            return 128 + self.stopping.requested
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
        watchdog = None
        try:
            watchdog = start_watchdog(child.pid)
            # Not "elected leader ...": elect() has logged that (leases.election, INFO), and an
            # operator logging it to this stderr would read the election twice. This line says
            # what the command adds: which process now runs under the leadership.
            self.say(
                f"leading {leadership.name!r} (token {leadership.token}): "
                f"started pid {child.pid}: {shlex.join(command)}"
            )
            return self.outcome(leadership, child, poll)
        finally:
            try:
                stop_process_group(child, grace)
            finally:
                _stop_watchdog(watchdog)

    def outcome(self, leadership: Leadership, child: subprocess.Popen[bytes], poll: float) -> int:
        """Wait for the command to end, for the leadership to be lost or for a stop signal;
        the exit status that says which.

        When the command's exit and the loss come together, which came first decides: a loss
        this process knew of when the exit was reaped is 75, though the command exited by
        itself (maybe 0), since it may have run its end unled and a supervisor must campaign
        again; the command's status only if it was reaped while still leading. Looked at in
        that order (reap, then ``is_leader``), so a loss found in the instant between the two
        counts as first: the safe side, a restart rather than a success that was not one."""
        while True:
            returncode = child.poll()
            if returncode is None and self.stopping.requested is not None:
                return 128 + self.stopping.requested
            if not leadership.is_leader:
                self.say(
                    f"leadership of {leadership.name!r} lost; stopping pid {child.pid}"
                    if returncode is None
                    else f"leadership of {leadership.name!r} lost as pid {child.pid} ended "
                    f"(status {exit_status(returncode)})"
                )
                return LOST_EXIT_CODE
            if returncode is not None:
                return exit_status(returncode)
            leadership.lost.wait(poll)
