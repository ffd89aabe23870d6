from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Invoice",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("fencing_token", models.BigIntegerField(default=0, editable=False)),
                ("number", models.CharField(max_length=32, unique=True)),
                ("customer", models.CharField(max_length=100)),
                ("total_cents", models.BigIntegerField(default=0)),
                (
                    "status",
                    models.CharField(
                        choices=[("draft", "Draft"), ("issued", "Issued"), ("paid", "Paid")],
                        default="draft",
                        max_length=10,
                    ),
                ),
                ("last_writer", models.CharField(blank=True, default="", max_length=100)),
                ("updated_at", models.DateTimeField(auto_now=True)),
            ],
            options={"ordering": ["number"]},
        ),
    ]
