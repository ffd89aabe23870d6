"""Several real processes write one fenced row with random tokens: the fence never goes back."""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections, transaction

from leases import StaleFencingToken
from tests.checker import check_history, new_register, record_write
from tests.waiting import wait_until

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


#: A child that writes a group of rows: even writers rewrite the whole group with fenced
#: update() or bulk_update() (batches of 2, so a stale later batch must undo the earlier ones),
#: odd writers save(fence=...) one random row, so rows carry different tokens and group writes
#: are often stale for some rows only. Reports each group write: token, outcome, rows changed.
GROUP_WRITER = """
import json, random, sys
import django
django.setup()
from leases import StaleFencingToken
from tests.testapp.models_fencing import FencedDoc
group, index, writers, writes = sys.argv[1], *map(int, sys.argv[2:5])
rng = random.Random(index * 104729 + writes)
report = []
for step in range(writes):
    lead = 0 if index % 2 else 3  # group writes need the greatest token of five rows
    token = (step + lead + rng.randrange(1, 8)) * writers + index
    body = f"writer-{index}#{step}@{token}"
    docs = list(FencedDoc.objects.filter(title=group).order_by("pk"))
    try:
        if index % 2:
            doc = rng.choice(docs)
            doc.body = body
            doc.save(fence=token)
            continue
        if step % 2:
            for doc in docs:
                doc.body = body
            count = FencedDoc.objects.fenced(token).bulk_update(docs, ["body"], batch_size=2)
        else:
            count = FencedDoc.objects.filter(title=group).fenced(token).update(body=body)
        report.append([body, "accepted", count])
    except StaleFencingToken:
        if not index % 2:
            report.append([body, "rejected", 0])
print(json.dumps(report))
"""


def test_concurrent_fenced_group_updates_are_all_or_nothing(
    child_env: dict[str, str], python: str
) -> None:
    """An accepted group write changed every row; a rejected one is never seen on any row."""
    from tests.testapp.models_fencing import FencedDoc

    group, size = new_register("group"), 5
    FencedDoc.objects.bulk_create([FencedDoc(title=group, body="initial") for _ in range(size)])
    procs = [
        subprocess.Popen(
            [python, "-c", GROUP_WRITER, group, str(i), str(WRITERS), str(WRITES)],
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    seen: set[str] = set()
    reports: list[tuple[str, str, int]] = []
    deadline = time.monotonic() + 120
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            seen |= set(FencedDoc.objects.filter(title=group).values_list("body", flat=True))
            time.sleep(0.002)
        for proc in procs:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, err
            reports += [tuple(r) for r in json.loads(out.strip().splitlines()[-1])]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    seen |= set(FencedDoc.objects.filter(title=group).values_list("body", flat=True))
    partial = [r for r in reports if r[1] == "accepted" and r[2] != size]
    assert not partial, f"accepted group writes that changed only some rows: {partial}"
    leaked = [r for r in reports if r[1] == "rejected" and r[0] in seen]
    assert not leaked, f"rejected group writes that were visible: {leaked}"
    outcomes = {r[1] for r in reports}
    assert outcomes == {"accepted", "rejected"}, outcomes


def run_together(*bodies: Callable[[], None]) -> None:
    """Each body in a thread of its own (and its own connection), all started, then joined."""
    threads = [threading.Thread(target=body) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a body did not end within a minute"


def _backend_pid() -> int:
    """The server process of this thread's connection."""
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def _blocked_on_a_lock(pid: int) -> bool:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return bool(row and row[0] == "Lock")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("operation", ["update", "bulk_update", "delete"])
def test_a_stale_fenced_write_to_a_child_waits_for_the_successors_write_to_its_parent(
    operation: str,
) -> None:
    """Multi-table inheritance keeps the fence in the parent's table. The successor's fenced
    save (token 2) is uncommitted when the stale holder (token 1) writes the child: the stale
    write must wait for it and then be refused. It locked only the child's rows, read token 1
    (the last committed), and its parent UPDATE (by primary key, no token condition) waited
    for the successor's commit and then overwrote it, setting the token back to 1."""
    from tests.testapp.models_fencing import FencedDoc, FencedDocPart

    part = FencedDocPart(title="first", part="p")
    part.save(fence=1)
    successor_wrote, stale_started = threading.Event(), threading.Event()
    stale_pid: list[int] = []
    outcome: list[object] = []

    def successor() -> None:
        try:
            with transaction.atomic():
                parent = FencedDoc.objects.get(pk=part.pk)
                parent.title = "successor"
                parent.save(fence=2)
                successor_wrote.set()
                assert stale_started.wait(20)
                wait_until(lambda: _blocked_on_a_lock(stale_pid[0]), 20, "the stale write to wait")
        finally:
            connections.close_all()

    def stale() -> None:
        try:
            assert successor_wrote.wait(20)
            stale_pid.append(_backend_pid())
            stale_started.set()
            rows = FencedDocPart.objects.filter(pk=part.pk).fenced(1)
            if operation == "update":
                outcome.append(rows.update(title="stale"))
            elif operation == "bulk_update":
                copy = FencedDocPart.objects.get(pk=part.pk)
                copy.title = "stale"
                outcome.append(FencedDocPart.objects.fenced(1).bulk_update([copy], ["title"]))
            else:
                outcome.append(rows.delete())
        except StaleFencingToken as exc:
            outcome.append(exc)
        finally:
            connections.close_all()

    run_together(successor, stale)
    assert len(outcome) == 1 and isinstance(outcome[0], StaleFencingToken), outcome
    assert FencedDoc.objects.filter(pk=part.pk).values_list("fencing_token", "title").get() == (
        2,
        "successor",
    )


def creators_race(make: Any) -> list[object]:
    """``make(token, title)``'s instance saved with its token by two creators of one new row:
    the lower one's insert commits while the greater one's waits on it. The greater one's
    outcome."""
    lower_wrote = threading.Event()
    greater_pid: list[int] = []
    outcome: list[object] = []

    def lower() -> None:
        try:
            with transaction.atomic():
                make(1, "lower").save(fence=1)
                lower_wrote.set()
                wait_until(lambda: bool(greater_pid), 20, "the greater creator to start")
                wait_until(
                    lambda: _blocked_on_a_lock(greater_pid[0]), 20, "the greater one to wait"
                )
        finally:
            connections.close_all()

    def greater() -> None:
        try:
            assert lower_wrote.wait(20)
            greater_pid.append(_backend_pid())
            make(2, "greater").save(fence=2)
            outcome.append("saved")
        except Exception as exc:  # reported by the caller
            outcome.append(exc)
        finally:
            connections.close_all()

    run_together(lower, greater)
    return outcome


@pytest.mark.django_db(transaction=True)
def test_racing_creators_of_one_child_row_end_with_the_greater_tokens_row() -> None:
    """Two holders save a new multi-table child with one explicit primary key; the lower
    token's insert commits while the greater one's waits on it. The greater token's parent
    upsert then updated the row, but Django took it for an insert and inserted the child's
    row too: ``IntegrityError``, the greater token's write lost. As for a model of one table,
    the greater token's row now wins."""
    from tests.testapp.models_fencing import FencedDoc, FencedDocPart

    pk = 900_001
    outcome = creators_race(lambda token, title: FencedDocPart(pk=pk, title=title, part=title))
    assert outcome == ["saved"], outcome
    row = FencedDocPart.objects.values_list("fencing_token", "title", "part").get(pk=pk)
    assert row == (2, "greater", "greater")
    assert FencedDoc.objects.filter(pk=pk).count() == 1
