"""``steps``: the recovery points of a multi-step operation (``idempotency.steps``).

A constant database default (kept, so raw inserts get it too), so PostgreSQL adds the column without rewriting the table (11+): no long
lock on a table of millions of keys. Named for what it adds; renumber freely if another
migration takes 0004 first.
"""

from django.db import migrations, models
from django.db.models import JSONField, Value


class Migration(migrations.Migration):
    dependencies = [
        ("idempotency", "0003_key_created_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="idempotencykey",
            name="steps",
            field=models.JSONField(
                blank=True, db_default=Value({}, JSONField()), default=dict
            ),
        ),
    ]
