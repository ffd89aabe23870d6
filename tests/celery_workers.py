"""Real ``celery worker`` (prefork) and ``celery beat`` processes for tests: start, wait, kill.

Each worker is a subprocess in a process group of its own (so ``kill()`` takes the pool's
children with it, like a machine dying), dies with the test if pytest dies (``PDEATHSIG``), and
writes its log to a file whose tail is shown when it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devservers.servers import _child_setup

START_TIMEOUT = 60.0


@dataclass
class Worker:
    """One ``celery worker`` process group."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    ready_file: Path
    #: The name the process records itself under (``LEASES_TEST_WORKER``), e.g. ``"a"``.
    role: str = ""

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Worker:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"worker {self.name} did not start:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL the whole group (main process and pool children), as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def start_worker(
    env: dict[str, str],
    directory: Path,
    queues: list[str],
    *,
    name: str = "w",
    concurrency: int = 1,
    extra_env: dict[str, str] | None = None,
) -> Worker:
    """Start a prefork worker consuming ``queues`` (call :meth:`Worker.wait_ready` next)."""
    options = ["worker", "-P", "prefork", "-c", str(concurrency), "--without-heartbeat",
               "--without-gossip", "--without-mingle", "-Q", ",".join(queues)]  # fmt: skip
    return _start(env, directory, name, options, extra_env, node=True)


def start_beat(
    env: dict[str, str], directory: Path, *, name: str = "beat", extra_env: dict[str, str]
) -> Worker:
    """Start a ``celery beat`` process with a schedule file of its own."""
    options = ["beat", "-s", str(directory / f"{name}-{uuid.uuid4().hex[:6]}.schedule")]
    return _start(env, directory, name, options, extra_env, node=False)


def _start(
    env: dict[str, str],
    directory: Path,
    name: str,
    options: list[str],
    extra_env: dict[str, str] | None,
    *,
    node: bool,
) -> Worker:
    unique = f"{name}-{uuid.uuid4().hex[:6]}"
    log, ready = directory / f"{unique}.log", directory / f"{unique}.ready"
    command = [sys.executable, "-m", "celery", "-A", "tests.celery_app", *options,
               *(["-n", f"{unique}@%h"] if node else []), "--loglevel", "INFO"]  # fmt: skip
    child_env = {**env, **(extra_env or {}), "LEASES_TEST_READY_FILE": str(ready),
                 "LEASES_TEST_WORKER": name}  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, env=child_env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_child_setup(signal.SIGKILL),
        )  # fmt: skip
    return Worker(unique, proc, log, ready, role=name)


@pytest.fixture(name="celery_workers")
def celery_workers_fixture(
    child_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., Worker]]:
    """``celery_workers(queues, name=..., concurrency=..., extra_env=...)`` -> a started Worker.

    Every worker started through it is killed when the test ends, whatever happened.
    """
    started: list[Worker] = []

    def start(queues: list[str] | None = None, **options: Any) -> Worker:
        """Queues start a worker; ``queues=None`` starts a beat (``extra_env`` required)."""
        if queues is None:
            worker = start_beat(child_env, tmp_path, **options)
        else:
            worker = start_worker(child_env, tmp_path, queues, **options)
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.kill()


def new_queue(prefix: str = "lt") -> str:
    """A queue name no other test (or earlier run) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"
