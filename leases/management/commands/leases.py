"""``manage.py leases list|show|release|terminate|watch``: the admin pages for a terminal.

``release`` has the admin action's semantics and permission model: it revokes the grant whose
token you name (``--token``, as ``list``/``show`` print it; a lease that changed hands since is
left alone), so the evicted holder's fenced writes are rejected; it needs a user holding
``leases.force_release_lease`` (``--user``), and leaves the same audit record.

``list`` and ``watch`` show at most ``--limit`` leases (default 100; 0 for all), held first:
lease rows are never deleted, so a busy shop's table has a row for every job name ever used,
and a terminal (or a script) needs the held ones, not a million released ones.

``prune --older-than 90d`` deletes the rows of names nobody has held for that long, on the
backends that keep one per name ever used (the database backend), in batches with a progress
line. A pruned name's next grant still gets a higher token than any it had (the backend keeps
a floor that new rows start above), so fencing stays safe; see the guide's "At scale" page.

``list --json`` prints the same rows as one JSON object for scripts (times in ISO 8601, the
time left in seconds). Bad input (an unknown ``--database``, an empty name, a negative
``--interval``) ends with one ``CommandError`` line and exit status 1.
"""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError
from django.utils import timezone

from leases import conf, operations
from leases._asking import ask_every_backend
from leases.backends import get_backend
from leases.backends.base import PRUNE_BATCH, LeaseBackend, LeaseInfo
from leases.errors import LeaseError
from leases.holders import SHARED_HOLDER, live_readers
from leases.management._options import (
    at_least,
    database,
    duration,
    lease_name,
    pause,
    share_base_options,
    spoken_duration,
)

#: Leases ``list`` and ``watch`` show unless told otherwise (held first).
DEFAULT_LIMIT = 100
#: The prune's progress bar, in characters.
BAR_WIDTH = 30
HEADERS = ("KIND", "BACKEND", "NAME", "STATE", "HOLDER", "TOKEN", "EXPIRES IN", "SINCE")
CLEAR_SCREEN = "\x1b[H\x1b[2J"
#: Lines of a listing formatted and written at a time: ``list --limit 0`` of a million rows
#: streams (its backends read in batches too), holding no more than this many in memory.
CHUNK = 500


def lease_row(info: LeaseInfo, now: datetime) -> tuple[str, ...]:
    delta = operations.expires_in(info, now)
    left = None if delta is None else delta.total_seconds()
    since = info.acquired_at  # when this grant began; a renewal does not start it anew
    return (
        "lease",
        info.backend,
        info.name,
        operations.lease_state(info),
        operations.shown_holder(info.holder, info.meta) or "-",
        str(info.token),
        "-" if left is None or not info.holder else f"{left:.1f}s",
        since.isoformat(timespec="seconds") if since else "-",
    )


def lease_rows(infos: Iterable[LeaseInfo]) -> list[tuple[str, ...]]:
    now = timezone.now()
    return [lease_row(info, now) for info in infos]


def advisory_rows(locks: Iterable[operations.AdvisoryLockRow], using: str) -> list[tuple[str, ...]]:
    return [
        (
            "advisory",
            f"postgres:{using}",
            row.label,  # a lease waiter's waiting room says so, as in the admin
            row.status,
            f"pid {row.pid} {row.application} {row.client}".strip(),
            row.mode,
            "-",
            row.since.isoformat(timespec="seconds") if row.since else "-",
        )
        for row in locks
    ]


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


def _lease_json(info: LeaseInfo, now: datetime) -> dict[str, Any]:
    left = operations.expires_in(info, now)
    return {
        "backend": info.backend,
        "name": info.name,
        "state": operations.lease_state(info),
        "holder": operations.shown_holder(info.holder, info.meta) or None,
        # Held by a group of readers (``holder`` then says so, in words: it is no identity).
        "shared": info.holder == SHARED_HOLDER,
        "token": info.token,
        "expires_in": None if left is None else left.total_seconds(),
        "acquired_at": _iso(info.acquired_at),
        "renewed_at": _iso(info.renewed_at),
        "expires_at": _iso(info.expires_at),
    }


