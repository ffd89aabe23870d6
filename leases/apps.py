import importlib.util

from django.apps import AppConfig
from django.db.models.signals import pre_migrate


class LeasesConfig(AppConfig):
    name = "leases"
    verbose_name = "Leases and locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import _session_leaks, checks  # noqa: F401  (checks registers system checks)
        from ._migrating import refuse_unsupported_database

        _session_leaks.install()
        if importlib.util.find_spec("celery") is not None:
            from .celery._sessions import install as sweep_around_tasks

            sweep_around_tasks()
        pre_migrate.connect(
            refuse_unsupported_database, sender=self, dispatch_uid="leases.refuse_database"
        )
