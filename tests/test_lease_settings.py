"""``LEASES["MAX_TTL"]`` and ``HOLDER_LABEL`` are validated with the rest of the setting."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from leases import conf


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"MAX_TTL": 0}, "MAX_TTL"),
        ({"MAX_TTL": -1}, "MAX_TTL"),
        ({"MAX_TTL": "1"}, "MAX_TTL"),
        ({"MAX_TTL": 1e12}, "ten years"),
        ({"MAX_TTL": 10, "DEFAULT_TTL": 30}, "exceeds"),
        ({"HOLDER_LABEL": "bad\x00label"}, "printable"),
    ],
)
def test_bad_limits_are_reported_by_check(extra: dict[str, Any], problem: str) -> None:
    with override_settings(LEASES={**extra}):
        found = conf.problems()
    assert any(problem in message for message in found), found


def test_max_ttl_defaults_to_a_day() -> None:
    with override_settings(LEASES={}):
        assert conf.get().max_ttl == 86400.0
