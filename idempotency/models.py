"""The key table: one row per (scope, key), the request's fingerprint and its stored outcome.

A row is ``started`` while its first request runs, holding a lock until ``locked_until`` (on the
database clock, so app servers' clocks never matter); a retry may take it over after that, which is
how a crashed request's key becomes usable again. ``owner`` names the attempt holding the lock, so
a late finish of an attempt that was taken over changes nothing. A ``completed`` row replays its
response until ``expires_at``.

A multi-step operation (:mod:`idempotency.steps`) records each completed step's result in
``steps`` with the step's own effects, so a retry after a crash resumes after the last one.

A stored response is what one client was told (a payment's details, a created credential), so
reading it takes a permission of its own, ``view_response_body``, beyond the admin's view
permission on keys.
"""

from __future__ import annotations

from django.db import models
from django.db.models import JSONField, Value

__all__ = ["IdempotencyKey"]


class IdempotencyKey(models.Model):
    class State(models.TextChoices):
        STARTED = "started", "started"
        COMPLETED = "completed", "completed"

    scope = models.CharField(max_length=255)
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64)
    state = models.CharField(max_length=16, choices=State.choices, default=State.STARTED)
    owner = models.UUIDField(null=True, blank=True)
    locked_until = models.DateTimeField(null=True, blank=True)
    response_status = models.IntegerField(null=True, blank=True)
    response_headers = models.JSONField(default=list, blank=True)
    response_body = models.BinaryField(null=True, blank=True)
    #: Steps of a multi-step operation recorded so far (name -> result), while ``started``.
    #: A database default too, so rows written by raw SQL (bulk loads, the purge's tests) get it.
    steps = models.JSONField(default=dict, db_default=Value({}, JSONField()), blank=True)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "idempotency_key"
        verbose_name = "idempotency key"
        permissions = [
            ("view_response_body", "Can view the stored responses (headers and body) of keys")
        ]
        constraints = [
            models.UniqueConstraint(fields=["scope", "key"], name="idempotency_key_scope_key")
        ]
        #: ``expires_at`` for the purge; ``(created_at, id)`` for the admin's newest-first page,
        #: read backwards, and the same for the few keys still ``started`` (the in-flight
        #: requests an operator looks for), so neither sorts millions of rows for one page.
        indexes = [
            models.Index(fields=["expires_at"], name="idempotency_key_expires"),
            models.Index(fields=["created_at", "id"], name="idempotency_key_created"),
            models.Index(
                fields=["created_at", "id"],
                condition=models.Q(state="started"),
                name="idempotency_key_started",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.scope} / {self.key} ({self.state})"
