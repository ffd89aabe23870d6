"""``manage.py purge_idempotency_keys``: delete expired keys in small batches.

Each batch is its own short transaction that deletes only expired keys and never waits for a
row a request holds (it skips a key a request is taking over right now), so the purge can run
next to live traffic and never holds the table. Expiry is judged by the database clock, like
everywhere else.

What a request beside it feels is the purge's WAL: every 16 MB of WAL, the writer that crosses
into a new segment creates (zero-fills) it holding ``WALWriteLock``, and each commit waits for
that, a request's key insert included. So a batch deletes without locking its rows first (a
row lock is a WAL record of its own: twice the WAL per key), and ``--batch-time`` keeps batches
short on a busy server. Sizing: ``--batch-size`` bounds a batch; ``--sleep`` spreads the WAL
(and the disk writes) out, trading purge speed for fewer stalls per second; the progress line
shows the rate and the time left, so the first run tells what a day's keys cost.

Bad input (``--batch-size 0``, a negative ``--sleep``, an unknown ``--database``) ends with one
``CommandError`` line and exit status 1; ``-v 0`` prints nothing but errors.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import OperationalError, connections, transaction

from idempotency import conf
from leases.management._options import at_least, database, pause

#: What a claim would no longer resume: a started key's ``expires_at`` is pushed to a TTL after
#: each recorded step and after its release (:data:`idempotency.statements.RECORD_STEP`), so a
#: failed operation's recovery points are kept as long as a retry may resume from them.
EXPIRED = """
expires_at < clock_timestamp() AND (state <> 'started' OR locked_until < clock_timestamp())
"""
#: Every expired key counted: a scan of all of them (of ten million keys, seconds of both cores
#: and the whole table through the cache), so only ``--dry-run``, which asks for it, runs it.
COUNT_SQL = f"SELECT count(*) FROM idempotency_key WHERE {EXPIRED}"  # noqa: S608
#: The expired keys counted up to ``bound`` (the expiry index finds them: the sub-select's
#: clock is indexable, the row's verdict is :data:`EXPIRED`'s), and the database clock: a
#: purge's total for its progress bar, exact when small, and when it is not, the moment the
#: planner's estimate is asked for.
BOUNDED_COUNT_SQL = f"""
SELECT count(*), clock_timestamp() FROM (
    SELECT 1 FROM idempotency_key WHERE expires_at < (SELECT clock_timestamp()) AND {EXPIRED}
    LIMIT %(bound)s
) AS expired
"""  # noqa: S608
#: The planner's estimate of the keys expired at ``moment`` (the statistics' histogram of
#: ``expires_at``, scaled to the table's current size: no row read).
ESTIMATE_SQL = "EXPLAIN (FORMAT JSON) SELECT 1 FROM idempotency_key WHERE expires_at < %(moment)s"
#: Up to this many expired keys are counted exactly; more are estimated.
EXACT_BELOW = 10_000
#: One batch, oldest first, from where the last one ended (``after``: its newest
#: ``expires_at``). Without that bound every batch would walk the index entries of the rows the
#: batches before it deleted (dead until the next VACUUM) before finding live ones: a purge of
#: millions slowed down batch by batch. Returns the candidates found (fewer than the batch: the
#: purge is done), the rows deleted and the newest expiry among the candidates.
#:
#: No row lock first: ``FOR UPDATE`` writes a WAL record per row before the delete writes its
#: own, twice the WAL of the delete alone (112 bytes a key instead of 58). The purge's WAL is what
#: holds up the requests beside it: each 16 MB of it makes the next writer create a WAL segment
#: under ``WALWriteLock``, and every commit waits for that (a request's key insert, 60-160 ms on
#: a loaded disk). The delete re-checks :data:`EXPIRED` itself, so a key a request took over and
#: committed since the candidates were read is left alone; one a request holds right now would
#: make the delete wait, so this runs under a tiny ``lock_timeout`` and such a batch is redone
#: with :data:`PURGE_LOCKED_BATCH_SQL`.
PURGE_BATCH_SQL = f"""
WITH candidates AS (
    SELECT id, expires_at FROM idempotency_key WHERE expires_at >= %(after)s AND {EXPIRED}
    ORDER BY expires_at LIMIT %(batch)s
), gone AS (
    DELETE FROM idempotency_key WHERE id IN (SELECT id FROM candidates) AND {EXPIRED}
    RETURNING id
)
SELECT (SELECT count(*) FROM candidates), (SELECT count(*) FROM gone),
       (SELECT max(expires_at) FROM candidates)
"""  # noqa: S608
#: The same batch locking its rows first and skipping those a request holds (never waiting for
#: one): the fallback when :data:`PURGE_BATCH_SQL` met a locked row.
PURGE_LOCKED_BATCH_SQL = f"""
WITH candidates AS (
    SELECT id, expires_at FROM idempotency_key WHERE expires_at >= %(after)s AND {EXPIRED}
    ORDER BY expires_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM idempotency_key WHERE id IN (SELECT id FROM candidates)
    RETURNING id
)
SELECT (SELECT count(*) FROM candidates), (SELECT count(*) FROM gone),
       (SELECT max(expires_at) FROM candidates)
