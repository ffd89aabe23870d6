from django.apps import AppConfig


class LeasesConfig(AppConfig):
    name = "leases"
    verbose_name = "Leases and locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import _session_leaks, checks  # noqa: F401  (checks registers system checks)

        _session_leaks.install()
