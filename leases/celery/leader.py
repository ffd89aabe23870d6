"""Leader-only periodic tasks: several beat processes, one of which sends each tick."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar

from celery.result import EagerResult

from .. import conf
from ..election import Leadership, elect, leader_of
from ..errors import InvalidLeaseName, InvalidLeaseOption, LeaseUnavailable
from ..keys import validate_name
from ._base import SKIPPED, skip
from ._checks import Check, CheckedTask, valid_alias, valid_ttl_or_default

__all__ = ["LEADER_HEADER", "LeaderOnlyTask", "resign_leaderships"]

logger = logging.getLogger(__name__)

#: Message header carrying the sender's leadership token to the worker.
LEADER_HEADER = "leases_leader_token"


def _valid_election(option: str, name: object) -> None:
    """``None`` (the task's name) or a lease name; a bad one would make every send fail in
    beat and every run fail in the worker. One name, not a template: the election is the
    task's, whatever its arguments."""
    if name is None:
        return
    try:
        election = validate_name(name)
    except InvalidLeaseName as exc:
        raise InvalidLeaseName(exc.name, f"{exc.reason} (given as {option})") from None
    if "{" in election or "}" in election:
        reason = "names one election for the task, not a template of its arguments"
        raise InvalidLeaseOption(option, name, reason)


class LeaderOnlyTask(CheckedTask):
    """A periodic task sent only by the leader of ``leader_name``, and run only if it still leads.

    Run several ``celery beat`` processes for availability: each one's :meth:`apply_async`
    campaigns for the election ``leader_name`` (:func:`leases.elect`, one try per call; a won
    leadership is kept alive across calls), and only the leader sends, stamping its fencing
    token on the message. The worker runs the body only while that token is still the leader's
    (:func:`leases.leader_of`), so a beat that was paused past its lease and wakes up cannot get
    a stale tick through. A call from a non-leader sends nothing and returns a result in state
    :data:`~leases.celery.SKIPPED`. Beat must import the task (it does when the task is
    registered in its app); a message without the leader's token (sent by name, by
    ``send_task``, or run with ``apply()``) is skipped on the worker, never run unchecked.
    """

    leader_name: ClassVar[str | None] = None
    leader_ttl: ClassVar[float | None] = None
    leader_backend: ClassVar[str] = "default"

    _option_checks: ClassVar[Mapping[str, Check]] = {
        "leader_name": _valid_election,
        "leader_ttl": valid_ttl_or_default,
        "leader_backend": valid_alias,
    }

    def election(self) -> str:
        """Hook: the election's name (default: the task name)."""
        return validate_name(self.leader_name or str(self.name))

    def leadership_token(self) -> int | None:
        """Hook: this process's leadership token, campaigning once if it does not lead."""
        ttl = self.leader_ttl if self.leader_ttl is not None else conf.get().default_ttl
        return _campaign(self.election(), ttl, self.leader_backend)

    def still_leads(self, token: int) -> bool:
        """Hook: whether ``token`` is still the current leader's (checked before the body)."""
        leader = leader_of(self.election(), backend=self.leader_backend)
        return leader is not None and leader.token == token

    def apply_async(  # type: ignore[override]  # options pass through to Celery unchanged
        self, args: Any = None, kwargs: Any = None, **options: Any
    ) -> Any:
        if options.get("task_id") and options["task_id"] == self.request.id:
            return super().apply_async(args, kwargs, **options)  # retry(): keeps its header
        token = self.leadership_token()
        if token is None:
            logger.debug("%s not sent: this process does not lead %r", self.name, self.election())
            return EagerResult(options.get("task_id") or str(uuid.uuid4()), None, SKIPPED)
        headers = {**(options.pop("headers", None) or {}), LEADER_HEADER: token}
        return super().apply_async(args, kwargs, headers=headers, **options)

    @property
    def sent_by(self) -> int | None:
        """The leadership token the current run's message was sent under (fence with it);
        ``None`` when the message carries none, or something that is not a token (0, text)."""
        request = self.request
        headers = request.headers or {}
        raw = headers.get(LEADER_HEADER)
        if raw is None:
            raw = getattr(request, LEADER_HEADER, None)
        if isinstance(raw, bool):
            return None
        try:
            token = int(raw) if isinstance(raw, int | str) else None
        except ValueError:
            return None
        return token if token is not None and token >= 1 else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body only for a message the current leader sent.

        A message without a valid token (``send_task``, a beat that sends by name without
        importing the task, ``apply()``) cannot show it came from the leader, so it is skipped
        like a former leader's, not run unchecked. Calling the task object directly
        (``task(...)``, plain Python in this process) is not a message and runs.
        """
        if self.request.called_directly:
            return super().__call__(*args, **kwargs)
        token = self.sent_by
        if token is None:
            skip(
                self,
                f"sent without a leadership token of {self.election()!r} (send_task, a beat "
                "sending by name, or apply()); only the leader's apply_async stamps one",
            )
        elif not self.still_leads(token):
            skip(self, f"sent by a former leader of {self.election()!r} (token {token})")
        return super().__call__(*args, **kwargs)


#: Leaderships this process won, by (backend, election), kept until lost.
_won: dict[tuple[str, str], Leadership] = {}
_won_lock = threading.Lock()
_won_pid = os.getpid()


def _campaign(name: str, ttl: float, backend: str) -> int | None:
    """This process's leadership token for ``name``: kept if held, else one try to win it."""
    global _won_pid
    with _won_lock:
        if os.getpid() != _won_pid:  # a forked child leads nothing its parent won
            _won.clear()
            _won_pid = os.getpid()
        held = _won.get((backend, name))
        if held is not None and held.is_leader:
            return held.token
        try:
            held = _won[(backend, name)] = elect(name, ttl=ttl, backend=backend, timeout=0)
        except LeaseUnavailable:
            _won.pop((backend, name), None)
            return None
        return held.token


def resign_leaderships() -> None:
    """Resign every leadership this process won, so another beat takes over at once.

    Call it when a beat process shuts down cleanly; without it the others wait for the TTL.
    """
    with _won_lock:
        won = list(_won.values())
        _won.clear()
    for leadership in won:
        leadership.resign()
