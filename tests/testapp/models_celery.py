"""Test models for the Celery integration: what real worker processes did, on the DB clock."""

from __future__ import annotations

from django.db import models


class TaskRun(models.Model):
    """One run of a test task's body: who ran it, with which token, from when to when.

    Times come from the database's ``clock_timestamp()``, so runs in different worker
    processes are compared on one clock.
    """

    id = models.BigAutoField(primary_key=True)
    label = models.CharField(max_length=255, db_index=True)
    task_id = models.CharField(max_length=255)
    worker = models.CharField(max_length=255)
    #: The process that sent the message (``name:pid``, stamped on publish), for beat ticks.
    sender = models.CharField(max_length=255, default="")
    token = models.BigIntegerField(null=True)
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True)

    objects: models.Manager[TaskRun] = models.Manager()

    class Meta:
        app_label = "testapp"
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.label} {self.task_id[:8]} on {self.worker} token {self.token}"


class Delivery(models.Model):
    """One delivery of a test task to a worker (``task_prerun``), before any lease or key."""

    id = models.BigAutoField(primary_key=True)
    task_id = models.CharField(max_length=255, db_index=True)
    task = models.CharField(max_length=255)
    worker = models.CharField(max_length=255)
    at = models.DateTimeField()
    #: When the worker was done with this copy (``task_postrun``), whatever its outcome.
    finished_at = models.DateTimeField(null=True)

    objects: models.Manager[Delivery] = models.Manager()

    class Meta:
        app_label = "testapp"
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.task} {self.task_id[:8]} to {self.worker} at {self.at}"


class Effect(models.Model):
    """A counter a task increments: the effect that must be applied exactly once."""

    name = models.CharField(max_length=255, primary_key=True)
    count = models.IntegerField(default=0)

    objects: models.Manager[Effect] = models.Manager()

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return f"{self.name} = {self.count}"
