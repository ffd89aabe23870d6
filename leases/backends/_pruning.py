"""Deleting the lease rows of names nobody has used for a long time, without letting a token
go backwards, and without holding up anyone's acquire.

A row is a name's token counter, so a pruned name's next grant makes a new row. Each new row
starts above a floor (``leases_token_floor``): :data:`FLOOR_SQL` is part of every statement that
creates a row (the database backend's acquire, Redlock's durable counter). A prune raises the
floor above every token it deletes, so a pruned name's next token is higher than any it ever
had, whichever backend takes it.

The race: an acquire of a name evaluates the floor before it finds the row it conflicts with.
If that row is deleted meanwhile (a prune that commits while the acquire waits on the row), the
acquire inserts a new row with the floor it read *before* the prune raised it: token 1 again.
So the floor must be raised, and committed, before every statement that could still have read
the old one is over. A batch therefore runs in three steps:

1. :data:`RAISE_FLOOR_SQL` reads the next ``batch`` names and raises the floor to the highest
   token among those it may prune (committed: from now on every new statement reads it).
2. It waits until every transaction that held a writing lock on ``leases_lease`` at that moment
   has ended (:data:`WRITERS_SQL`, polled). A statement takes its table lock before its snapshot
   (PostgreSQL takes a statement's snapshot after its locks, for a prepared ``EXECUTE`` too), so
   any acquire that may have read the old floor is among them. This is how ``CREATE INDEX
   CONCURRENTLY`` waits for older transactions: the prune waits; nobody waits for it.
3. :data:`DELETE_SQL` deletes those names that are still free, still old enough and whose token
   is at most the floor of step 1 (a name granted and released since has a higher token and
   stays), skipping rows an acquire has locked.

An acquire that read the old floor has thus ended before step 3: it either found the row and
bumped it in place (then the row is held or newer, and stays) or was refused. Every acquire that
inserts a row for a pruned name read the raised floor. The one lock the prune takes besides its
rows' is ``ROW EXCLUSIVE`` on the table, which acquires share: an acquire, renewal or release
waits for a prune only on a row being deleted, i.e. only for a name unused for ``--older-than``.
(Before, each batch took ``SHARE ROW EXCLUSIVE`` on the table, which held every acquire for the
batch's duration: up to 120 ms at a million rows on a loaded machine.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from ..errors import BackendUnavailable
from ._pgconn import close_quietly, connect, driver_failure

__all__ = [
    "COUNT_SQL",
    "DELETE_SQL",
    "FLOOR_SQL",
    "RAISE_FLOOR_SQL",
    "WRITERS_SQL",
    "Progress",
    "Slice",
    "delete_slice",
    "prune_batch",
    "prune_rows",
    "raise_floor",
    "wait_for_writers",
]

#: The first token of a new row (an expression): above the highest token ever pruned.
FLOOR_SQL = "1 + COALESCE((SELECT token FROM leases_token_floor WHERE id = 1), 0)"

#: How long a batch waits for the writers of step 2 before the prune gives up (a long
#: transaction that wrote ``leases_lease`` and stays open: nothing more is deleted until it ends).
WRITERS_TIMEOUT = 10.0
#: The first and the longest pause between two looks at the writers: an acquire is over in a
#: millisecond or two, so the first look after it usually finds none left.
WRITERS_POLL = (0.0005, 0.02)

#: Step 1: the next ``batch`` names after ``after`` (keyset on the primary key, so a batch reads
#: ``batch`` rows however many were pruned before it); those free since more than ``older``
#: seconds on the server's clock are the candidates, and the floor is raised to their highest
#: token. A row without an expiry (a Redlock token counter) is never a candidate. Returns the last
#: name read, rows read, the candidates and the floor now (``NULL`` when there were none).
RAISE_FLOOR_SQL = """
WITH slice AS (
    SELECT name, holder, token, expires_at FROM leases_lease
    WHERE name > %(after)s::text ORDER BY name LIMIT %(batch)s
), candidates AS (
    SELECT name, token FROM slice
    WHERE holder = '' AND expires_at < clock_timestamp() - make_interval(secs => %(older)s)
), floor AS (
    INSERT INTO leases_token_floor (id, token, raised_at, pruned_rows)
    SELECT 1, max(token), clock_timestamp(), 0 FROM candidates HAVING count(*) > 0
    ON CONFLICT (id) DO UPDATE
    SET token = GREATEST(leases_token_floor.token, EXCLUDED.token), raised_at = EXCLUDED.raised_at
    RETURNING token
)
SELECT (SELECT max(name) FROM slice), (SELECT count(*) FROM slice),
       COALESCE((SELECT array_agg(name) FROM candidates), '{}'), (SELECT token FROM floor)
"""

#: Step 2: the transactions (other than ours) holding a lock on ``leases_lease`` that lets them
#: write it; with ``%(writers)s``, those of them still holding it. ``SHARE UPDATE EXCLUSIVE``
#: (vacuum, analyze) and ``SHARE`` (index builds) never write rows, so a long vacuum does not
#: stall the prune; a prepared transaction (no ``pid``) is waited for like any other.
WRITERS_SQL = """
SELECT COALESCE(array_agg(DISTINCT virtualtransaction), '{}') FROM pg_locks
WHERE locktype = 'relation' AND relation = 'leases_lease'::regclass AND granted
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND mode IN ('RowExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')
  AND pid IS DISTINCT FROM pg_backend_pid()
  AND (%(writers)s::text[] IS NULL OR virtualtransaction = ANY(%(writers)s::text[]))
