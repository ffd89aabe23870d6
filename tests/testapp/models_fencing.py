"""Test models for fencing and the shared history checker (:mod:`tests.checker`)."""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models.functions import Now

from leases.fencing import FencedManager, FencedModel


class FencedRegister(FencedModel):
    """The fenced register every multi-holder test writes to: one row per register name.

    ``value`` is whatever the last accepted writer wrote (``writer:token:seq``), so the final
    row can be compared with the last accepted attempt in the log.
    """

    name = models.CharField(max_length=255, primary_key=True)
    value = models.CharField(max_length=255, default="")
    writes = models.BigIntegerField(default=0)

    class Meta:
        app_label = "testapp"


class RegisterLog(models.Model):
    """Append-only log of every write attempt on a register, accepted or not.

    ``id`` comes from a sequence taken while the register row is locked by the accepted write,
    so accepted attempts appear in the order their writes took effect.
    """

    id = models.BigAutoField(primary_key=True)
    register = models.CharField(max_length=255, db_index=True)
    writer = models.CharField(max_length=255)
    token = models.BigIntegerField(null=True)
    accepted = models.BooleanField()
    #: "accepted", "stale" (the fence refused) or "lost" (the lease knew it was lost first).
    outcome = models.CharField(max_length=16)
    stored = models.BigIntegerField(null=True)
    #: What the writer tried to put in the register (unique per attempt).
    value = models.CharField(max_length=255)
    at = models.DateTimeField()

    objects: models.Manager[RegisterLog] = models.Manager()

    class Meta:
        app_label = "testapp"
        ordering = ["id"]

    def __str__(self) -> str:
        return f"#{self.id} {self.register}: {self.writer} token {self.token} {self.outcome}"


class FencedDoc(FencedModel):
    """A fenced model with an auto primary key and an auto_now field."""

    title = models.CharField(max_length=100, default="")
    body = models.TextField(default="")
    edited_at = models.DateTimeField(auto_now=True)

    class Meta:
        app_label = "testapp"


class DocNote(models.Model):
    """Rows of a multi-valued relation of :class:`FencedDoc`: filtering docs through them
    matches a doc once per note."""

    doc = models.ForeignKey(FencedDoc, on_delete=models.CASCADE, related_name="notes")
    text = models.CharField(max_length=100, default="")

    objects: models.Manager[DocNote] = models.Manager()

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return self.text


class ElsewhereDoc(FencedModel):
    """A fenced model whose table is in another schema (``db_table`` quoted the way Django
    users write it). Unmanaged: a test creates the schema and the table in its transaction."""

    title = models.CharField(max_length=100, default="")

    class Meta:
        app_label = "testapp"
        db_table = 'leases_elsewhere"."elsewhere_doc'
        managed = False


class FencedUUIDDoc(FencedModel):
    """A fenced model whose primary key has a default (Django inserts without trying UPDATE)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4)
    title = models.CharField(max_length=100, default="")

    class Meta:
        app_label = "testapp"


class FencedDocPart(FencedDoc):
    """Multi-table inheritance: the fence column lives in the parent's table."""

    part = models.CharField(max_length=100, default="")

    class Meta:
        app_label = "testapp"


class StrictDoc(FencedModel):
    """A fenced model that refuses unfenced writes to stored rows (``require_fence``)."""

    require_fence = True

    title = models.CharField(max_length=100, default="")

    class Meta:
        app_label = "testapp"


class ColumnDoc(FencedModel):
    """A fenced model whose token column is named otherwise, with a primary key of its own
    (so a fenced save of a new row upserts)."""

    name = models.CharField(max_length=50, primary_key=True)
    fencing_token = models.BigIntegerField(default=0, editable=False, db_column="fence_tok")
    value = models.CharField(max_length=50, default="")

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return self.name


class StrictBaseManaged(FencedModel):
    """``require_fence`` with its ``FencedManager`` as the base manager too (so Django's related
    managers, which write through the base manager, are fenced as well)."""

    require_fence = True
    title = models.CharField(max_length=50, default="")
    shelf = models.ForeignKey("PlainBase", models.PROTECT, null=True, related_name="strict_rows")

    objects = FencedManager()

    class Meta:
        app_label = "testapp"
        base_manager_name = "objects"

    def __str__(self) -> str:
        return self.title


class DefaultedDoc(FencedModel):
    """A fenced model with a database default (``db_default``): Django inserts ``DEFAULT``."""

    title = models.CharField(max_length=50, default="")
    created = models.DateTimeField(db_default=Now())

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return self.title


class SavedLog(models.Model):
    """A plain model a receiver writes to while a fenced model saves, with a database default."""

    message = models.CharField(max_length=100)
    at = models.DateTimeField(db_default=Now())

    objects: models.Manager[SavedLog] = models.Manager()

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return self.message


class PlainBase(models.Model):
    """A concrete plain model that a fenced one extends: the token then lives in the child."""

    title = models.CharField(max_length=50, default="")

    objects: models.Manager[PlainBase] = models.Manager()

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return self.title


class TokenInChild(FencedModel, PlainBase):  # type: ignore[misc]  # both declare objects
    """Multi-table inheritance with the fence in the child's table, below a plain parent."""

    part = models.CharField(max_length=50, default="")

    class Meta:
        app_label = "testapp"


class CompositeDoc(FencedModel):
    """A fenced model with a composite primary key (Django 5.2): its fenced saves of new rows
    upsert on both columns."""

    pk = models.CompositePrimaryKey("tenant", "number")
    tenant = models.CharField(max_length=20)
    number = models.IntegerField()
    title = models.CharField(max_length=50, default="")

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return f"{self.tenant}/{self.number}"
