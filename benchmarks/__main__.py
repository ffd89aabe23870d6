"""``python -m benchmarks [topic ...]``: run the benchmark modules (all by default).

Servers: ``DATABASE_URL`` / ``REDIS_URL`` when reachable, else throwaway ones for this run.
Django is set up with the demo project's settings and migrated before any module runs.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

from benchmarks.common import Report
from devservers import PostgresServer, RedisServer, configured_or_throwaway


def main(argv: list[str]) -> int:
    owned: list[PostgresServer | RedisServer] = []
    try:
        os.environ.update(configured_or_throwaway(owned))
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        names = sorted(
            info.name[len("bench_") :]
            for info in pkgutil.iter_modules([os.path.dirname(__file__)])
            if info.name.startswith("bench_")
        )
        chosen = [n for n in names if not argv or n in argv]
        report = Report()
        for name in chosen:
            module = importlib.import_module(f"benchmarks.bench_{name}")
            print(f"\n=== {module.TITLE}", flush=True)
            module.main(report)
        return 0
    finally:
        for server in owned:
            server.destroy()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
