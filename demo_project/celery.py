"""The demo's Celery app: ``celery -A demo_project.celery worker`` (see the README).

Broker and result backend are the demo's Redis (``CELERY_*`` in ``demo_project/settings.py``);
tasks are discovered in each installed app's ``tasks.py`` (``demo_project/shop/tasks.py``).
"""

from __future__ import annotations

import os

import django
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")
django.setup()

app = Celery("demo_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
