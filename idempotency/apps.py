from django.apps import AppConfig
from django.db.models.signals import pre_migrate


class IdempotencyConfig(AppConfig):
    name = "idempotency"
    verbose_name = "Idempotency keys"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from leases._migrating import refuse_unsupported_database

        from . import checks  # noqa: F401  (registers system checks)

        pre_migrate.connect(
            refuse_unsupported_database, sender=self, dispatch_uid="idempotency.refuse_database"
        )
