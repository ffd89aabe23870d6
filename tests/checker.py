"""The shared history checker: a fenced register every multi-holder lease test writes to.

Writers (threads or child processes, any backend) call :func:`record_write` with the lease (or
token) they hold. Each attempt is a fenced write of the ``FencedRegister`` row plus a row in the
append-only ``RegisterLog``, in one transaction; the log id is drawn while the accepted write
holds the register's row lock, so accepted attempts are logged in the order they took effect.
Afterwards the test calls :func:`check_history` (optionally with the tokens in grant order),
which raises ``AssertionError`` with a readable account of the first violation of:

1. accepted tokens never decrease in log order;
2. no two distinct writers were accepted with the same token;
3. every grant's token exceeds every earlier grant's (when grants are given);
4. every stale rejection is explained by an earlier accepted, greater token (the fence never
   refuses a write it should have let through);
5. the register's final row is the last accepted write, with the greatest accepted token;
6. a write refused as revoked carries a token the test revoked (``revoked=``), and once the
   resource has refused a revoked token it never accepts that token again.

:func:`check_attempts` checks 1-4 on a plain list, so the checker itself can be tested on
fabricated bad histories. From a child process: ``python -m tests.checker REGISTER WRITER
TOKEN...`` (with ``child_env``), or call :func:`record_write` after ``django.setup()``.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import DEFAULT_DB_ALIAS, models, transaction

if TYPE_CHECKING:  # importing models before django.setup() would break `python -m`
    from leases.fencing import FenceLike

__all__ = [
    "Attempt",
    "Summary",
    "check_attempts",
    "check_grants",
    "check_handover",
    "check_history",
    "history",
    "new_register",
    "record_write",
    "run_writes",
]

ACCEPTED, STALE, LOST, REVOKED = "accepted", "stale", "lost", "revoked"


class _ClockTimestamp(models.Func):
    """The database server's wall clock at the moment of the insert, not the transaction's."""

    function = "clock_timestamp"
    template = "clock_timestamp()"
    output_field = models.DateTimeField()


@dataclass(frozen=True)
class Attempt:
    """One write attempt on a register, as logged."""

    seq: int
    writer: str
    token: int | None
    accepted: bool
    outcome: str = ACCEPTED
    stored: int | None = None
    value: str = ""
    at: datetime | None = None
    register: str = ""

    def __str__(self) -> str:
        extra = f", stored {self.stored}" if self.outcome == STALE else ""
        return f"#{self.seq} {self.writer} token {self.token} {self.outcome}{extra}"


@dataclass(frozen=True)
class Summary:
    """What a history contained, for a test's own extra asserts and its failure messages."""

    attempts: int
    accepted: int
    stale: int
    lost: int
    writers: frozenset[str]
    accepted_tokens: tuple[int, ...] = field(default=())

    @property
    def highest(self) -> int | None:
        return max(self.accepted_tokens, default=None)