def json_listing(
    infos: Iterable[LeaseInfo],
    locks: Callable[[], Iterable[operations.AdvisoryLockRow]],
    using: str,
    errors: dict[str, str],
) -> Iterator[str]:
    """``list --json``: typed values, not the table's strings, so scripts need not parse.

    The text of ``json.dumps(..., indent=2)`` of one object, in pieces of :data:`CHUNK`
    leases as ``infos`` yields them (a whole listing is never held in memory); ``locks()`` and
    ``errors`` are read after the last lease (a backend that failed half-way is in them).
    """
    now = timezone.now()
    yield '{\n  "leases": ['
    pieces: list[str] = []
    listed = 0
    for info in infos:
        item = textwrap.indent(json.dumps(_lease_json(info, now), indent=2), "    ")
        pieces.append(("," if listed else "") + "\n" + item)
        listed += 1
        if len(pieces) >= CHUNK:
            yield "".join(pieces)
            pieces = []
    yield "".join(pieces) + ("\n  ]" if listed else "]")
    advisory = [
        {
            "database": using,
            "name": row.name or None,
            "key": row.key,
            "room_of": row.room_of or None,
            "tenure_of": row.tenure_of or None,
            "state": row.status,
            "mode": row.mode,
            "pid": row.pid,
            "application": row.application,
            "client": row.client,
            "since": _iso(row.since),
        }
        for row in locks()
    ]
    rest = json.dumps({"advisory_locks": advisory, "unavailable_backends": errors}, indent=2)
    yield ",\n" + rest[len("{\n") :]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return "\n".join(table_lines(headers, rows))


def _cell(value: object) -> str:
    """A cell on one line: names may hold any character but NUL, and a newline or an escape
    sequence printed raw would split the row or rewrite the operator's terminal."""
    text = str(value)
    return text if text.isprintable() else repr(text)[1:-1]


