"""``manage.py run_elected``: the command runs only while its process leads."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from leases import LeaseLost
from leases.backends import get_backend
from leases.election import Leadership, elect, election_lease_name, leader_of
from leases.management.commands.run_elected import Command
from tests.harness import manage
from tests.waiting import wait_until

TTL, GRACE, SLACK = 1.5, 1.0, 3.0

#: The elected command: records its pid and token, optionally ignores SIGTERM, runs forever.
#: Its third argument is run_elected's --grace.
COMMAND = """
import os, signal, subprocess, sys, time
out, mode, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
def on_term(signum, frame):
    open(out + ".term", "w").write(str(time.monotonic()))
    if mode == "stubborn-slow-term":  # a clean shutdown that takes most of the grace period
        time.sleep(grace * 0.9)
    if mode in ("term", "stubborn-slow-term"):
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
if mode.startswith("grandchild"):  # a worker of its own, as a shell script's command is
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(out + ".grandchild", "w").write(str(worker.pid))
if mode.startswith("stubborn"):  # a worker that notes SIGTERM and runs on (trap '' TERM)
    worker = subprocess.Popen([sys.executable, "-c", STUBBORN, out + ".worker"])
    while not os.path.exists(out + ".worker"):
        time.sleep(0.01)
    open(out + ".grandchild", "w").write(str(worker.pid))
with open(out + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {os.environ['LEASES_LEADER_TOKEN']}")
os.rename(out + ".tmp", out)
if mode in ("exit", "grandchild-exit", "stubborn-exit"):
    sys.exit(7)
if mode == "kill-self":
    os.kill(os.getpid(), signal.SIGKILL)
for _ in range(6000):
    time.sleep(0.01)
""".replace(
    "STUBBORN",
    repr(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: open(sys.argv[1] + '.term', 'w').close())\n"
        "open(sys.argv[1], 'w').close()\n"
        "time.sleep(60)\n"
    ),
)


def alive(pid: int) -> bool:
    """Running and not a zombie (an orphan may wait for a reaper that never comes)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):  # ESRCH: it exited mid-read
        return False
    return state not in ("Z", "X")


@pytest.fixture
def run_elected(child_env: dict[str, str], python: str, tmp_path: Path) -> Iterator[object]:
    started: list[subprocess.Popen[bytes]] = []

    def start(
        mode: str, grace: float = GRACE
    ) -> tuple[str, subprocess.Popen[bytes], int, int, Path]:
        name, out = f"run-elected-{uuid.uuid4().hex[:8]}", tmp_path / f"cmd-{len(started)}"
        args = ["run_elected", name, "--ttl", str(TTL), "--grace", str(grace), "--"]
        proc = subprocess.Popen(
            [python, "-m", "django", *args, python, "-c", COMMAND, str(out), mode, str(grace)],
            env=child_env,
        )
        started.append(proc)
        wait_until(out.exists, 30, "the command to start")
        pid, token = map(int, out.read_text().split())
        return name, proc, pid, token, out

    try:
        yield start
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.mark.fault
@pytest.mark.parametrize("mode", ["term", "ignore-term"])
def test_deposed_leaders_command_is_stopped_within_the_grace_period(
    run_elected: object, mode: str
) -> None:
    name, proc, pid, token, out = run_elected(mode)  # type: ignore[operator]
    leader = leader_of(name)
    assert leader is not None and leader.token == token
    get_backend().force_release(election_lease_name(name), token)  # an operator deposes the leader
    wait_until(lambda: not alive(pid), TTL + GRACE + SLACK, "the deposed leader's command to end")
    assert Path(f"{out}.term").exists(), "the command was not sent SIGTERM first"
    assert proc.wait(10) == 75


@pytest.mark.fault
def test_command_that_ends_by_itself_ends_the_leadership(run_elected: object) -> None:
    name, proc, _, _, _ = run_elected("exit")  # type: ignore[operator]
    assert proc.wait(20) == 7
    assert leader_of(name) is None  # resigned: no successor has to wait for the TTL


