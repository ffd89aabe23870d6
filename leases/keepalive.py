"""Background renewal of leases, and loss detection that never depends on the store answering.

Two kinds of thread, each shared, none created per lease (creating a thread per acquire would
cost more than the acquire's round trip in hot paths, the churn pottery suffers from):

- one **renewer** per backend alias renews every kept-alive lease of that alias at
  ``RENEW_FRACTION`` of its TTL, retrying failures with full jitter inside the validity left;
  a store that hangs stalls only its own alias's renewer (a lease reaches it when its first
  renewal is due, handed over by the watchdog: most hot-path leases are released long before,
  and never cost the renewer anything, see :func:`watch`);
- one **watchdog** per process declares a lease lost the moment its pessimistic validity runs
  out without a renewal, even while the renewer is stuck in a call to an unreachable store.

So loss is never silent: either a renewal is refused (the renewer marks the loss at once, and a
short-lived thread reports it once a bounded database read has said whether an operator revoked
the grant: the renewer never waits on that database) or time runs out (the watchdog reports
it); ``lost`` is set, ``on_lost`` called, ``lease_lost`` sent and a line logged, once. Both
threads catch and log everything.

**Async leases use the same threads**, not an asyncio task per loop. A task renews only when
its loop gets round to it: a loop blocked by one slow synchronous call (a ``time.sleep``, a
sync ORM query, a CPU-bound view) would stop renewing every lease it holds and lose them all,
and a watchdog task on that loop could not even report the loss until the loop woke. The
renewer thread keeps renewing while the loop is blocked, and the watchdog thread sets ``lost``
on time whatever the loop does; ``ensure_held()`` compares the monotonic clock with the
validity itself, so the first check after a blocked stretch fails if the lease ran out
(``tests/test_lease_async.py`` blocks a loop past the validity to prove both). The cost: the
renewer uses the backend's blocking client, one shared thread per backend as for sync leases,
never a thread per lease; the acquire, ``arenew`` and ``arelease`` round trips are async.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

from .backends import Grant
from .errors import LeaseLost
from .retry import SYSTEM_CLOCK, Backoff, Clock

__all__ = ["Job", "Kept", "PackageThread", "Scheduler", "call_on_lost", "keep_alive", "watch"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class PackageThread(threading.Thread):
    """A thread of the package's own (the watchdog, a renewer, a loss's report): no caller of
    the user's is on its stack, so what a callback raises there has nobody to reach."""


def call_on_lost(callback: Callable[[T], object], subject: T, what: str) -> BaseException | None:
    """Run a user's ``on_lost(subject)`` (``what`` names whose, for the log); what it raises
    is logged, never lost.

    ``sys.exit()`` (or a ``KeyboardInterrupt``) there asks to stop the process. On the thread
    whose own call found the loss (``ensure_held()``, ``renew()``, ``release()``) it is
    returned, for the caller to raise once the loss is reported (``lost`` set, signals sent),
    as it would be raised by any code of theirs. On a :class:`PackageThread` it can stop
    nothing (a ``SystemExit`` ends only the thread it is raised on, and this one must go on
    watching every other lease): it is logged as an error that says so, never taken for a
    mere bug of the callback's."""
    try:
        callback(subject)
    except Exception:
        logger.exception("leases: on_lost callback of %s raised", what)
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: a request to stop
        thread = threading.current_thread()
        if not isinstance(thread, PackageThread):
            return exc
        logger.error(
            "leases: on_lost callback of %s raised %s on the package's %s thread, where it "
            "cannot stop the process: the process goes on. To stop it when a lease is lost, "
            "wait for `lost` on the main thread, or signal the process from on_lost "
            "(os.kill(os.getpid(), signal.SIGTERM))",
            what,
            _stop_request(exc),
            thread.name,
            exc_info=exc,
        )
    return None


def _stop_request(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}) (sys.exit())"
    return type(exc).__name__


class Kept(Protocol):
    """What keepalive needs of a held lease (:class:`leases.handle.Lease` is one).

    A protocol rather than an import, so the handle can start its own keepalive without the
    two modules importing each other.
    """

    name: str
    token: int
    backend: str
    grant: Grant
    valid_until: float
    clock: Clock
    #: Bumped to retire the lease's current keepalive jobs (see :func:`rewatch`).
    _keep_gen: int

    @property
    def done(self) -> bool: ...

    def remaining(self) -> float: ...

    def _renew_kept(self) -> Grant: ...

    def _mark_lost(self, reason: str) -> None: ...


