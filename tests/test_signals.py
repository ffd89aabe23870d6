"""One helper sends every signal: a raising receiver is logged and never breaks the caller."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from leases import StaleFencingToken, signals
from leases.election import elect
from tests.testapp.models_fencing import FencedDoc


def broken_receiver(**kwargs: Any) -> None:
    raise RuntimeError("a receiver's own bug")


@pytest.mark.django_db
@pytest.mark.parametrize("signal", [signals.fence_rejected, signals.leader_elected])
def test_a_raising_receiver_is_logged_and_the_caller_goes_on(
    signal: Any, caplog: pytest.LogCaptureFixture
) -> None:
    signal.connect(broken_receiver)
    try:
        with caplog.at_level(logging.ERROR, logger="leases"):
            if signal is signals.fence_rejected:
                doc = FencedDoc(title="t")
                doc.save(fence=5)
                with pytest.raises(StaleFencingToken):  # not the receiver's RuntimeError
                    doc.save(fence=4)
            else:
                leadership = elect("signals-test-election", ttl=5, timeout=5)
                leadership.resign()
    finally:
        signal.disconnect(broken_receiver)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert any("a receiver of a django-leases signal raised" in r.getMessage() for r in errors)
    assert any(r.exc_info and "a receiver's own bug" in str(r.exc_info[1]) for r in errors)