def table_lines(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> Iterator[str]:
    """The table's text, :data:`CHUNK` lines at a time: columns as wide as their widest cell
    so far. A table of up to :data:`CHUNK` rows is aligned throughout; a longer one (a whole
    listing, streamed) widens a column where a later chunk has a wider cell."""
    widths = [0] * len(headers)
    chunk: list[Sequence[str]] = [headers]
    done = False
    iterator = iter(rows)
    while not done:
        for row in iterator:
            chunk.append(row)
            if len(chunk) >= CHUNK:
                break
        else:
            done = True
        chunk = [[_cell(cell) for cell in line] for line in chunk]
        widths = [max(width, *(len(line[i]) for line in chunk)) for i, width in enumerate(widths)]
        if chunk:
            yield "\n".join(
                "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
                for line in chunk
            )
        chunk = []


#: The most leases ``--limit`` may ask for (its ``LIMIT`` is a bigint; past it the query
#: failed and was reported as the backend being unavailable).
MAX_LIMIT = 10_000_000


def _first_line(exc: BaseException) -> str:
    """A driver error's first line (psycopg's carry the server's detail on the next ones)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class Command(BaseCommand):
    help = "List, show, watch and force-release leases and advisory locks."
    limit: int | None = DEFAULT_LIMIT

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        listing = sub.add_parser("list", help="held, expired and waiting locks on every backend")
        listing.add_argument("--database", help="database for advisory locks")
        listing.add_argument("--json", action="store_true", help="one JSON object, for scripts")
        show = sub.add_parser("show", help="one name on every backend")
        show.add_argument("name")
        show.add_argument("--database")
        release = sub.add_parser("release", help="revoke a lease by advancing its token")
        release.add_argument("name")
        release.add_argument("--backend", default="default")
        release.add_argument(
            "--token",
            type=int,
            required=True,
            help="the token shown by list/show: only that grant is released",
        )
        release.add_argument(
            "--user",
            required=True,
            help="the username (USERNAME_FIELD) of a user holding leases.force_release_lease",
        )
        terminate = sub.add_parser(
            "terminate", help="end the database session holding or awaiting advisory locks"
        )
        terminate.add_argument("pid", type=int)
        terminate.add_argument(
            "--user", required=True, help="username holding leases.terminate_lock_session"
        )
        terminate.add_argument("--yes", action="store_true", help="confirm (else: describe)")
        terminate.add_argument("--database")
        watch = sub.add_parser("watch", help="refresh the list every few seconds")
        watch.add_argument("--interval", type=float, default=2.0)
        watch.add_argument("--count", type=int, default=0, help="stop after N refreshes (0: never)")
        watch.add_argument("--database")
        prune = sub.add_parser(
            "prune", help="delete the rows of names unused for a long time (tokens stay safe)"
        )
        prune.add_argument(
            "--older-than",
            required=True,
            help="prune names free for at least this long: 90d, 12h, 30m, 45s",
        )
        prune.add_argument("--backend", default="default")
        prune.add_argument(
            "--batch-size", type=int, default=PRUNE_BATCH, help="rows read per batch"
        )
        prune.add_argument("--dry-run", action="store_true", help="only count what would go")
        for sub_parser in (listing, watch):
            sub_parser.add_argument(
                "--limit",
                type=int,
                default=DEFAULT_LIMIT,
                help=f"show at most N leases, held first (default {DEFAULT_LIMIT}; 0: all)",
            )
        share_base_options(parser, [listing, show, release, terminate, watch, prune])

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        if "database" in options:
            options["database"] = _advisory_database(options["database"])
        if "name" in options:
            lease_name(options["name"])
        if action == "watch":
            pause("--interval", options["interval"], inclusive=False)
            at_least("--count", options["count"], 0)
        if action in ("list", "watch"):
            self.limit = int(at_least("--limit", options["limit"], 0)) or None
            if self.limit is not None and self.limit > MAX_LIMIT:
                raise CommandError(f"--limit must be at most {MAX_LIMIT}, not {self.limit}")
        if action == "list" and options["json"]:
            infos, errors = self.leases()
            using = options["database"]
            locks = lambda: self.advisory(using, errors)  # noqa: E731 - read after the leases
            for piece in json_listing(infos, locks, using, errors):
                self.stdout.write(piece, ending="")
            self.stdout.write("")
        elif action == "list":
            self.write_listing(options["database"])
        else:
            try:
                self.act(action, options)
            except DatabaseError as exc:
                raise CommandError(f"database unavailable: {_first_line(exc)}") from exc

    def act(self, action: str, options: dict[str, Any]) -> None:
        """The actions that need the database throughout (its errors are one line each)."""
        if action == "show":
            self.show(options["name"], options["database"])
        elif action == "release":
            self.release(options["name"], options["backend"], options["token"], options["user"])
        elif action == "prune":
            self.prune(
                duration("--older-than", options["older_than"]),
                options["backend"],
                int(at_least("--batch-size", options["batch_size"], 1)),
                options["dry_run"],
                options["verbosity"] > 0,
            )
        elif action == "terminate":
            self.terminate(options["pid"], options["user"], options["yes"], options["database"])
        else:
            self.watch(options["interval"], options["count"], options["database"])

    def advisory(self, using: str, errors: dict[str, str]) -> list[Any]:
        """The advisory locks of database ``using``; none, with the error in ``errors`` (under
        ``advisory locks on <using>``), when it does not answer: the other backends' leases
        are still listed (they crashed with it, in a traceback)."""
        try:
            return list(operations.advisory_locks(using))
        except DatabaseError as exc:
            errors[f"advisory locks on {using}"] = _first_line(exc)
            return []

    def leases(self) -> tuple[Iterable[LeaseInfo], dict[str, str]]:
        """Up to ``--limit`` leases, held first; with ``--limit 0`` all of them as a stream."""
        if self.limit is not None:
            return operations.all_leases(self.limit)
        errors: dict[str, str] = {}
        return operations.stream_leases(errors), errors

    def write_listing(self, using: str) -> None:
        infos, errors = self.leases()
        listed = 0

        def rows() -> Iterator[tuple[str, ...]]:
            nonlocal listed
            now = timezone.now()
            for info in infos:
                listed += 1
                yield lease_row(info, now)
            yield from advisory_rows(self.advisory(using, errors), using)

        for lines in table_lines(HEADERS, rows()):
            self.stdout.write(lines)
        if self.limit is not None and listed >= self.limit:
            self.stdout.write(
                f"(the first {self.limit} leases, held first: --limit N or 0 for more)"
            )
        for alias, error in errors.items():
            what = alias if alias.startswith("advisory locks") else f"backend {alias}"
            self.stdout.write(f"{what} unavailable: {error}")

    def show(self, name: str, using: str) -> None:
        """Every backend asked at once, each for at most ``ANSWER_BOUND`` seconds, as ``list``
        does: one after the other, each unreachable cluster added its own timeouts."""
        found = False
        answers, errors = ask_every_backend(("inspect", name), _Inspect(name))
        for alias in conf.get().backends:
            if alias in errors:
                self.stderr.write(f"backend {alias} unavailable: {errors[alias]}")
                continue
            info = answers.get(alias)
            if info is None:
                continue
            found = True
            for label, value in _described(alias, info):
                self.stdout.write(f"{label:>20}: {_cell('-' if value is None else value)}")
            self.stdout.write("")
        locks = [
            row
            for row in operations.advisory_locks(using)
            if name in (row.name, row.key, row.room_of, row.tenure_of)  # its room and tenure too
        ]
        if locks:
            found = True
            self.stdout.write(format_table(HEADERS, advisory_rows(locks, using)))
        if not found:
            raise CommandError(f"no backend knows {name!r} and no advisory lock of that name")

    def release(self, name: str, backend: str, token: int, username: str) -> None:
        try:
            record = operations.force_release(
                name, backend=backend, token=token, user=_user(username), via="command"
            )
        except (PermissionDenied, LeaseError) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(
            f"released {name!r} on {backend!r}: token {record.token} revoked (now "
            f"{record.new_token}); evicted holder {record.holder}"
        )

    def prune(self, older_than: float, backend: str, batch: int, dry_run: bool, talk: bool) -> None:
        """Through the backend (only it knows what it keeps), with a progress line per batch."""
        if backend not in conf.get().backends:
            raise CommandError(f"unknown backend {backend!r}")

        def progress(read: int, pruned: int, total: int) -> None:
            elapsed = time.monotonic() - started
            rate = read / elapsed if elapsed > 0 else 0.0
            eta = f"{(total - read) / rate:.0f}s" if rate else "?"
            bar = "#" * (BAR_WIDTH * read // total if total else BAR_WIDTH)
            self.stdout.write(
                f"[{bar.ljust(BAR_WIDTH, '-')}] {read}/~{total} rows read, {pruned} pruned, "
                f"{rate:,.0f} rows/s ETA {eta}"
            )

        started = time.monotonic()
        try:
            count = get_backend(backend).prune(
                older_than,
                batch_size=batch,
                progress=progress if talk and not dry_run else None,
                dry_run=dry_run,
            )
        except LeaseError as exc:
            raise CommandError(str(exc)) from exc
        if dry_run:
            self.stdout.write(
                f"{count} lease row(s) free for {spoken_duration(older_than)} or more"
            )
        elif talk:
            self.stdout.write(self.style.SUCCESS(f"pruned {count} lease row(s) on {backend!r}"))

    def terminate(self, pid: int, username: str, confirmed: bool, using: str) -> None:
        """Like the admin's confirmation page: without ``--yes`` it only says what would end."""
        user = _user(username)
        locks = [row for row in operations.advisory_locks(using) if row.pid == pid]
        if not locks:
            raise CommandError(f"session {pid} holds or awaits no advisory lock")
        self.stdout.write(format_table(HEADERS, advisory_rows(locks, using)))
        if not confirmed:
            raise CommandError(f"not terminated: add --yes to end session {pid}")
        try:
            operations.terminate_session(
                pid, started=locks[0].started, user=user, via="command", using=using
            )
        except (PermissionDenied, LeaseError) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"terminated session {pid}")

    def watch(self, interval: float, count: int, using: str) -> None:
        done = 0
        while True:
            stamp = timezone.now().isoformat(timespec="seconds")
            self.stdout.write(f"{CLEAR_SCREEN}leases at {stamp}")
            self.write_listing(using)
            self.stdout.flush()
            done += 1
            if count and done >= count:
                return
            time.sleep(interval)