"""  # noqa: S608
#: How long the lock-free batch waits on a row a request holds before it is redone locking.
NO_WAIT_SQL = "SELECT set_config('lock_timeout', '1ms', true)"
LOCK_NOT_AVAILABLE = "55P03"
BAR_WIDTH = 30
#: What a batch aims to take (``--batch-time``), in milliseconds.
TARGET_BATCH_MS = 50.0
#: Batches do not shrink below this many rows, however slow (a batch of one is mostly overhead).
SMALLEST_BATCH = 50


class Command(BaseCommand):
    help = "Delete expired idempotency keys in bounded batches (safe next to live traffic)."
    talk = True
    #: The progress bar's total is the planner's estimate (shown as ``~N``).
    approximate = False

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size", type=int, default=1000, help="at most this many rows per transaction"
        )
        parser.add_argument(
            "--batch-time",
            type=float,
            default=TARGET_BATCH_MS,
            help="milliseconds a batch aims at: slower ones make the next smaller (0: fixed size)",
        )
        parser.add_argument(
            "--sleep", type=float, default=0.0, help="seconds to pause between batches"
        )
        parser.add_argument("--max-batches", type=int, default=0, help="stop after N (0: all)")
        parser.add_argument("--database", default=None, help="alias (default: the setting's)")
        parser.add_argument("--dry-run", action="store_true", help="only count expired keys")

    def handle(self, *args: Any, **options: Any) -> None:
        alias = database(options["database"] or conf.get().database)
        batch = int(at_least("--batch-size", options["batch_size"], 1))
        pause("--sleep", options["sleep"])
        target = at_least("--batch-time", options["batch_time"], 0) / 1000
        at_least("--max-batches", options["max_batches"], 0)
        self.talk = options["verbosity"] > 0
        if options["dry_run"]:  # the count is what was asked for: printed at any verbosity
            with connections[alias].cursor() as cursor:
                cursor.execute(COUNT_SQL)
                self.stdout.write(f"{cursor.fetchone()[0]} expired idempotency key(s)")
            return
        total, exact = expired_keys(alias)
        self.approximate = not exact
        self.say(f"{'' if exact else '~'}{total} expired idempotency key(s)")
        if total == 0:
            return
        deleted = batches = 0
        size = batch
        after: datetime | str = "-infinity"
        started = time.monotonic()
        while not options["max_batches"] or batches < options["max_batches"]:
            sent = time.monotonic()
            found, count, newest = purge_batch(alias, after, size)
            took = time.monotonic() - sent
            after = newest or after
            deleted += count
            batches += 1
            if found < size:  # done: the total is now known
                self.approximate = False
                self._progress(deleted, deleted, time.monotonic() - started)
                break
            self._progress(deleted, max(total, deleted), time.monotonic() - started)
            if target:
                size = next_size(size, took, target, batch)
            if options["sleep"]:
                time.sleep(options["sleep"])
        self.say(self.style.SUCCESS(f"deleted {deleted} expired key(s)"))

    def say(self, line: str) -> None:
        """Progress and totals; ``-v 0`` (cron, scripts) silences them, never errors."""
        if self.talk:
            self.stdout.write(line)

    def _progress(self, done: int, total: int, elapsed: float) -> None:
        """``[####------] 2000/10000 1,850 keys/s ETA 4s``: rate and time left so far."""
        filled = BAR_WIDTH * done // total if total else BAR_WIDTH
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f"{(total - done) / rate:.0f}s" if rate else "?"
        about = "~" if self.approximate else ""
        self.say(f"[{bar}] {done}/{about}{total} {rate:,.0f} keys/s ETA {eta}")


def purge_batch(alias: str, after: datetime | str, size: int) -> tuple[int, int, datetime | None]:
    """One batch: candidates found, keys deleted, the candidates' newest expiry. Lock-free
    (half the WAL); redone with row locks that skip a key a request holds if it met one."""
    params = {"after": after, "batch": size}
    try:
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(NO_WAIT_SQL)
            cursor.execute(PURGE_BATCH_SQL, params)
            found, count, newest = cursor.fetchone()
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
            cursor.execute(PURGE_LOCKED_BATCH_SQL, params)
            found, count, newest = cursor.fetchone()
    return int(found), int(count), newest


def next_size(size: int, took: float, target: float, largest: int) -> int:
    """The next batch's size after one of ``size`` rows took ``took`` seconds: scaled to take
    ``target`` (at most doubled, never above ``largest`` nor below :data:`SMALLEST_BATCH`).

    A batch slows when the server is busy (or its pages are not cached): the next, smaller one
    holds its share of the disk, the WAL and the CPU for less time, and the requests beside
    it wait less for them. When the server is quiet again, batches grow back."""
    scaled = size * min(target / took, 2.0) if took > 0 else size * 2.0
    return max(min(int(scaled), largest), min(SMALLEST_BATCH, largest))


def expired_keys(alias: str) -> tuple[int, bool]:
    """How many keys are expired, and whether that is exact: counted up to
    :data:`EXACT_BELOW`, the planner's estimate above (never a scan of the whole table)."""
    with connections[alias].cursor() as cursor:
        cursor.execute(BOUNDED_COUNT_SQL, {"bound": EXACT_BELOW})
        counted, moment = cursor.fetchone()
        if counted < EXACT_BELOW:
            return int(counted), True
        cursor.execute(ESTIMATE_SQL, {"moment": moment})
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    return max(int(plan[0]["Plan"]["Plan Rows"]), EXACT_BELOW), False
