"""A project whose user model has no ``username`` field (``USERNAME_FIELD = "email"``).

Custom user models are common, and the operator's commands name a user: ``manage.py leases
release/terminate --user`` must find that user by the model's ``USERNAME_FIELD``. It ran
``filter(username=...)``, so on such a project every release from a terminal died of a
``FieldError`` traceback. A child process runs it: the user model is chosen before the first
migration, so it cannot be swapped inside this test process.
"""

from __future__ import annotations

import json
import subprocess

#: An e-mail address longer than ``ForceRelease.by_username`` (150 characters).
LONG_EMAIL = "operator-" + "x" * 170 + "@example.com"

CHILD = """
import json
from io import StringIO

import django
django.setup()
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command

from leases import acquire
from leases.backends import get_backend
from leases.models import ForceRelease

call_command("migrate", verbosity=0)
User = get_user_model()
plain = User.objects.create_user("plain@example.com")
operator = User.objects.create_user(%(operator)r)
operator.user_permissions.add(Permission.objects.get(codename="force_release_lease"))
held = acquire("nightly", ttl=300, timeout=0, keepalive=False)


def release(email):
    out = StringIO()
    try:
        call_command("leases", "release", "nightly", "--token", str(held.token), "--user", email,
                     stdout=out)
    except CommandError as exc:
        return "CommandError: " + str(exc)
    return out.getvalue()


found = {
    "unknown": release("nobody@example.com"),
    "plain": release("plain@example.com"),
    "still_held": get_backend().inspect("nightly").held,
    "operator": release(%(operator)r),
    "held_after": get_backend().inspect("nightly").held,
    "audit": [[r.by_id == operator.pk, r.by_username, r.via] for r in ForceRelease.objects.all()],
}
print(json.dumps(found))
"""


def test_release_from_a_terminal_finds_the_user_by_its_username_field(
    child_env: dict[str, str], python: str, empty_database: str
) -> None:
    env = {
        **child_env,
        "DJANGO_SETTINGS_MODULE": "tests.email_user_settings",
        "EMAIL_USERS_DATABASE_URL": empty_database,
    }
    done = subprocess.run(
        [python, "-c", CHILD % {"operator": LONG_EMAIL}],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["unknown"] == "CommandError: no user 'nobody@example.com'", found
    # Refused, naming who was refused (not "anonymous"), and nothing released.
    assert found["plain"] == (
        "CommandError: plain@example.com lacks the leases.force_release_lease permission"
    ), found
    assert found["still_held"] is True, found
    assert "token 1 revoked" in found["operator"], found
    assert found["held_after"] is False, found
    # Audited, the operator's address cut to the column's length rather than failing the
    # audit after the release was done.
    assert found["audit"] == [[True, LONG_EMAIL[:150], "command"]], found
