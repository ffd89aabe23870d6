"""Models used only by tests. This app has no migrations: pytest-django creates its tables.

Each feature's test models live in their own module (``models_<feature>.py``) re-exported here,
so features can add models without editing each other's code.
"""

from . import (
    models_advisory,  # noqa: F401  (advisory lock counter)
    models_celery,  # noqa: F401  (what real Celery workers ran, on the DB clock)
    models_fencing,  # noqa: F401  (fencing and the shared history checker)
    models_idempotency,  # noqa: F401  (idempotent views' side effects)
)