class Job(Protocol):
    """Runs when due and returns when it wants to run next (``None``: never again)."""

    def __call__(self) -> float | None: ...

    def finished(self) -> bool:
        """True once the job has nothing left to do (its lease was released or lost)."""
        ...


class Scheduler:
    """One daemon thread running jobs at monotonic times, started on first use.

    Released leases leave their entries behind (removing from a heap is O(n)); the heap is
    pruned of finished jobs whenever it doubles, so memory stays proportional to the leases
    actually held, however fast leases come and go. The thread is woken only when a new job
    is due before the one it is already waiting for, so a hot acquire/release loop does not
    pay a context switch per lease.
    """

    def __init__(self, name: str, clock: Clock = SYSTEM_CLOCK) -> None:
        self.name = name
        self.clock = clock
        # A plain lock under the condition: ``schedule`` (on every acquire) takes it directly.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, Job]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._prune_at = _MIN_PRUNE

    def schedule(self, due: float, job: Job) -> None:
        with self._lock:
            wake = not self._heap or due < self._heap[0][0]
            heapq.heappush(self._heap, (due, next(self._seq), job))
            if len(self._heap) >= self._prune_at:
                self._heap = [entry for entry in self._heap if not entry[2].finished()]
                heapq.heapify(self._heap)
                self._prune_at = max(_MIN_PRUNE, 2 * len(self._heap))
            if self._thread is None:
                self._thread = PackageThread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            if wake:
                self._cond.notify()

    def __len__(self) -> int:
        with self._cond:
            return len(self._heap)

    def _next_job(self) -> Job:
        """The next job due, waiting for it.

        Finished jobs at the top due within :data:`_DROP_AHEAD` are dropped when the thread
        looks, not run one by one at their due times: a sustained hot loop of short leases
        would otherwise wake the thread once per lease it took, a ``RENEW_FRACTION`` of a TTL
        later, each time taking the GIL from the threads doing the work. Only so far ahead:
        a heap emptied of every finished job would make each new lease's ``schedule`` wake
        the thread again (it waits without a deadline on an empty heap).
        """
        with self._cond:
            while True:
                heap = self._heap
                now = self.clock.monotonic()
                while heap and heap[0][0] <= now + _DROP_AHEAD and heap[0][2].finished():
                    heapq.heappop(heap)
                if heap and heap[0][0] <= now:
                    return heapq.heappop(heap)[2]
                self._cond.wait(heap[0][0] - now if heap else None)

    def _loop(self) -> None:
        while True:
            job = self._next_job()
            try:
                due = job()
            except BaseException:  # a job must never take the thread down with it (an
                # on_lost calling sys.exit() ended the watchdog: no loss was reported again)
                logger.exception("leases: %s job failed; it will not run again", self.name)
                continue
            if due is not None:
                self.schedule(due, job)


_MIN_PRUNE = 256
#: How far ahead of now the threads drop finished jobs in one look (see ``_next_job``).
_DROP_AHEAD = 0.1
_lock = threading.Lock()
_watchdog: Scheduler | None = None
_renewers: dict[str, Scheduler] = {}


def _scheduler(alias: str | None) -> Scheduler:
    """The watchdog (``alias`` None) or the alias's renewer, made on first use.

    Every acquire needs one; once it exists it is read without the lock or this call
    (:func:`watch` and :func:`keep_alive` read it first and call this only when it is not).
    """
    global _watchdog
    with _lock:
        if alias is None:
            if _watchdog is None:
                _watchdog = Scheduler("leases-watchdog")
            return _watchdog
        if alias not in _renewers:
            _renewers[alias] = Scheduler(f"leases-renew-{alias}")
        return _renewers[alias]


def _forget_after_fork() -> None:
    """Threads do not survive fork; the child starts its own schedulers when it needs them."""
    global _watchdog, _lock
    _lock = threading.Lock()
    _watchdog = None
    _renewers.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def watch(lease: Kept, renew_fraction: float | None = None) -> None:
    """Declare ``lease`` lost when its validity runs out without a renewal and, with
    ``renew_fraction``, keep it alive (:func:`keep_alive`) from when its first renewal is due.

    Handing a lease to its alias's renewer only then, from the watchdog's own entry for it,
    saves every lease released before its first renewal (the hot path: a lock, a heap push and
    a job object on the acquiring thread, about 3 µs of a 250 µs async acquire + release) and
    costs the leases that live that long one more hand-off between the two threads, neither of
    which waits on a store."""
    watchdog = _watchdog if _watchdog is not None else _scheduler(None)  # no ``or``: __len__
    due = lease.valid_until
    if renew_fraction is not None:
        due = min(due, lease.grant.sent_at + lease.grant.ttl * renew_fraction)
    watchdog.schedule(due, _Watch(lease, renew_fraction))


