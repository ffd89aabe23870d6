"""Leader election: two ``run_elected`` supervisors, one job, and an operator who deposes it.

Two ``manage.py run_elected demo:scheduler -- JOB`` processes start; one is elected and starts
the job (which gets its fencing token in ``LEASES_LEADER_TOKEN``), the other waits. An operator
runs ``manage.py leases release leader:demo:scheduler --token T --user ...`` (the token it
saw): the grant is revoked, the token advances, the
leader's keepalive learns at its next renewal, its job is stopped (SIGTERM) and it exits with
75; the waiting supervisor is elected with a higher token and starts its own job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ORDER = 60
TITLE = "Leader election: run_elected, an operator's force release, and a higher token"

ELECTION = "demo:scheduler"
ROOT = Path(__file__).resolve().parents[2]
JOB = (
    "import os, sys, time; "
    "open(sys.argv[1], 'w').write(os.environ['LEASES_LEADER_TOKEN']); "
    "time.sleep(120)"
)


def _supervisor(marker: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "manage.py", "run_elected", ELECTION, "--ttl", "2", "--grace", "2"]
    job = [sys.executable, "-c", JOB, str(marker)]
    return subprocess.Popen([*command, "--", *job], cwd=ROOT, stderr=subprocess.DEVNULL)


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _operator() -> str:
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission

    user, _ = get_user_model().objects.get_or_create(username="demo-operator")
    user.user_permissions.add(Permission.objects.get(codename="force_release_lease"))
    return user.get_username()


def run(say: Callable[[str], None]) -> None:
    from leases.election import election_lease_name, leader_of

    with tempfile.TemporaryDirectory() as tmp:
        markers = [Path(tmp) / "a", Path(tmp) / "b"]
        procs = [_supervisor(marker) for marker in markers]
        try:
            _wait(lambda: any(m.exists() for m in markers), 30, "a leader")
            first = next(i for i, m in enumerate(markers) if m.exists())
            token = int(markers[first].read_text())
            leader = leader_of(ELECTION)
            assert leader is not None and leader.token == token
            say(f"supervisor {'AB'[first]} is elected (token {token}) and runs the job;")
            say(f"leader_of({ELECTION!r}) -> host {leader.host}, pid {leader.pid}")
            say("the other supervisor campaigns and waits.")

            release = ["leases", "release", election_lease_name(ELECTION)]
            release += ["--token", str(token), "--user", _operator()]
            out = subprocess.run(
                [sys.executable, "manage.py", *release],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
                env=os.environ,
            ).stdout.strip()
            say(f"operator: manage.py leases release ... -> {out}")

            code = procs[first].wait(15)
            assert code == 75, f"the deposed supervisor exited with {code}, not 75"
            say("the deposed supervisor stopped its job (SIGTERM) and exited with 75;")
            other = 1 - first
            _wait(markers[other].exists, 15, "the successor's job")
            new_token = int(markers[other].read_text())
            assert new_token > token, (new_token, token)
            say(f"supervisor {'AB'[other]} was elected with token {new_token} > {token}.")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(15)
