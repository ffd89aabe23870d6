"""Tables of the ``leases`` app.

A ``Lease`` row carries its name's token counter: deleting it would restart the name's tokens at
1 and let a stale holder's writes through every fence. Only ``manage.py leases prune`` deletes
rows (of names unused for a long time), and it first raises :class:`TokenFloor`, above which
every new row's tokens start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings
from django.db import models

from .conf import MAX_ALIAS_LENGTH

if TYPE_CHECKING:
    from django.db.models.sql.compiler import SQLCompiler

#: What the ORM passes along with a fragment of SQL.
_Params = tuple[str | int, ...]


class ReadableDateTimeField(models.DateTimeField):  # type: ignore[type-arg]
    """A date that every ORM read clamps into what Python's ``datetime`` can hold.

    PostgreSQL keeps dates up to the year 294276; psycopg cannot load one past 9999 and fails
    the whole query. The database backend's own reads clamp (``_COLUMNS`` in
    ``leases/backends/database.py``, the same bound), but a row written with an absurd TTL by
    a direct backend call, an older release or by hand made every admin page showing it fail.
    Migration 0008 clamps the rows that exist; this keeps later ones readable.
    """

    def select_format(
        self, compiler: SQLCompiler, sql: str, params: _Params
    ) -> tuple[str, _Params]:
        return f"LEAST({sql}, '9999-12-30 00:00:00+00')", params


class Lease(models.Model):
    """One row per lease name ever granted on the database backend."""

    name = models.CharField(max_length=255, primary_key=True)
    #: Empty when the lease is free (released); the counter in ``token`` survives.
    holder = models.CharField(max_length=255, blank=True, default="")
    token = models.BigIntegerField(default=0)
    acquired_at = models.DateTimeField(null=True, blank=True)
    expires_at = ReadableDateTimeField(null=True, blank=True)
    renewed_at = models.DateTimeField(null=True, blank=True)
    meta = models.JSONField(default=dict, blank=True)
    #: sha256 of the current grant's secret: renew and release must present the secret itself,
    #: so the holder and token an observer can read are not enough to release someone's lease.
    secret_hash = models.BinaryField(null=True, blank=True, editable=False)

    class Meta:
        db_table = "leases_lease"
        ordering = ["name"]
        #: Rows with a holder (held, or expired without a release): the few that operators'
        #: pages, the held-names query and ``leases list`` look for among millions of released
        #: rows, found without reading a released one. It carries every column a listing shows
        #: (all but ``meta``, which has no size bound), so "held now" is decided, and the held
        #: names are listed, from the index alone: the held rows sit one per table page among
        #: the released ones, and reading those pages was what a listing of a big table cost.
        indexes = [
            models.Index(
                fields=["name"],
                include=["expires_at", "holder", "token", "acquired_at", "renewed_at"],
                condition=~models.Q(holder=""),
                name="leases_lease_holder_cover",
            )
        ]
        permissions = [
            ("force_release_lease", "Can force-release a lease (revokes its fencing token)"),
            ("terminate_lock_session", "Can terminate a database session holding a lock"),
        ]

    def __str__(self) -> str:
        return f"{self.name} (token {self.token})"


class TokenFloor(models.Model):
    """Every token ever given to a lease row that was since pruned is at most ``token``.

    A pruned name's row (and its counter) is gone, so its next grant makes a new row; new rows
    start at ``token + 1`` instead of 1 (see ``manage.py leases prune``), which keeps a pruned
    name's tokens increasing. One row (``id = 1``), written only by the prune.
    """

    id = models.SmallIntegerField(primary_key=True, default=1)
    token = models.BigIntegerField(default=0)
    #: When the last prune raised it, and how many rows prunes removed in all (for operators).
    raised_at = models.DateTimeField(null=True, blank=True)
    pruned_rows = models.BigIntegerField(default=0)

    class Meta:
        db_table = "leases_token_floor"
        constraints = [
            models.CheckConstraint(condition=models.Q(id=1), name="leases_token_floor_one_row")
        ]

    def __str__(self) -> str:
        return f"new lease rows start above token {self.token}"


class Fence(models.Model):
    """The highest fencing token a resource that is not a row (a file, an API) has accepted."""

    resource = models.CharField(max_length=255, primary_key=True)
    token = models.BigIntegerField()

    class Meta:
        db_table = "leases_fence"
        ordering = ["resource"]

    def __str__(self) -> str:
        return f"{self.resource} @ {self.token}"


class Revocation(models.Model):
    """Grants an operator revoked: a write fenced by a lease of ``(backend, name)`` whose token
    is at most ``token`` is refused by the resource, in the same statement as the write.

    Written by every force release, in every database where the ``leases`` app is migrated
    (where fenced rows and ``leases_fence`` live), so revocation needs no successor to write
    first and works the same on every backend.
    """

    backend = models.CharField(max_length=MAX_ALIAS_LENGTH)
    name = models.CharField(max_length=255)
    #: Grants of the name with a token up to and including this one are revoked.
    token = models.BigIntegerField()
    at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "leases_revocation"
        ordering = ["backend", "name"]
        constraints = [
            models.UniqueConstraint(fields=["backend", "name"], name="leases_revocation_unique")
        ]

    def __str__(self) -> str:
        return f"{self.backend}:{self.name} revoked through token {self.token}"


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


class ForceRelease(models.Model):
    """Audit record of an operator taking a lock away: who, when, what, and from whom.

    Written by the admin action and ``manage.py leases release``/terminate alike, because a
    revoked lease is an incident someone will later need to explain.
    """

    class Action(models.TextChoices):
        RELEASE = "release", "force release (token advanced)"
        #: The store did not confirm taking the grant away (unreachable, or too few Redlock
        #: nodes): the revocation was recorded and the token may have moved, but the holder
        #: may still renew until its TTL runs out. Audited all the same, since it has effects.
        INCOMPLETE = "incomplete", "force release, incomplete (the grant may stand)"
        TERMINATE = "terminate", "database session terminated"

    action = models.CharField(max_length=16, choices=Action.choices, default=Action.RELEASE)
    name = models.CharField(max_length=255)
    backend = models.CharField(max_length=MAX_ALIAS_LENGTH, blank=True, default="")
    #: The holder evicted (or the terminated session's description) and its token.
    holder = models.CharField(max_length=255, blank=True, default="")
    token = models.BigIntegerField(null=True, blank=True)
    #: The token the name carries after the revocation (higher than ``token``).
    new_token = models.BigIntegerField(null=True, blank=True)
    #: No database constraint: the leases tables may live in a database without the user
    #: table (routed elsewhere); ``by_username`` keeps who it was either way.
    by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        db_constraint=False,
    )
    #: The operator's username, kept even if the user row is deleted later.
    by_username = models.CharField(max_length=150, blank=True, default="")
    via = models.CharField(max_length=32, blank=True, default="")
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "leases_force_release"
        ordering = ["-at", "-id"]
        verbose_name = "force release (audit)"
        verbose_name_plural = "force releases (audit)"

    def __str__(self) -> str:
        return f"{self.get_action_display()} {self.name} by {self.by_username} at {self.at}"


class AdvisoryLock(AdvisoryLockName):
    """Admin entry point for advisory locks held or awaited now (rows come from ``pg_locks``)."""

    class Meta:
        proxy = True
        verbose_name = "advisory lock (held or waiting)"
        verbose_name_plural = "advisory locks (held or waiting)"


class BackendLease(Lease):
    """Admin entry point for leases on every configured backend (via ``inspect_all``)."""

    class Meta:
        proxy = True
        verbose_name = "lease on any backend"
        verbose_name_plural = "leases on every backend"
