"""Models of the demo shop; each feature's demo adds its own."""

from __future__ import annotations

from django.db import models

from leases import FencedModel


class Invoice(FencedModel):
    """An invoice that workers finalise under a lease; a stale worker's write is refused.

    Being a ``FencedModel`` it carries ``fencing_token``: ``save(fence=lease)`` only writes if
    no worker with a newer lease has written since.
    """

    class Status(models.TextChoices):
        DRAFT = "draft", "Draft"
        ISSUED = "issued", "Issued"
        PAID = "paid", "Paid"

    number = models.CharField(max_length=32, unique=True)
    customer = models.CharField(max_length=100)
    total_cents = models.BigIntegerField(default=0)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.DRAFT)
    #: Which worker made the last accepted write (the demo narrates it).
    last_writer = models.CharField(max_length=100, blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["number"]

    def __str__(self) -> str:
        return f"{self.number} ({self.customer}, {self.total_cents / 100:.2f}, {self.status})"