@pytest.mark.fault
def test_killed_supervisor_takes_its_command_down(run_elected: object) -> None:
    _, proc, pid, _, _ = run_elected("term")  # type: ignore[operator]
    os.kill(proc.pid, signal.SIGKILL)
    wait_until(lambda: not alive(pid), 5, "the command of a killed run_elected to end")


@pytest.mark.fault
def test_terminated_supervisor_stops_its_command_and_resigns(run_elected: object) -> None:
    name, proc, pid, _, _ = run_elected("term")  # type: ignore[operator]
    proc.terminate()
    assert proc.wait(GRACE + SLACK) == 128 + signal.SIGTERM
    assert not alive(pid)
    assert leader_of(name) is None


@pytest.mark.fault
def test_command_never_runs_unless_elected(
    child_env: dict[str, str], python: str, tmp_path: Path
) -> None:
    name, out = f"run-elected-{uuid.uuid4().hex[:8]}", tmp_path / "never"
    with elect(name, ttl=30, timeout=5):
        args = ["run_elected", name, "--timeout", "0.5", "--", python, "-c", COMMAND, str(out)]
        done = subprocess.run(
            [python, "-m", "django", *args, "term", "1"],
            env=child_env,
            capture_output=True,
            timeout=60,
        )
    assert done.returncode == 1 and b"not elected" in done.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["x", "--ttl", "0"], "CommandError: --ttl must be greater than 0, not 0"),
        (["x", "--grace", "-1"], "CommandError: --grace must be at least 0, not -1"),
        # Elected, ran the command, then crashed waiting (Event.wait: OverflowError).
        (["x", "--poll", "1e10"], "CommandError: --poll must be at most 86400 seconds (a day)"),
        (["x", "--ttl", "inf"], "CommandError: --ttl must be greater than 0 and finite, not inf"),
        (["x", "--timeout", "-1"], "CommandError: --timeout must be at least 0, not -1"),
        ([""], "CommandError: invalid lease name '': must not be empty"),
        (["x", "--backend", "nope"], "CommandError: "),
    ],
)
def test_bad_input_is_one_line_and_exit_1(
    child_env: dict[str, str], args: list[str], message: str
) -> None:
    done = manage(child_env, "run_elected", *args, "--", "true")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(message), line


def test_a_missing_program_exits_127_like_the_shell(child_env: dict[str, str]) -> None:
    name = f"run-elected-{uuid.uuid4().hex[:8]}"
    done = manage(child_env, "run_elected", name, "-v", "0", "--", "no-such-program-here")
    assert done.returncode == 127
    assert done.stderr.strip() == "run_elected: no-such-program-here: command not found"
    assert leader_of(name) is None  # resigned on the way out


@pytest.mark.parametrize("program", ["not-a-program", "/etc/passwd/x"])
def test_a_program_that_cannot_be_executed_exits_126_like_the_shell(
    child_env: dict[str, str], tmp_path: Path, program: str
) -> None:
    """An executable of an unknown format (ENOEXEC) or a path through a file (ENOTDIR) was a
    traceback and exit 1; the shell says 126 for both, as for a file without the permission."""
    if program == "not-a-program":
        path = tmp_path / program
        path.write_bytes(b"\x00\x01 not an executable")
        path.chmod(0o755)
        program = str(path)
    name = f"run-elected-{uuid.uuid4().hex[:8]}"
    done = manage(child_env, "run_elected", name, "--", program)
    assert done.returncode == 126, done.stderr
    (line,) = done.stderr.strip().splitlines()[-1:]
    assert "cannot execute" in line and "Traceback" not in done.stderr
    assert leader_of(name) is None


def test_verbosity_0_silences_progress(child_env: dict[str, str]) -> None:
    name = f"run-elected-{uuid.uuid4().hex[:8]}"
    loud = manage(child_env, "run_elected", name, "--", "true")
    quiet = manage(child_env, "run_elected", name, "-v", "0", "--", "true")
    assert loud.returncode == quiet.returncode == 0
    assert "leading" in loud.stderr and quiet.stderr == ""


