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
COUNT_SQL = f"SELECT count(*) FROM idempotency_key WHERE {EXPIRED}"  # noqa: S608
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


class Command(BaseCommand):
    help = "Delete expired idempotency keys in bounded batches (safe next to live traffic)."
    talk = True

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=int, default=1000, help="rows per transaction")
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
        at_least("--max-batches", options["max_batches"], 0)
        self.talk = options["verbosity"] > 0
        with connections[alias].cursor() as cursor:
            cursor.execute(COUNT_SQL)
            total = int(cursor.fetchone()[0])
        if options["dry_run"]:  # the count is what was asked for: printed at any verbosity
            self.stdout.write(f"{total} expired idempotency key(s)")
            return
        self.say(f"{total} expired idempotency key(s)")
        if total == 0:
            return
        deleted = batches = 0
        after: datetime | str = "-infinity"
        started = time.monotonic()
        while not options["max_batches"] or batches < options["max_batches"]:
            with connections[alias].cursor() as cursor:
                cursor.execute(PURGE_BATCH_SQL, {"after": after, "batch": batch})
                count, newest = cursor.fetchone()
            after = newest or after
            deleted += count
            batches += 1
            self._progress(deleted, max(total, deleted), time.monotonic() - started)
            if count < batch:
                break
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
        self.say(f"[{bar}] {done}/{total} {rate:,.0f} keys/s ETA {eta}")
