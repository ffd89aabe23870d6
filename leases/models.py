"""Tables of the ``leases`` app.

``Lease`` rows are never deleted by the package: a row carries the name's token counter, and
deleting it would restart tokens at 1 and let a stale holder's writes through every fence.
"""

from __future__ import annotations

from django.db import models


class Lease(models.Model):
    """One row per lease name ever granted on the database backend."""

    name = models.CharField(max_length=255, primary_key=True)
    #: Empty when the lease is free (released); the counter in ``token`` survives.
    holder = models.CharField(max_length=255, blank=True, default="")
    token = models.BigIntegerField(default=0)
    acquired_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    renewed_at = models.DateTimeField(null=True, blank=True)
    meta = models.JSONField(default=dict, blank=True)

    class Meta:
        db_table = "leases_lease"
        ordering = ["name"]
        permissions = [
            ("force_release_lease", "Can force-release a lease (revokes its fencing token)"),
            ("terminate_lock_session", "Can terminate a database session holding a lock"),
        ]

    def __str__(self) -> str:
        return f"{self.name} (token {self.token})"


class Fence(models.Model):
    """The highest fencing token a resource that is not a row (a file, an API) has accepted."""

    resource = models.CharField(max_length=255, primary_key=True)
    token = models.BigIntegerField()

    class Meta:
        db_table = "leases_fence"
        ordering = ["resource"]

    def __str__(self) -> str:
        return f"{self.resource} @ {self.token}"


class AdvisoryLockName(models.Model):
    """Maps advisory lock keys back to names, so ``pg_locks`` can be shown by name."""

    key = models.BigIntegerField(primary_key=True)
    name = models.CharField(max_length=255)
    first_used_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "leases_advisory_name"
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
