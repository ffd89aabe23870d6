from django.apps import AppConfig


class PaymentsConfig(AppConfig):
    name = "demo_project.payments"
    label = "payments"
    verbose_name = "Demo payments (idempotency keys)"
    default_auto_field = "django.db.models.BigAutoField"
