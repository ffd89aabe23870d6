"""``manage.py demo [SCENARIO ...]``: run the demo scenarios and narrate what they prove."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from demo_project import scenarios


class Command(BaseCommand):
    help = "Run the django-leases demo scenarios (all by default)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("names", nargs="*", help="scenario module names to run")
        parser.add_argument("--list", action="store_true", help="list the scenarios")

    def handle(self, *args: Any, **options: Any) -> None:
        found = scenarios.discover()
        if options["list"]:
            for module in found:
                self.stdout.write(f"{module.__name__.rsplit('.', 1)[1]:<16} {module.TITLE}")
            return
        wanted = set(options["names"])
        chosen = [m for m in found if not wanted or m.__name__.rsplit(".", 1)[1] in wanted]
        if wanted and len(chosen) != len(wanted):
            raise CommandError(f"unknown scenario among {sorted(wanted)}; see --list")
        for module in chosen:
            self.stdout.write(self.style.MIGRATE_HEADING(f"\n== {module.TITLE}"))
            module.run(lambda text: self.stdout.write(f"   {text}"))
        self.stdout.write(self.style.SUCCESS(f"\n{len(chosen)} scenario(s) ran as described."))
