"""Name validation and the advisory key derivation, which must never change."""

from __future__ import annotations

import pytest

from leases.errors import InvalidLeaseName, LeaseError
from leases.keys import advisory_key, split_key, validate_name


# Fixed forever: changing the derivation would make two releases disagree about which lock a
# name means, so both could "hold" it at once during a rolling deploy.
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a", 4681665781835383343),
        ("invoice:42", -7099691206216812777),
        ("ünïcode-名前", -1751278159774971243),
        ("x" * 255, 5288191385976786306),
    ],
)
def test_key_derivation_vectors_never_change(name: str, expected: int) -> None:
    assert advisory_key(name) == expected


def test_explicit_keys_pass_through() -> None:
    assert advisory_key(42) == 42
    assert advisory_key(-(2**63)) == -(2**63)
    assert advisory_key((1, -2)) == (1, -2)


@pytest.mark.parametrize(
    "bad", ["", "x" * 256, "a\x00b", None, b"bytes", 2**63, -(2**63) - 1, (1,), (2**31, 0), True]
)
def test_bad_names_raise_a_typed_error(bad: object) -> None:
    with pytest.raises(InvalidLeaseName) as info:
        advisory_key(bad)  # type: ignore[arg-type]
    assert isinstance(info.value, LeaseError)
    assert isinstance(info.value, ValueError)


def test_validate_name_accepts_the_longest_name() -> None:
    assert validate_name("n" * 255) == "n" * 255


def test_split_key_matches_pg_locks_classid_objid() -> None:
    assert split_key(1) == (0, 1)
    assert split_key(-1) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert split_key(2**32 + 5) == (1, 5)
