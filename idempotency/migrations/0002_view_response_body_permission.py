"""The ``view_response_body`` permission: reading stored responses in the admin."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("idempotency", "0001_initial"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="idempotencykey",
            options={
                "permissions": [
                    (
                        "view_response_body",
                        "Can view the stored responses (headers and body) of keys",
                    )
                ],
                "verbose_name": "idempotency key",
            },
        ),
    ]
