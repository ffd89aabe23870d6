"""``python -m benchmarks [topic ...] [--rows N] [--keys N] [--rounds N] [--durable]``: run the
benchmark modules (all by default). ``--rows``/``--keys`` size the ``scale`` topic's big tables,
``--rounds 1`` makes it a quick check of what it measures (``tests/test_scale.py`` runs it so).
``--durable`` starts the throwaway PostgreSQL with ``fsync`` and ``full_page_writes`` on, as a
production server runs: the test harness's servers turn both off (their data is thrown away),
so by default a commit waits for no disk, and figures bounded by commits (a contended lease,
an idempotent first request) read as on a server that does not flush. A configured
``DATABASE_URL`` is used as it is.

Servers: ``DATABASE_URL`` / ``REDIS_URL`` when reachable, else throwaway ones for this run. A
throwaway PostgreSQL gets a buffer cache sized as for a dedicated server (:func:`buffer_cache`),
not the test harness's 32 MB: with a million-row table in 32 MB every random row is a cache miss,
and the ``scale`` topic would time the server's sizing instead of the package's statements.
Django is set up with the demo project's settings and migrated before any module runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from benchmarks.arguments import at_least
from benchmarks.common import Report
from benchmarks.servers import DURABLE, django_on_servers


def buffer_cache() -> str:
    """A quarter of the machine's memory, at most 1 GB: PostgreSQL's own sizing advice for a
    dedicated server (its 128 MB default is meant to start anywhere, not to serve big tables)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{max(32, min(1024, memory // 4 // 2**20))}MB"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench")
    parser.add_argument("topics", nargs="*")
    parser.add_argument("--rows", type=at_least(1), help="scale: lease rows (default 1,000,000)")
    parser.add_argument(
        "--keys", type=at_least(1), help="scale: idempotency keys (default 10 x rows)"
    )
    parser.add_argument("--rounds", type=at_least(1), help="scale: measured rounds (default 7)")
    parser.add_argument(
        "--durable", action="store_true", help="a throwaway PostgreSQL flushes its commits"
    )
    args = parser.parse_args(argv)
    names = sorted(
        info.name[len("bench_") :]
        for info in pkgutil.iter_modules([os.path.dirname(__file__)])
        if info.name.startswith("bench_")
    )
    for topic in args.topics:  # before any server starts: a typo must not read as a run
        if topic not in names:
            parser.error(f"unknown topic {topic!r}; the topics are {', '.join(names)}")
    chosen = [n for n in names if not args.topics or n in args.topics]
    settings = {"shared_buffers": buffer_cache()}
    if args.durable:
        settings |= DURABLE
    with django_on_servers(postgres_settings=settings):
        report = Report(options={"rows": args.rows, "keys": args.keys, "rounds": args.rounds})
        for name in chosen:
            module = importlib.import_module(f"benchmarks.bench_{name}")
            print(f"\n=== {module.TITLE}", flush=True)
            module.main(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