def rewatch(lease: Kept, renew_fraction: float | None = None) -> None:
    """Retire ``lease``'s current watchdog and renewer jobs and watch it anew, from its grant
    as it is now: after a renewal to another TTL (the jobs were due by the old one: a shorter
    TTL was renewed late, or lost, and reported late), or once a release whose outcome is
    unknown leaves it held (the jobs had seen it released and dropped out)."""
    lease._keep_gen += 1
    watch(lease, renew_fraction)


class _Watch:
    """The watchdog's job for one lease, finished once it is released or lost (a class with
    slots rather than a closure: one is made on every acquire). While ``fraction`` is set it
    has yet to hand the lease to its renewer (see :func:`watch`)."""

    __slots__ = ("fraction", "gen", "lease")

    def __init__(self, lease: Kept, fraction: float | None = None) -> None:
        self.lease = lease
        self.fraction = fraction
        self.gen = lease._keep_gen

    def __call__(self) -> float | None:
        lease = self.lease
        if lease.done or self.gen != lease._keep_gen:
            return None
        if self.fraction is not None:  # its first renewal is due: the renewer takes it over
            fraction, self.fraction = self.fraction, None
            keep_alive(lease, fraction, self.gen)
        deadline = lease.valid_until
        if lease.clock.monotonic() < deadline:
            return deadline  # renewed meanwhile: look again at the new deadline
        lease._mark_lost("expired: not renewed before its validity ran out")
        return None

    def finished(self) -> bool:
        return self.lease.done or self.gen != self.lease._keep_gen


def keep_alive(lease: Kept, fraction: float, gen: int | None = None) -> None:
    """Renew ``lease`` every ``fraction`` of its TTL until it is released or lost (or its
    jobs of generation ``gen``, default the current one, are retired: :func:`rewatch`)."""
    due = lease.grant.sent_at + lease.grant.ttl * fraction
    renewer = _renewers.get(lease.backend)
    if renewer is None:
        renewer = _scheduler(lease.backend)
    renewer.schedule(due, _Renewal(lease, fraction, lease._keep_gen if gen is None else gen))


class _Renewal:
    """One lease's renewals, and the backoff of its current run of failures (if any): the
    renewer's job for that lease, finished once it is released or lost.

    A failed renewal is retried with full jitter, and only while the lease is still valid: past
    the validity there is nothing left to save, and the watchdog reports the loss.
    """

    __slots__ = ("failures", "fraction", "gen", "lease")

    def __init__(self, lease: Kept, fraction: float, gen: int) -> None:
        self.lease = lease
        self.fraction = fraction
        self.gen = gen
        self.failures: Backoff | None = None

    def __call__(self) -> float | None:
        return None if self.finished() else self.step()

    def finished(self) -> bool:
        return self.lease.done or self.gen != self.lease._keep_gen

    def step(self) -> float | None:
        """Renew once; when the next step is due (``None``: stop)."""
        try:
            grant = self.lease._renew_kept()
        except LeaseLost:
            return None  # renew() already reported the loss
        except Exception as exc:
            return self._retry_after(exc)
        self.failures = None
        return grant.sent_at + grant.ttl * self.fraction

    def _retry_after(self, exc: Exception) -> float | None:
        lease = self.lease
        left = max(0.0, lease.valid_until - lease.clock.monotonic())  # doubted or not
        if self.failures is None:
            self.failures = Backoff(
                base=max(0.005, left / 20),
                cap=max(0.01, left / 4),
                deadline=lease.valid_until,
                clock=lease.clock,
            )
        delay = self.failures.next_delay()
        if delay is None:
            return None
        logger.warning(
            "leases: renewing %r (token %s) failed: %s; retrying in %.3fs, %.3fs of validity left",
            lease.name,
            lease.token,
            exc,
            delay,
            left,
            extra={
                "event": "renew_failed",
                "lease": lease.name,
                "token": lease.token,
                "backend": lease.backend,
                "reason": str(exc),
                "retry_in": delay,
                "remaining": left,
            },
        )
        return lease.clock.monotonic() + delay
