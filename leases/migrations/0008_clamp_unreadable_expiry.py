"""Bring every lease row's expiry within ``MAX_TTL_LIMIT`` (3650 days) of now.

Before TTLs were capped, a lease could be written expiring past the year 9999: PostgreSQL
keeps such a date, Python cannot read it back, so the admin's lease list failed on every page
that showed one. This moves the few that exist to the latest expiry the lease API can write
(still held for ten years: nothing that was held is freed); every other row is untouched. Not
reversed: the old dates were unreadable, not information.

A direct backend call, an older release still running during the upgrade, or a hand-written
row can still store such a date: ``expires_at`` becomes a field whose every ORM read clamps
it (``ReadableDateTimeField``), as the backend's own reads already do.
"""

from django.db import migrations

import leases.models

#: Any expiry further off than the lease API allows, down to the furthest it allows.
CLAMP_SQL = """
UPDATE leases_lease
   SET expires_at = now() + interval '3650 days'
 WHERE expires_at > now() + interval '3650 days'
"""


class Migration(migrations.Migration):
    dependencies = [
        ("leases", "0007_lease_holder_cover_index"),
    ]

    operations = [
        migrations.AlterField(
            model_name="lease",
            name="expires_at",
            field=leases.models.ReadableDateTimeField(blank=True, null=True),
        ),
        migrations.RunSQL(CLAMP_SQL, reverse_sql=migrations.RunSQL.noop, elidable=True),
    ]
