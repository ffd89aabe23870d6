"""The shared history checker fails on bad histories and passes on good ones."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.checker import (
    LOST,
    STALE,
    Attempt,
    check_attempts,
    check_grants,
    check_history,
    history,
    new_register,
    record_write,
)
from tests.testapp.models_fencing import FencedRegister


def ok(seq: int, writer: str, token: int) -> Attempt:
    return Attempt(seq=seq, writer=writer, token=token, accepted=True)


def stale(seq: int, writer: str, token: int, stored: int | None = None) -> Attempt:
    return Attempt(
        seq=seq, writer=writer, token=token, accepted=False, outcome=STALE, stored=stored
    )


def test_good_history_passes() -> None:
    summary = check_attempts(
        [ok(1, "a", 1), ok(2, "a", 1), stale(3, "b", 0, stored=1), ok(4, "c", 3), ok(5, "d", 7)],
        grants=[1, 2, 3, 7],
    )
    assert summary.accepted == 4
    assert summary.stale == 1
    assert summary.highest == 7
    assert summary.writers == {"a", "b", "c", "d"}


def test_empty_history_passes() -> None:
    assert check_attempts([]).attempts == 0


def test_decreasing_accepted_token_fails() -> None:
    with pytest.raises(AssertionError, match="went backwards") as info:
        check_attempts([ok(1, "a", 2), ok(2, "b", 5), ok(3, "a", 2)])
    assert "#3 a token 2" in str(info.value)


def test_same_token_for_two_writers_fails() -> None:
    with pytest.raises(AssertionError, match="two writers were accepted with token 4"):
        check_attempts([ok(1, "a", 3), ok(2, "a", 4), ok(3, "b", 4)])


def test_same_writer_repeating_its_token_passes() -> None:
    check_attempts([ok(1, "a", 4), ok(2, "a", 4), ok(3, "a", 4)])


@pytest.mark.parametrize("grants", [[1, 2, 2], [1, 3, 2], [5, 1]])
def test_non_increasing_grants_fail(grants: list[int]) -> None:
    with pytest.raises(AssertionError, match="strictly increase across grants"):
        check_grants(grants)
    with pytest.raises(AssertionError):
        check_attempts([], grants=grants)


def test_unexplained_rejection_fails() -> None:
    with pytest.raises(AssertionError, match="refused a valid write"):
        check_attempts([ok(1, "a", 2), stale(2, "b", 3, stored=2)])
    with pytest.raises(AssertionError, match="refused a valid write"):
        check_attempts([stale(1, "b", 3)])


def test_lost_attempts_are_counted_not_judged() -> None:
    lost = Attempt(seq=2, writer="b", token=1, accepted=False, outcome=LOST)
    assert check_attempts([ok(1, "a", 2), lost]).lost == 1


@pytest.mark.django_db(transaction=True)
def test_record_write_logs_accepted_and_stale_writes() -> None:
    register = new_register()
    assert record_write(register, 3, "a")
    assert record_write(register, 3, "a")
    assert not record_write(register, 2, "b")
    assert record_write(register, 9, "c")
    attempts = history(register)
    assert [(a.writer, a.token, a.outcome) for a in attempts] == [
        ("a", 3, "accepted"),
        ("a", 3, "accepted"),
        ("b", 2, "stale"),
        ("c", 9, "accepted"),
    ]
    assert attempts[2].stored == 3
    summary = check_history(register, grants=[3, 9])
    assert summary.highest == 9


@pytest.mark.django_db(transaction=True)
def test_record_write_inside_a_rolled_back_transaction_leaves_nothing() -> None:
    from django.db import transaction

    register = new_register()
    with transaction.atomic():
        record_write(register, 5, "a")
        transaction.set_rollback(True)
    assert history(register) == []
    check_history(register)


@pytest.mark.django_db(transaction=True)
def test_check_history_catches_a_write_outside_the_fence() -> None:
    register = new_register()
    record_write(register, 4, "a")
    FencedRegister.objects.filter(name=register).update(value="sneaky", fencing_token=2)
    with pytest.raises(AssertionError, match="outside the fenced log"):
        check_history(register)


def test_child_process_helper_records_writes(child_env: dict[str, str], python: str) -> None:
    register = new_register()
    out = subprocess.run(
        [python, "-m", "tests.checker", register, "child", "2", "1", "2", "5"],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False, True, True]
    summary = check_history(register)
    assert summary.accepted_tokens == (2, 2, 5)


def test_checker_catches_a_revoked_token_accepted_after_its_refusal() -> None:
    attempts = [
        Attempt(1, "a", 1, True),
        Attempt(2, "a", 1, False, outcome="revoked"),
        Attempt(3, "a", 1, True),
    ]
    with pytest.raises(AssertionError, match="after the resource had refused token 1"):
        check_attempts(attempts, revoked=[1])
    with pytest.raises(AssertionError, match="the test revoked only"):
        check_attempts(attempts[:2])
    assert check_attempts(attempts[:2], revoked=[1]).accepted == 1
