"""Holder identities made from a prefix remembered per process and settings: never stale.

``acquire()`` makes ``[label@]host:pid:thread:random`` from a ``[label@]host:pid:`` made once
(see ``leases/holders.py``); these pin what must still change it: a fork (a new pid) and a new
``HOLDER_LABEL``. And the names remembered as valid (``leases/keys.py``) never include a
refused one.
"""

from __future__ import annotations

import os

import pytest
from django.test import override_settings

from leases.backends._redis_scripts import LeaseKeys
from leases.errors import InvalidLeaseName
from leases.holders import holder_identity, parse_holder
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
