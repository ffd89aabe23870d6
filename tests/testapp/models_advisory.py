"""A read-modify-write counter: the resource the advisory lock tests protect."""

from __future__ import annotations

from typing import ClassVar

from django.db import models


class AdvisoryCounter(models.Model):
    """One row per test; workers read ``value``, pause, and write ``value + 1``."""

    name = models.CharField(max_length=100, primary_key=True)
    value = models.IntegerField(default=0)

    # The default manager Django adds: django-stubs' plugin reads the demo settings, which lack
    # this test app, so it does not declare it.
    objects: ClassVar[models.Manager[AdvisoryCounter]]

    class Meta:
        app_label = "testapp"

    def __str__(self) -> str:
        return f"{self.name}={self.value}"
