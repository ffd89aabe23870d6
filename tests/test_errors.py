"""Errors keep their data across process boundaries (pickle, Celery's JSON round trip)."""

from __future__ import annotations

import pickle

import pytest

from idempotency.errors import IdempotencyKeyLost, IdempotencyKeyMismatch
from leases.errors import (
    DatabaseNotSupported,
    InvalidLeaseName,
    LeaseError,
    LeaseLost,
    LeaseUnavailable,
    StaleFencingToken,
)

ERRORS = [
    LeaseUnavailable("invoice:1", 2.5, "busy"),
    LeaseLost("invoice:1", token=7),
    StaleFencingToken("shop.Invoice:1", 3, 9),
    InvalidLeaseName("", "must not be empty"),
    IdempotencyKeyMismatch("user:1", "k-1"),
    IdempotencyKeyLost("user:1", "k-2"),
    DatabaseNotSupported("default", "sqlite", "leases"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_survive_pickle_with_their_data(error: LeaseError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.__dict__ == error.__dict__


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_rebuild_from_args_as_celery_does(error: LeaseError) -> None:
    """Celery's JSON result backend stores ``exc.args`` and rebuilds with ``cls(*args)``."""
    copy = type(error)(*error.args)
    assert str(copy) == str(error)
    assert copy.__dict__ == error.__dict__


def test_message_and_attributes_are_unchanged() -> None:
    error = StaleFencingToken("r", offered=3, stored=9)
    assert (error.resource, error.offered, error.stored) == ("r", 3, 9)
    assert error.args == ("r", 3, 9)
    assert "offered 3" in str(error)


def test_a_stale_token_whose_stored_one_is_unknown_says_a_greater_one() -> None:
    """It said "offered 4, but None was already accepted" (a row the write could not read)."""
    error = StaleFencingToken("r", offered=4, stored=None)
    assert "but a greater one was already accepted" in str(error) and "None" not in str(error)