def new_register(prefix: str = "register") -> str:
    """A register name no other test (or earlier run) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def record_write(
    register: str, token: FenceLike, writer: str, *, using: str = DEFAULT_DB_ALIAS
) -> bool:
    """A fenced write of ``register`` with ``token`` (an int or a Lease), logged; True if accepted.

    Never raises for a stale token or a lease that already knew it was lost: both are recorded
    (outcome ``stale`` / ``lost``) and return False. Any other error propagates.
    """
    from leases.errors import FencingTokenRevoked, LeaseLost, StaleFencingToken
    from tests.testapp.models_fencing import FencedRegister, RegisterLog

    offered = token if isinstance(token, int) else getattr(token, "token", None)
    value = f"{writer}@{offered}#{uuid.uuid4().hex[:8]}"
    outcome, stored = ACCEPTED, None
    with transaction.atomic(using=using):
        try:
            FencedRegister(name=register, value=value).save(fence=token, using=using)
        except FencingTokenRevoked:
            outcome = REVOKED
        except StaleFencingToken as exc:
            outcome, stored = STALE, exc.stored
        except LeaseLost:
            outcome = LOST
        RegisterLog.objects.using(using).create(
            register=register,
            writer=writer,
            token=offered,
            accepted=outcome == ACCEPTED,
            outcome=outcome,
            stored=stored,
            value=value,
            at=_ClockTimestamp(),
        )
    return outcome == ACCEPTED


async def arecord_write(
    register: str, token: FenceLike, writer: str, *, using: str = DEFAULT_DB_ALIAS
) -> bool:
    """:func:`record_write` from async code (Django's async ORM runs it the same way)."""
    from asgiref.sync import sync_to_async

    return await sync_to_async(record_write)(register, token, writer, using=using)


def history(register: str, *, using: str = DEFAULT_DB_ALIAS) -> list[Attempt]:
    """Every logged attempt on ``register``, in log order."""
    from tests.testapp.models_fencing import RegisterLog

    rows = RegisterLog.objects.using(using).filter(register=register).order_by("id")
    return [
        Attempt(
            seq=row.id,
            writer=row.writer,
            token=row.token,
            accepted=row.accepted,
            outcome=row.outcome,
            stored=row.stored,
            value=row.value,
            at=row.at,
            register=row.register,
        )
        for row in rows
    ]


def check_grants(grants: Sequence[int]) -> None:
    """Every grant's token exceeds every earlier grant's (tokens listed in grant order)."""
    highest: int | None = None
    for index, token in enumerate(grants):
        if highest is not None and token <= highest:
            raise AssertionError(
                f"grant #{index} got token {token}, but an earlier grant already had "
                f"{highest}: tokens must strictly increase across grants. Grants in order: "
                f"{_clip(grants, index)}"
            )
        highest = token if highest is None else max(highest, token)


def check_attempts(
    attempts: Sequence[Attempt],
    grants: Sequence[int] | None = None,
    revoked: Iterable[int] = (),
) -> Summary:
    """Check invariants 1-4 and 6 on attempts in log order; raise ``AssertionError`` or
    summarise. ``revoked``: the tokens the test force-released."""
    if grants is not None:
        check_grants(grants)
    revocable = set(revoked)
    refused: set[int] = set()
    best: Attempt | None = None
    holders: dict[int, Attempt] = {}
    for index, attempt in enumerate(attempts):
        if attempt.outcome == REVOKED:
            if attempt.token not in revocable:
                raise AssertionError(
                    f"{attempt} was refused as revoked, but the test revoked only "
                    f"{sorted(revocable)}. History: {_clip(attempts, index)}"
                )
            refused.add(attempt.token)
        if attempt.accepted and attempt.token in refused:
            raise AssertionError(
                f"{attempt} was accepted after the resource had refused token {attempt.token} "
                f"as revoked. History: {_clip(attempts, index)}"
            )
        if attempt.accepted:
            assert attempt.token is not None, f"{attempt} was accepted without a token"
            if best is not None and attempt.token < (best.token or 0):
                raise AssertionError(
                    f"accepted token went backwards: {attempt} came after {best} "
                    f"(a stale holder's write got through the fence). History: "
                    f"{_clip(attempts, index)}"
                )
            first = holders.setdefault(attempt.token, attempt)
            if first.writer != attempt.writer:
                raise AssertionError(
                    f"two writers were accepted with token {attempt.token}: {first} and "
                    f"{attempt} (one token was granted to two holders). History: "
                    f"{_clip(attempts, index)}"
                )
            best = attempt
        elif attempt.outcome == STALE:
            _check_rejection(attempt, best, attempts, index)
    accepted = [a for a in attempts if a.accepted]
    return Summary(
        attempts=len(attempts),
        accepted=len(accepted),
        stale=sum(a.outcome == STALE for a in attempts),
        lost=sum(a.outcome == LOST for a in attempts),
        writers=frozenset(a.writer for a in attempts),
        accepted_tokens=tuple(a.token for a in accepted if a.token is not None),
    )


def _check_rejection(
    attempt: Attempt, best: Attempt | None, attempts: Sequence[Attempt], index: int
) -> None:
    offered = attempt.token if attempt.token is not None else 0
    if best is None or (best.token or 0) <= offered:
        raise AssertionError(
            f"{attempt} was rejected as stale, but no earlier accepted write had a greater "
            f"token (highest so far: {best}): the fence refused a valid write. History: "
            f"{_clip(attempts, index)}"
        )
    if attempt.stored is not None and attempt.stored <= offered:
        raise AssertionError(
            f"{attempt} was rejected although the stored token {attempt.stored} is not "
            f"greater than the offered {offered}. History: {_clip(attempts, index)}"
        )


def check_history(
    register: str,
    grants: Sequence[int] | None = None,
    *,
    revoked: Iterable[int] = (),
    using: str = DEFAULT_DB_ALIAS,
) -> Summary:
    """Check every invariant (module docstring) on a register's log and final row."""
    from tests.testapp.models_fencing import FencedRegister

    attempts = history(register, using=using)
    summary = check_attempts(attempts, grants, revoked)
    accepted = [a for a in attempts if a.accepted]
    row = FencedRegister.objects.using(using).filter(name=register).first()
    if not accepted:
        assert row is None or row.fencing_token == 0, (
            f"register {register!r} holds {row and row.value!r} but no write was accepted"
        )
        return summary
    last = accepted[-1]
    assert row is not None, f"register {register!r} is missing although {last} was accepted"
    if row.value != last.value or row.fencing_token != summary.highest:
        raise AssertionError(
            f"register {register!r} ends as {row.value!r} with token {row.fencing_token}, but "
            f"the last accepted write was {last} ({last.value!r}) and the highest accepted "
            f"token {summary.highest}: a write took effect outside the fenced log"
        )
    return summary


def check_handover(old: int, new: int, register: str | None = None) -> None:
    """The fence at a handover from the grant of token ``old`` to the later one of ``new``:
    both write, in that order, then the old holder's next write is rejected, and the history
    passes every check (a register of its own unless ``register`` is given)."""
    register = register or new_register("handover")
    assert new > old, (old, new)
    assert record_write(register, old, "old")
    assert record_write(register, new, "new")
    assert not record_write(register, old, "old")
    check_history(register, [old, new])


def run_writes(register: str, writer: str, tokens: Iterable[int]) -> list[bool]:
    """Write each token in turn (for a child process after ``django.setup()``)."""
    return [record_write(register, token, writer) for token in tokens]


def _clip(items: Sequence[Any], index: int, around: int = 4) -> str:
    start = max(0, index - around)
    shown = [f"{'>' if i == index else ' '}{item}" for i, item in enumerate(items)][
        start : index + around + 1
    ]
    more = "…; " if start else ""
    return "[" + more + "; ".join(s.strip() for s in shown) + "]"


def main(argv: list[str]) -> int:
    """``python -m tests.checker REGISTER WRITER TOKEN...``: print the outcomes as JSON."""
    import django

    django.setup()
    register, writer, *tokens = argv
    print(json.dumps(run_writes(register, writer, [int(t) for t in tokens])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
