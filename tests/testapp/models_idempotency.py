"""The side effect idempotent test views apply: one row per charge actually made."""

from __future__ import annotations

from django.db import models


class Charge(models.Model):
    key = models.CharField(max_length=300, blank=True)
    amount = models.IntegerField()
    owner = models.CharField(max_length=150, blank=True)

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return f"charge {self.pk} of {self.amount}"