def _described(alias: str, info: LeaseInfo) -> list[tuple[str, object]]:
    """``show``'s lines for one backend's answer. The parts of a holder identity only where it
    is one ``acquire()`` made: a holder given explicitly is shown as it is (its parts were
    ``host / pid / thread:  / None /``), a group of readers as how many, then who."""
    holder = operations.parse_holder(info.holder)
    lines: list[tuple[str, object]] = [
        ("backend", alias),
        ("state", operations.lease_state(info)),
        ("holder", operations.shown_holder(info.holder, info.meta) or "-"),
    ]
    if holder.pid is not None:
        lines.append(("host / pid / thread", f"{holder.host} / {holder.pid} / {holder.thread}"))
        lines.append(("label", holder.label or "-"))
    for token, reader in live_readers(info.holder, info.meta).items():
        lines.append(("reader", f"{reader} (token {token})"))
    return [
        *lines,
        ("token", info.token),
        ("acquired at", info.acquired_at),
        ("renewed at", info.renewed_at),
        ("expires at", info.expires_at),
        ("meta", dict(info.meta)),
    ]


@dataclass(frozen=True)
class _Inspect:
    """The question ``show`` asks each backend."""

    name: str

    def __call__(self, backend: LeaseBackend) -> LeaseInfo | None:
        return backend.inspect(self.name)


def _advisory_database(requested: str | None) -> str:
    """The database whose advisory locks to show: ``--database`` if it is one operators may
    look at (it exists and has the leases tables), else the first such database."""
    if requested is not None:
        database(requested)
    try:
        return operations.advisory_database(requested)
    except PermissionDenied as exc:
        raise CommandError(str(exc)) from None


def _user(username: str) -> Any:
    """The user whose ``USERNAME_FIELD`` is ``username``: a custom user model may log in by
    e-mail address and have no ``username`` field at all."""
    model = get_user_model()
    user = model._default_manager.filter(**{model.USERNAME_FIELD: username}).first()
    if user is None:
        raise CommandError(f"no user {username!r}")
    return user
