"""The multi-step workflow every front end runs in the steps tests: charge, order row, email.

``place_order`` charges at the stand-in provider (:mod:`devservers.provider`), creates a local
``Charge`` row, then sends an email through the provider, each as a step
(:func:`idempotency.step`). A process started with ``LEASES_TEST_STEPS_PAUSE=<point>:<dir>``
stops at that point (writing ``<dir>/paused-<point>`` first) until the test SIGKILLs it:
``after-charge`` and ``after-order`` fall between steps, ``in-charge`` inside the charge step,
after the provider answered but before the step was recorded.

``python -m tests.steps_workflow ORDER`` runs it under ``idempotency_key`` (the operation front
end) and prints the result; the view and the Celery task are in ``tests/testapp`` and
``tests/celery_app``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PAUSE_ENV = "LEASES_TEST_STEPS_PAUSE"
PROVIDER_ENV = "LEASES_TEST_PROVIDER_URL"
#: How long a paused process waits for its SIGKILL (bounded, like every wait in the tests).
PAUSE_SECONDS = 120


def pause(point: str) -> None:
    spec = os.environ.get(PAUSE_ENV, "")
    wanted, _, directory = spec.partition(":")
    if wanted != point:
        return
    Path(directory, f"paused-{point}").write_text(str(os.getpid()))
    time.sleep(PAUSE_SECONDS)


def place_order(order: str, amount: int) -> dict[str, Any]:
    from devservers.provider import post
    from idempotency import step
    from tests.testapp.models_idempotency import Charge

    url = os.environ[PROVIDER_ENV]

    def charge(key: str) -> Any:
        made = post(url, "/charges", {"order": order, "amount": amount}, key)
        pause("in-charge")
        return made

    charged = step("charge", charge)
    pause("after-charge")
    row = step("order", lambda key: Charge.objects.create(key=f"order:{order}", amount=amount).pk)
    pause("after-order")
    mailed = step("email", lambda key: post(url, "/emails", {"order": order}, key))
    return {"charge": charged["id"], "order": row, "email": mailed["id"]}


def main(order: str) -> None:
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from idempotency import idempotency_key

    once = idempotency_key(f"order-{order}", scope="steps", atomic=False, lock_timeout=1, wait=30)
    with once as op:
        if not op.replayed:
            op.result = place_order(order, 500)
    print(json.dumps({"replayed": op.replayed, "result": op.result}))


if __name__ == "__main__":
    main(sys.argv[1])
