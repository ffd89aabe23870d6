"""Deleting the lease rows of names nobody has used for a long time, without letting a token
go backwards.

A row is a name's token counter, so a pruned name's next grant makes a new row. Each new row
starts above a floor (``leases_token_floor``) that a prune raises to the highest token it
deletes, in the statement that deletes them: :data:`FLOOR_SQL` is part of every statement that
creates a row (the database backend's acquire, Redlock's durable counter), so a pruned name's
next token is higher than any it ever had, whichever backend takes it.

The race: an acquire of a name evaluates the floor before it finds the row it conflicts with.
If that row is deleted meanwhile (a prune that commits while the acquire waits on the row), the
acquire inserts a new row with the floor it read *before* the prune raised it: token 1 again.
So each batch runs in a transaction that first takes ``SHARE ROW EXCLUSIVE`` on
``leases_lease``: it waits for the acquires, renewals and releases in flight to finish, and
every one that starts meanwhile waits for the batch to commit, so its statement's snapshot is
taken after the commit (PostgreSQL takes a statement's snapshot after its table locks) and sees
the raised floor and the deleted row together. Reads (``inspect``, the admin) are not blocked.

The cost for everyone else: a write on ``leases_lease`` may wait for one batch (a few ms for the
default 250 rows) plus :data:`LOCK_TIMEOUT` while the batch queues for its lock; the lock request
gives up after that and the batch is retried, so a long transaction elsewhere cannot stall
acquires behind a prune. The lock also serialises prunes with each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from ..errors import BackendUnavailable
from ._pgconn import close_quietly, connect

__all__ = [
    "COUNT_SQL",
    "FLOOR_SQL",
    "LOCK_SQL",
    "PRUNE_BATCH_SQL",
    "Progress",
    "prune_batch",
    "prune_rows",
]

#: The first token of a new row (an expression): above the highest token ever pruned.
FLOOR_SQL = "1 + COALESCE((SELECT token FROM leases_token_floor WHERE id = 1), 0)"

#: How long a batch queues for its table lock before it gives up and tries again.
LOCK_TIMEOUT = 0.05
#: How many times in a row a batch may give up on its lock before the prune stops.
LOCK_ATTEMPTS = 200

LOCK_TIMEOUT_SQL = "SELECT set_config('lock_timeout', %(lock_timeout)s, true)"
LOCK_SQL = "LOCK TABLE leases_lease IN SHARE ROW EXCLUSIVE MODE"

#: One batch: the next ``batch`` names after ``after`` (keyset on the primary key, so a batch
#: reads ``batch`` rows however many were pruned before it), of which those whose grant ended
#: more than ``older`` seconds ago on the server's clock are deleted, and the floor raised to
#: their highest token in the same statement. A row without an expiry (a Redlock token
#: counter) is never pruned. Returns the last name read, rows read, rows pruned.
PRUNE_BATCH_SQL = """
WITH slice AS (
    SELECT name FROM leases_lease WHERE name > %(after)s::text ORDER BY name LIMIT %(batch)s
), pruned AS (
    DELETE FROM leases_lease l USING slice
    WHERE l.name = slice.name AND l.holder = ''
      AND l.expires_at < clock_timestamp() - make_interval(secs => %(older)s)
    RETURNING l.token
), floor AS (
    INSERT INTO leases_token_floor (id, token, raised_at, pruned_rows)
    SELECT 1, max(token), clock_timestamp(), count(*) FROM pruned HAVING count(*) > 0
    ON CONFLICT (id) DO UPDATE
    SET token = GREATEST(leases_token_floor.token, EXCLUDED.token),
        raised_at = EXCLUDED.raised_at,
        pruned_rows = leases_token_floor.pruned_rows + EXCLUDED.pruned_rows
)
SELECT (SELECT max(name) FROM slice), (SELECT count(*) FROM slice), (SELECT count(*) FROM pruned)
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


def prune_batch(
    conn: psycopg.Connection[Any], after: str, older: float, batch: int
) -> tuple[str | None, int, int]:
    """One batch in one transaction on ``conn`` (autocommit): lock, delete, raise the floor.

    Raises :class:`psycopg.errors.LockNotAvailable` when the lock was not had in time (nothing
    was done). Returns the last name read (``None``: the table is done), read, pruned.
    """
    # One round trip (pipeline mode): the lock is held for the statement's work and the
    # commit, not for the network and scheduling delays of three more round trips.
    with conn.pipeline(), conn.transaction():
        conn.execute(LOCK_TIMEOUT_SQL, {"lock_timeout": f"{LOCK_TIMEOUT * 1000:.0f}ms"})
        conn.execute(LOCK_SQL)
        cursor = conn.execute(PRUNE_BATCH_SQL, {"after": after, "older": older, "batch": batch})
    row = cursor.fetchone()
    assert row is not None
    last, read, pruned = row
    return last, int(read), int(pruned)


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

    On a connection of its own, each batch its own short transaction; closed at the end.
    """
    conn = connect(db_alias)
    try:
        if dry_run:
            return int(conn.execute(COUNT_SQL, {"older": older}).fetchone()[0])  # type: ignore[index]
        estimate = int(conn.execute(ESTIMATE_SQL).fetchone()[0])  # type: ignore[index]
        after, read, pruned, refusals = "", 0, 0, 0
        while True:
            try:
                last, batch_read, batch_pruned = prune_batch(conn, after, older, batch)
            except psycopg.errors.LockNotAvailable:
                refusals += 1
                if refusals >= LOCK_ATTEMPTS:
                    raise BackendUnavailable(
                        db_alias,
                        f"prune: leases_lease stayed locked for {LOCK_ATTEMPTS} attempts "
                        f"of {LOCK_TIMEOUT}s (a long transaction writing it?); nothing more "
                        f"was pruned after {pruned} row(s)",
                    ) from None
                time.sleep(LOCK_TIMEOUT)
                continue
            refusals = 0
            read, pruned = read + batch_read, pruned + batch_pruned
            if progress is not None:
                progress(read, pruned, max(estimate, read))
            if last is None or batch_read < batch:
                return pruned
            after = last
    except psycopg.Error as exc:
        raise BackendUnavailable(db_alias, f"prune: {type(exc).__name__}: {exc}") from exc
    finally:
        close_quietly(conn)
