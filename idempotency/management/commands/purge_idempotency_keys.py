"""``manage.py purge_idempotency_keys``: delete expired keys in small batches.

Each batch is its own short transaction that locks only the rows it deletes (``SKIP LOCKED``
leaves rows a request is taking over right now alone), so the purge can run next to live traffic
and never holds the table. Expiry is judged by the database clock, like everywhere else.

Sizing: a batch of ``--batch-size`` rows holds its row locks for as long as it takes to delete
them. A request inserting a key never waits on those rows (they are expired: nobody inserts
them), it only shares the disk and the WAL with the purge. Smaller batches and a ``--sleep``
trade purge speed for a quieter disk; the progress line shows the rate and the time left, so
the first run tells what a day's keys cost.

Bad input (``--batch-size 0``, a negative ``--sleep``, an unknown ``--database``) ends with one
``CommandError`` line and exit status 1; ``-v 0`` prints nothing but errors.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connections

from idempotency import conf
from leases.management._options import at_least, database

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
#: millions slowed down batch by batch. Returns the rows deleted and the newest expiry among them.
PURGE_BATCH_SQL = f"""
WITH gone AS (
    DELETE FROM idempotency_key WHERE id IN (
        SELECT id FROM idempotency_key WHERE expires_at >= %(after)s AND {EXPIRED}
        ORDER BY expires_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED
    )
    RETURNING expires_at
)
SELECT count(*), max(expires_at) FROM gone
"""  # noqa: S608
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
        at_least("--sleep", options["sleep"], 0)
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
            with connections[alias].cursor() as cursor:
                cursor.execute(PURGE_BATCH_SQL, {"after": after, "batch": size})
                count, newest = cursor.fetchone()
            took = time.monotonic() - sent
            after = newest or after
            deleted += count
            batches += 1
            if count < size:  # done: the total is now known
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