"""

#: Step 3: delete the candidates still free, still old and at most ``bound`` (the floor step 1
#: committed), skipping any row a request has locked (it is being taken: not prunable anyway),
#: and count them on the floor's row. Returns rows deleted.
DELETE_SQL = """
WITH pruned AS (
    DELETE FROM leases_lease WHERE name IN (
        SELECT name FROM leases_lease
        WHERE name = ANY(%(names)s::text[]) AND holder = '' AND token <= %(bound)s
          AND expires_at < clock_timestamp() - make_interval(secs => %(older)s)
        FOR UPDATE SKIP LOCKED
    )
    RETURNING 1
), counted AS (
    UPDATE leases_token_floor SET pruned_rows = pruned_rows + (SELECT count(*) FROM pruned)
    WHERE id = 1 AND EXISTS (SELECT FROM pruned)
)
SELECT count(*) FROM pruned
"""

#: How many rows a prune of ``older`` seconds would delete now (a scan: for ``--dry-run``).
COUNT_SQL = """
SELECT count(*) FROM leases_lease
WHERE holder = '' AND expires_at < clock_timestamp() - make_interval(secs => %(older)s)
"""

#: Rows the prune will read (the planner's estimate: no scan), for a progress bar.
ESTIMATE_SQL = (
    "SELECT GREATEST(reltuples, 0)::bigint FROM pg_class WHERE oid = 'leases_lease'::regclass"
)

#: ``progress(rows read, rows pruned, rows estimated)`` after each batch.
Progress = Callable[[int, int, int], None]

#: What step 1 found: last name read (``None``: the table is done), rows read, the candidates
#: and the floor it committed (``None`` when there are no candidates).
Slice = tuple[str | None, int, list[str], int | None]


def raise_floor(conn: psycopg.Connection[Any], after: str, older: float, batch: int) -> Slice:
    """Step 1, committed on ``conn`` (autocommit) when it returns."""
    row = conn.execute(RAISE_FLOOR_SQL, {"after": after, "older": older, "batch": batch}).fetchone()
    assert row is not None
    last, read, names, bound = row
    return last, int(read), list(names), None if bound is None else int(bound)


def wait_for_writers(conn: psycopg.Connection[Any], timeout: float | None = None) -> None:
    """Step 2: return once every transaction that could write ``leases_lease`` when this was
    called has ended; :class:`TimeoutError` after ``timeout`` seconds (default
    :data:`WRITERS_TIMEOUT`; nothing is deleted then).
    """
    deadline = time.monotonic() + (WRITERS_TIMEOUT if timeout is None else timeout)
    (writers,) = conn.execute(WRITERS_SQL, {"writers": None}).fetchone()  # type: ignore[misc]
    pause = WRITERS_POLL[0]
    while writers:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{len(writers)} transaction(s) writing leases_lease stayed open")
        time.sleep(pause)
        pause = min(pause * 2, WRITERS_POLL[1])
        (writers,) = conn.execute(WRITERS_SQL, {"writers": writers}).fetchone()  # type: ignore[misc]


def delete_slice(conn: psycopg.Connection[Any], names: list[str], bound: int, older: float) -> int:
    """Step 3: rows deleted (committed on ``conn``, autocommit)."""
    row = conn.execute(DELETE_SQL, {"names": names, "bound": bound, "older": older}).fetchone()
    assert row is not None
    return int(row[0])


def prune_batch(
    conn: psycopg.Connection[Any], after: str, older: float, batch: int
) -> tuple[str | None, int, int]:
    """One batch on ``conn`` (autocommit): raise the floor, wait for older writers, delete.

    Returns the last name read (``None``: the table is done), rows read, rows pruned.
    Raises :class:`TimeoutError` if step 2 timed out (the floor was raised, nothing deleted).
    """
    last, read, names, bound = raise_floor(conn, after, older, batch)
    if not names or bound is None:
        return last, read, 0
    wait_for_writers(conn)
    return last, read, delete_slice(conn, names, bound, older)


def prune_rows(
    db_alias: str,
    older: float,
    batch: int,
    progress: Progress | None = None,
    *,
    dry_run: bool = False,
) -> int:
    """Prune ``db_alias``'s lease rows whose grant ended more than ``older`` seconds ago, in
    batches of ``batch`` rows read; returns how many were deleted (``dry_run``: would be).

    On a connection of its own, each statement its own short transaction; closed at the end.
    """
    conn = connect(db_alias)
    try:
        if dry_run:
            return int(conn.execute(COUNT_SQL, {"older": older}).fetchone()[0])  # type: ignore[index]
        estimate = int(conn.execute(ESTIMATE_SQL).fetchone()[0])  # type: ignore[index]
        after, read, pruned = "", 0, 0
        while True:
            try:
                last, batch_read, batch_pruned = prune_batch(conn, after, older, batch)
            except TimeoutError as exc:
                raise BackendUnavailable(
                    db_alias,
                    f"prune: {exc} for {WRITERS_TIMEOUT:g}s (a long transaction writing it?); "
                    f"nothing more was pruned after {pruned} row(s)",
                ) from None
            read, pruned = read + batch_read, pruned + batch_pruned
            if progress is not None:
                progress(read, pruned, max(estimate, read))
            if last is None or batch_read < batch:
                return pruned
            after = last
    except psycopg.Error as exc:
        raise driver_failure(db_alias, exc, "prune: ") from exc
    finally:
        close_quietly(conn)
