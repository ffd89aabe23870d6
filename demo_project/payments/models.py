"""A payment: the side effect that must happen once however often a client resends the request."""

from __future__ import annotations

from django.db import models


class Payment(models.Model):
    amount_cents = models.PositiveIntegerField()
    currency = models.CharField(max_length=3, default="EUR")
    description = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"payment {self.pk}: {self.amount_cents} {self.currency}"
