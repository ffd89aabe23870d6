"""Session locks a task left held: released and reported when the task ends, as a request's are.

A worker keeps its database connections from one task to the next (``CONN_MAX_AGE > 0``, a
pool; Celery's Django fixup closes them only when they are obsolete or broken), so a session
lock that a task entered and never exited (by hand, a suspended generator) stayed held for every
later task on that worker, and every other process waited behind a lock no code held. The sweep
of :mod:`leases._session_leaks` ran at the end of requests only; here it runs around tasks too:
``task_prerun`` notes what is held already (an eager task run inside a request or a test), and
``task_postrun`` unlocks and logs what the task took and left.

Connected by the ``leases`` app when Celery is installed, whether or not the project uses this
package's task decorators: a plain ``@shared_task`` can leak a lock just as well.
"""

from __future__ import annotations

from typing import Any

from celery import signals

from .. import _session_leaks

__all__ = ["install"]


def _task_ended(**_: Any) -> None:
    _session_leaks.release_leaked(unit="task")


def install() -> None:
    """Sweep session locks around every task this process runs."""
    signals.task_prerun.connect(
        _session_leaks.mark_start, dispatch_uid="leases.mark_session_locks_at_task_start"
    )
    signals.task_postrun.connect(
        _task_ended, dispatch_uid="leases.release_session_locks_left_by_task"
    )
