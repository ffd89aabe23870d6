"""The token floor of pruned lease rows (see ``TokenFloor``): new rows start above it.

``manage.py leases prune`` deletes the rows of names unused for a long time; without a floor a
pruned name's next grant would start again at token 1, below tokens its old holders fenced
writes with.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('leases', '0005_lease_holder_set_index'),
    ]

    operations = [
        migrations.CreateModel(
            name='TokenFloor',
            fields=[
                ('id', models.SmallIntegerField(default=1, primary_key=True, serialize=False)),
                ('token', models.BigIntegerField(default=0)),
                ('raised_at', models.DateTimeField(blank=True, null=True)),
                ('pruned_rows', models.BigIntegerField(default=0)),
            ],
            options={
                'db_table': 'leases_token_floor',
                'constraints': [models.CheckConstraint(condition=models.Q(('id', 1)), name='leases_token_floor_one_row')],
            },
        ),
    ]
