"""Every configured backend asked at once, each for at most a bound: what operators' views read.

An operator opens the every-backend page in the middle of an incident, when a store is most
likely down. Asked one after the other, an unreachable etcd or ZooKeeper cluster costs its
connect and request timeouts (for each member) before the next backend is even asked, and two
of them add up. Asked at once, a view waits for the slowest answer or the bound, whichever comes
first, and a backend that did not answer in time is reported unreachable
(:class:`~leases.errors.BackendUnavailable`), beside the answers of the others.

The calls run on one pool of threads per process, never a pool per call. A backend still busy
with the same question from an earlier view is not asked again: the view waits for that call,
so reloading a page during an outage cannot pile up threads stuck on the same dead store (nor
leave healthy backends queued behind them).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from django.db import connections

from . import conf
from .backends import get_backend
from .backends.base import LeaseBackend
from .errors import BackendUnavailable, LeaseError

__all__ = ["ANSWER_BOUND", "ask_every_backend"]

T = TypeVar("T")

#: Seconds a view waits for each backend's answer (all are asked at once, so this is about what
#: the whole view waits for a store that does not answer).
ANSWER_BOUND = 5.0

#: Enough for every backend of a deployment at once; a call stuck on a dead store holds its
#: thread only until the backend's own timeouts end it (every wait is bounded).
_WORKERS = 16

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
#: The calls still running, by (backend, question): asked again, they are waited for instead.
_running: dict[tuple[LeaseBackend, Hashable], Future[Any]] = {}


def _executor() -> ThreadPoolExecutor:
    """This process's pool (made again in a forked child, which has none of the threads)."""
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():
        _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="leases-ask")
        _pool_pid = os.getpid()
        _running.clear()
    return _pool


def _answer(backend: LeaseBackend, question: Callable[[LeaseBackend], object]) -> object:
    try:
        return question(backend)
    finally:
        # A backend may use Django's connections: a pool thread never ends to close its own.
        connections.close_all()


def _submit(
    backend: LeaseBackend, key: Hashable, question: Callable[[LeaseBackend], Any]
) -> Future[Any]:
    with _lock:
        pool = _executor()
        running = _running.get((backend, key))
        if running is not None:
            return running
        future = pool.submit(_answer, backend, question)
        _running[backend, key] = future

    def done(finished: Future[Any]) -> None:
        with _lock:
            if _running.get((backend, key)) is finished:
                del _running[backend, key]

    future.add_done_callback(done)
    return future


def ask_every_backend(
    key: Hashable, question: Callable[[LeaseBackend], T], bound: float = ANSWER_BOUND
) -> tuple[dict[str, T], dict[str, LeaseError | NotImplementedError]]:
    """``question(backend)`` of every configured backend at once: the answers, and the error
    of each backend that failed or did not answer within ``bound`` seconds, by alias.

    ``key`` names the question (with its arguments) for the calls still running from an
    earlier view. An error other than a :class:`~leases.errors.LeaseError` or
    ``NotImplementedError`` is a bug, and raised here.
    """
    errors: dict[str, LeaseError | NotImplementedError] = {}
    futures: dict[str, Future[Any]] = {}
    for alias in conf.get().backends:
        try:
            backend = get_backend(alias)
        except LeaseError as refused:
            errors[alias] = refused
            continue
        futures[alias] = _submit(backend, key, question)
    wait(futures.values(), timeout=bound)
    answers: dict[str, T] = {}
    for alias, future in futures.items():
        if not future.done():
            errors[alias] = BackendUnavailable(alias, f"unreachable: no answer within {bound:g}s")
            continue
        failure = future.exception()
        if isinstance(failure, LeaseError | NotImplementedError):
            errors[alias] = failure
        elif failure is not None:
            raise failure
        else:
            answers[alias] = future.result()
    return answers, errors
