"""A partial index on the lease rows that have a holder (see ``Lease.Meta.indexes``).

Built ``CONCURRENTLY`` (so ``atomic = False``): on a table of a million rows a plain
``CREATE INDEX`` would block every acquire and release until it finished.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("leases", "0004_audit_user_without_constraint"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="lease",
            index=models.Index(
                condition=models.Q(("holder", ""), _negated=True),
                fields=["name"],
                include=["expires_at"],
                name="leases_lease_holder_set",
            ),
        ),
    ]
