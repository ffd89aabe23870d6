"""Holder identities made from a prefix remembered per process and settings: never stale.

``acquire()`` makes ``[label@]host:pid:thread:random`` from a ``[label@]host:pid:`` made once
(see ``leases/holders.py``); these pin what must still change it: a fork (a new pid) and a new
``HOLDER_LABEL``. And the names remembered as valid (``leases/keys.py``) never include a
refused one.
"""

from __future__ import annotations

import os
import time

import pytest
from django.test import override_settings

from leases.backends._redis_scripts import LeaseKeys
from leases.errors import InvalidLeaseName, InvalidLeaseOption
from leases.holders import SHARED_HOLDER, holder_identity, parse_holder, shown_holder
from leases.keys import validate_lease_name


def test_a_forked_child_makes_identities_with_its_own_pid() -> None:
    assert parse_holder(holder_identity(None)).pid == os.getpid()  # the prefix is made
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child reports through the pipe)
        try:
            os.write(write, str(parse_holder(holder_identity(None)).pid).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        reported = pipe.read()
    os.waitpid(child, 0)
    assert int(reported) == child


def test_a_new_holder_label_is_in_the_next_identity() -> None:
    with override_settings(LEASES={"HOLDER_LABEL": "billing"}):
        assert parse_holder(holder_identity(None)).label == "billing"
    with override_settings(LEASES={"HOLDER_LABEL": "reports"}):
        assert parse_holder(holder_identity(None)).label == "reports"
    with override_settings(LEASES={}):
        assert parse_holder(holder_identity(None)).label == ""


@pytest.mark.parametrize("name", ["", "a\x00b", "x" * 256, "slot\u241f1"])
def test_a_refused_lease_name_is_refused_every_time(name: str) -> None:
    for _ in range(2):
        with pytest.raises(InvalidLeaseName):
            validate_lease_name(name)
    assert validate_lease_name("fine") == "fine" == validate_lease_name("fine")


@pytest.mark.parametrize("name", ["", "a\x00b", "x" * 256, 7])
def test_redis_keys_of_a_refused_name_are_refused_every_time(name: object) -> None:
    for _ in range(2):
        with pytest.raises(InvalidLeaseName):
            LeaseKeys.of("leases:", name)  # type: ignore[arg-type]
    assert LeaseKeys.of("leases:", "fine") is LeaseKeys.of("leases:", "fine")


def test_a_group_of_readers_is_shown_as_its_live_readers_and_nobody_can_pass_for_one() -> None:
    """The group's holder is an internal mark: operators read how many readers (those whose own
    expiry has not passed), and no holder anyone passes can equal it."""
    now = time.time()
    meta = {
        "readers": {
            "7": {"h": "r1", "e": now + 30},
            "9": {"h": "r2", "e": now + 30},
            "3": {"h": "gone", "e": now - 1},  # stopped renewing: out of the group
        }
    }
    assert shown_holder(SHARED_HOLDER, meta) == "shared (2 readers)"
    assert shown_holder(SHARED_HOLDER, meta, named=True) == "shared (2 readers: r1, r2)"
    assert shown_holder(SHARED_HOLDER, {}) == "shared (readers)"  # a store that lists none
    assert shown_holder("worker:1:2", meta) == "worker:1:2" and shown_holder("", meta) == ""
    with pytest.raises(InvalidLeaseOption):
        holder_identity(SHARED_HOLDER)
