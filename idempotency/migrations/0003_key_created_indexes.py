"""Indexes for the admin's newest-first pages (see ``IdempotencyKey.Meta.indexes``).

Built ``CONCURRENTLY`` (so ``atomic = False``): on a table of ten million keys a plain
``CREATE INDEX`` would block every request's key insert until it finished.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("idempotency", "0002_view_response_body_permission"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="idempotencykey",
            index=models.Index(fields=["created_at", "id"], name="idempotency_key_created"),
        ),
        AddIndexConcurrently(
            model_name="idempotencykey",
            index=models.Index(
                condition=models.Q(("state", "started")),
                fields=["created_at", "id"],
                name="idempotency_key_started",
            ),
        ),
    ]
