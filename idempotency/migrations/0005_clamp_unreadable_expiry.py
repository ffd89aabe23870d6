"""Bring every stored key's expiry within ``MAX_TTL_LIMIT`` (3650 days) of now.

Before TTLs were capped, a key could be stored expiring past the year 9999: PostgreSQL keeps
such a date, Python cannot read it back, so the admin's key list failed on every page that
showed one, and no purge would ever reach it. Current code cannot write one. This moves the
few that exist to the latest expiry current code could write; every other key is untouched
(the ``expires_at`` index finds them without reading the table). Not reversed: the old dates
were unreadable, not information.
"""

from django.db import migrations

#: Any expiry further off than current code allows, down to the furthest it allows.
CLAMP_SQL = """
UPDATE idempotency_key
   SET expires_at = now() + interval '3650 days'
 WHERE expires_at > now() + interval '3650 days'
"""


class Migration(migrations.Migration):
    dependencies = [
        ("idempotency", "0004_key_steps"),
    ]

    operations = [
        migrations.RunSQL(CLAMP_SQL, reverse_sql=migrations.RunSQL.noop, elidable=True),
    ]
