"""Several real processes write one fenced row with random tokens: the fence never goes back."""

from __future__ import annotations

import random
import subprocess
import threading
import time
from typing import Any

import pytest
from django.db import connections

from tests.checker import check_history, new_register, record_write

WRITERS = 6
WRITES = 25

#: A child writer: tokens that drift upwards with random jumps back (as grants reach a resource
#: late), disjoint per writer (token % WRITERS == index), so two accepted writes with one token
#: would mean the fence let two holders through.
WRITER = """
import random, sys
import django
django.setup()
from tests.checker import record_write
register, index, writers, writes = sys.argv[1], *map(int, sys.argv[2:5])
rng = random.Random(index * 7919 + writes)
for step in range(writes):
    record_write(register, (step + rng.randrange(1, 8)) * writers + index, f"writer-{index}")
"""


def run_writers(python: str, env: dict[str, str], register: str) -> None:
    procs = [
        subprocess.Popen(
            [python, "-c", WRITER, register, str(i), str(WRITERS), str(WRITES)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(WRITERS)
    ]
    deadline = time.monotonic() + 120
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)


def test_concurrent_fenced_writers_never_lower_the_stored_token(
    child_env: dict[str, str], python: str
) -> None:
    register = new_register("concurrent")
    run_writers(python, child_env, register)
    summary = check_history(register)
    assert summary.attempts == WRITERS * WRITES
    assert summary.stale > 0, "random tokens must have produced stale writes"
    assert summary.accepted > 1
    assert list(summary.accepted_tokens) == sorted(summary.accepted_tokens)


@pytest.mark.django_db(transaction=True)
def test_racing_creators_of_one_row_keep_the_greatest_token() -> None:
    """Threads create the same new row at once: the insert path's upsert is the fence."""
    threads_per_race, races = 6, 8
    for race in range(races):
        register = new_register(f"race{race}")
        tokens = random.Random(race).sample(range(1, 100), threads_per_race)
        barrier = threading.Barrier(threads_per_race, timeout=20)
        errors: list[BaseException] = []

        def write(token: int, register: str = register, barrier: Any = barrier) -> None:
            try:
                barrier.wait()
                record_write(register, token, f"writer-{token}")
            except BaseException as exc:
                errors.append(exc)
            finally:
                connections.close_all()

        threads = [threading.Thread(target=write, args=(t,)) for t in tokens]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(t.is_alive() for t in threads) and not errors, errors
        summary = check_history(register)
        assert summary.attempts == threads_per_race
        assert summary.highest == max(tokens)
