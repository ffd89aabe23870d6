"""``manage.py demo_admin``: (re)create the demo's superuser with a fresh password, print it.

Run by ``scripts/demo runserver`` so a newcomer can open the admin at once. The password is new
on every run because the demo may run against a configured, long-lived database, where a fixed
well-known password would be a standing invitation.
"""

from __future__ import annotations

import secrets
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser

USERNAME = "admin"


class Command(BaseCommand):
    help = "Create or reset the demo superuser 'admin' with a new random password."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--url", default="http://127.0.0.1:8000/admin/", help="to print")

    def handle(self, *args: Any, **options: Any) -> None:
        password = secrets.token_urlsafe(9)
        user, _ = get_user_model().objects.get_or_create(username=USERNAME)
        user.is_staff = user.is_superuser = True
        user.set_password(password)
        user.save()
        self.stdout.write(
            self.style.SUCCESS(
                f"admin: {options['url']}  user {USERNAME}  password {password}"
                "  (new on every start)"
            )
        )
