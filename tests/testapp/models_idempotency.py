"""The side effect idempotent test views apply: one row per charge actually made."""

from __future__ import annotations

from typing import ClassVar

from django.db import models


class Charge(models.Model):
    key = models.CharField(max_length=300, blank=True)
    amount = models.IntegerField()
    owner = models.CharField(max_length=150, blank=True)

    # The default manager and primary key Django adds: django-stubs' plugin reads the demo
    # settings, which lack this test app, so it does not declare them.
    objects: ClassVar[models.Manager[Charge]]
    pk: int

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return f"charge {self.pk} of {self.amount}"
