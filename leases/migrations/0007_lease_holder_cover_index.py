"""The partial index on lease rows with a holder carries every column a listing shows (see
``Lease.Meta.indexes``), so ``leases list`` reads the held names from the index alone.

The new index is built before the old one is dropped, both ``CONCURRENTLY`` (so
``atomic = False``): on a table of a million rows a plain ``CREATE INDEX`` would block every
acquire and release until it finished, and dropping first would leave the held-names queries
without an index in between.
"""

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("leases", "0006_token_floor_of_pruned_lease_rows"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="lease",
            index=models.Index(
                condition=models.Q(("holder", ""), _negated=True),
                fields=["name"],
                include=["expires_at", "holder", "token", "acquired_at", "renewed_at"],
                name="leases_lease_holder_cover",
            ),
        ),
        RemoveIndexConcurrently(model_name="lease", name="leases_lease_holder_set"),
    ]