@pytest.mark.django_db(transaction=True)
def test_an_election_is_announced_once(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator who logs ``leases`` at INFO (to the same stderr, as under systemd) saw the
    election twice: the election's own log line, then the command's progress line saying the
    same. The election is logged once; the command's line says what it adds (the child)."""
    name = f"run-elected-{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.INFO, logger="leases"):
        Command().run_from_argv(["manage.py", "run_elected", name, "--", "true"])
    logged = [r.getMessage() for r in caplog.records if "elected leader" in r.getMessage()]
    said = capsys.readouterr().err.splitlines()
    (election,) = logged
    token = election.removeprefix(f"elected leader of {name!r} with token ")
    assert token.isdigit(), logged
    assert not [line for line in said if "elected leader" in line], said
    (started,) = [line for line in said if line.startswith(f"leading {name!r} (token {token})")]
    assert ": started pid " in started and started.endswith(": true"), said


@pytest.mark.fault
def test_a_child_killed_by_a_signal_exits_with_128_plus_the_signal(run_elected: object) -> None:
    _, proc, _, _, _ = run_elected("kill-self")  # type: ignore[operator]
    assert proc.wait(20) == 128 + signal.SIGKILL


@pytest.mark.fault
def test_a_second_signal_during_the_grace_period_cannot_skip_sigkill(run_elected: object) -> None:
    """The child ignores SIGTERM; the operator sends SIGTERM twice. SIGKILL must still come,
    and the leadership must outlive the child (no successor's job beside it)."""
    name, proc, pid, _, out = run_elected("ignore-term")  # type: ignore[operator]
    proc.send_signal(signal.SIGTERM)
    wait_until(Path(f"{out}.term").exists, 10, "the child to get SIGTERM")
    proc.send_signal(signal.SIGTERM)  # during the grace period
    released_while_alive = []
    deadline = time.monotonic() + GRACE + SLACK + 5
    while proc.poll() is None and time.monotonic() < deadline:
        if alive(pid) and leader_of(name) is None:
            released_while_alive.append(time.monotonic())
        time.sleep(0.01)
    assert proc.wait(10) == 128 + signal.SIGTERM
    assert not alive(pid), "the child outlived its supervisor's escalation"
    assert not released_while_alive, "leadership was released while the child still ran"
    assert leader_of(name) is None


@pytest.mark.fault
def test_a_child_that_ignores_sigterm_dies_with_a_sigkilled_supervisor(
    run_elected: object,
) -> None:
    _, proc, pid, _, _ = run_elected("ignore-term")  # type: ignore[operator]
    proc.kill()
    wait_until(lambda: not alive(pid), 5, "the child of a SIGKILLed run_elected to end")


@pytest.mark.fault
def test_a_sigkilled_supervisor_takes_its_commands_own_children_down_too(
    run_elected: object,
) -> None:
    """The parent-death signal reaches the command alone: a worker the command started (a
    shell script's, a pool's) went on running beside the successor's. The whole process
    group goes now."""
    _, proc, pid, _, out = run_elected("grandchild")  # type: ignore[operator]
    worker = int(Path(f"{out}.grandchild").read_text())
    assert alive(worker)
    proc.kill()
    wait_until(lambda: not alive(pid), 10, "the command of a SIGKILLed run_elected to end")
    wait_until(lambda: not alive(worker), 10, "the command's own worker to end")


@pytest.mark.fault
def test_a_command_that_ends_by_itself_leaves_none_of_its_workers_behind(
    run_elected: object,
) -> None:
    """The command exited and the leadership was resigned, but a worker it had started (in
    its process group) went on running, beside the successor's command. What is left of the
    group is stopped (SIGTERM, then SIGKILL after the grace period) before the resignation."""
    name, proc, _, _, out = run_elected("grandchild-exit")  # type: ignore[operator]
    worker = int(Path(f"{out}.grandchild").read_text())
    try:
        assert proc.wait(20) == 7
        assert not alive(worker), "the command's worker outlived run_elected"
        assert leader_of(name) is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.fault
def test_a_supervisor_that_ends_leaves_no_watchdog_behind(run_elected: object) -> None:
    """Whatever watches for this process's death must end with it when it ends normally."""
    _, proc, _, _, _ = run_elected("exit")  # type: ignore[operator]
    assert proc.wait(20) == 7
    wait_until(lambda: not _children_of(proc.pid), 10, "no process left of run_elected")


def _children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (reparented ones are not: an orphan's parent is
    init), and processes started with run_elected's watchdog code line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(stat[1]) == pid or b"leases-run-elected-watchdog" in cmdline:
            found.append(int(entry.name))
    return found


def _stopped_by_time(proc: subprocess.Popen[bytes], name: str, pid: int) -> list[float]:
    """Until ``proc`` exits: the moments its leadership was seen released with ``pid`` alive."""
    released_while_alive = []
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        if alive(pid) and leader_of(name) is None:
            released_while_alive.append(time.monotonic())
        time.sleep(0.01)
    return released_while_alive


@pytest.mark.fault
@pytest.mark.parametrize("how", ["deposed", "sigterm"])
def test_the_whole_group_is_sigkilled_grace_seconds_after_its_sigterm(
    run_elected: object, how: str
) -> None:
    """The command shut down within the grace period but its worker ignored SIGTERM: the
    worker was then sent SIGTERM again and given a whole new grace period, outliving the
    first SIGTERM by up to twice ``--grace``. One deadline holds for the whole group."""
    grace = 2.0
    name, proc, _, token, out = run_elected("stubborn-slow-term", grace)  # type: ignore[operator]
    worker = int(Path(f"{out}.grandchild").read_text())
    try:
        if how == "deposed":
            get_backend().force_release(election_lease_name(name), token)
        else:
            proc.terminate()
        term = Path(f"{out}.term")
        wait_until(term.exists, TTL + SLACK, "the command to get SIGTERM")
        wait_until(lambda: term.read_text() != "", 5, "the command to note its SIGTERM")
        wait_until(lambda: not alive(worker), 3 * grace + SLACK, "the worker to be killed")
        lived = time.monotonic() - float(term.read_text())
        # Twice the grace before (1.9 x, the command's shutdown taking 0.9 x of it).
        assert lived < 1.45 * grace, f"the worker outlived the SIGTERM by {lived:.2f}s"
        assert proc.wait(10) == (75 if how == "deposed" else 128 + signal.SIGTERM)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.fault
def test_a_first_sigterm_while_stopping_what_a_finished_command_left_cannot_skip_sigkill(
    run_elected: object,
) -> None:
    """The command exited by itself; a first SIGTERM during the grace period its worker was
    given cut the stop short: no SIGKILL, the leadership resigned with the worker running,
    and exit 143 instead of the command's status."""
    name, proc, _, _, out = run_elected("stubborn-exit", 2.0)  # type: ignore[operator]
    worker = int(Path(f"{out}.grandchild").read_text())
    try:
        wait_until(Path(f"{out}.worker.term").exists, 10, "the worker to get SIGTERM")
        proc.terminate()  # during the worker's grace period
        assert not _stopped_by_time(proc, name, worker), "resigned with the worker running"
        assert proc.wait(10) == 7
        assert not alive(worker)
        assert leader_of(name) is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


#: run_elected in this process, with a SIGTERM sent to it at ``argv[3]``: "elected" (as
#: ``elect()`` returns) or "started" (as the command has started, before the watchdog); prints
#: its exit status and the command's pid, if one was started.
DRIVER = """
import json, os, signal, sys, time
import django
django.setup()
from leases.management.commands import run_elected as module
name, out, when = sys.argv[1:4]
started = []
def elect(*args, **kwargs):
    leadership = real_elect(*args, **kwargs)
    if when == "elected":
        os.kill(os.getpid(), signal.SIGTERM)
    return leadership
def start_watchdog(group):
    started.append(group)
    while not os.path.exists(out):  # its SIGTERM handler is in place
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    return real_start_watchdog(group)
real_elect, module.elect = module.elect, elect
real_start_watchdog, module.start_watchdog = module.start_watchdog, start_watchdog
try:
    module.Command().run_from_argv(["manage.py", "run_elected", name, "--ttl", "10",
        "--grace", "5", "-v", "0", "--", sys.executable, "-c", COMMAND, out, "term", "5"])
    code = 0
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "pid": started[0] if started else None}), flush=True)
""".replace("COMMAND", repr(COMMAND))


@pytest.mark.fault
@pytest.mark.parametrize("when", ["elected", "started"])
def test_a_sigterm_as_the_command_starts_stops_it_before_resigning(
    child_env: dict[str, str], python: str, tmp_path: Path, when: str
) -> None:
    """A SIGTERM landing between ``elect()`` returning and ``with leadership`` left the
    leadership unresigned (renewed by keepalive while the process lived); one landing between
    the command's start and the ``try`` that stops it resigned with the command running,
    never sent SIGTERM. Both now stop the command (if started), then resign, exit 143."""
    name, out = f"run-elected-{uuid.uuid4().hex[:8]}", tmp_path / "cmd"
    done = subprocess.run(
        [python, "-c", DRIVER, name, str(out), when],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["code"] == 128 + signal.SIGTERM, seen
    assert leader_of(name) is None, "never resigned"
    if when == "elected":
        assert seen["pid"] is None and not out.exists(), "started after being asked to stop"
    else:
        assert Path(f"{out}.term").exists(), "the command was never sent SIGTERM"
        assert not alive(seen["pid"])


#: A command that notes its pid in ``argv[1]``, then exits 0 when sent SIGUSR1 (blocked first,
#: so a SIGUSR1 sent before the wait is held for it, never lost or fatal).
ON_CUE = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
signal.sigwait({signal.SIGUSR1})
"""


class _Cue(threading.Event):
    """A leadership's ``lost`` whose first ``wait`` runs ``cue`` first: the supervision loop's
    first look away from its command, where the test sets up what the loop finds next."""

    def __init__(self, cue: Callable[[], None]) -> None:
        super().__init__()
        self.cue: Callable[[], None] | None = cue

    def wait(self, timeout: float | None = None) -> bool:
        cue, self.cue = self.cue, None
        if cue is not None:
            cue()
        return super().wait(timeout)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("deposed", [True, False])
def test_a_command_exiting_0_as_leadership_is_lost_exits_75(
    monkeypatch: pytest.MonkeyPatch, python: str, tmp_path: Path, deposed: bool
) -> None:
    """The command exited 0 after the loss was found but before the loop reaped it: the loop
    reaped first and exited 0, so a supervisor that restarts only on failure never campaigned
    again. The order is set, not raced: while the loop looks away, the loss is found (an
    operator deposes the leader; its renewal is refused), then the command exits (its exit
    seen, not reaped: ``WNOWAIT``). A loss found first is 75; without a loss, the command's 0."""
    from leases.management.commands import run_elected as module

    name, out = f"run-elected-{uuid.uuid4().hex[:8]}", tmp_path / "pid"

    def elect_with_cue(*args: Any, **kwargs: Any) -> Leadership:
        leadership = elect(*args, **kwargs)

        def cue() -> None:
            wait_until(out.exists, 30, "the command to start")
            pid = int(out.read_text())
            if deposed:
                get_backend().force_release(election_lease_name(name), leadership.token)
                with pytest.raises(LeaseLost):
                    leadership.lease.renew()  # found lost, as by keepalive's next renewal
                assert not leadership.is_leader
            os.kill(pid, signal.SIGUSR1)
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, left to the loop to reap

        leadership._ended = _Cue(cue)
        return leadership

    monkeypatch.setattr(module, "elect", elect_with_cue)
    argv = ["manage.py", "run_elected", name, "--ttl", "30", "-v", "0", "--"]
    with contextlib.ExitStack() as stack:
        if deposed:
            exited = stack.enter_context(pytest.raises(SystemExit))
        Command().run_from_argv([*argv, python, "-c", ON_CUE, str(out)])
    if deposed:
        assert exited.value.code == 75
    assert leader_of(name) is None
