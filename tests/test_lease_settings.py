"""``LEASES["MAX_TTL"]`` and ``HOLDER_LABEL`` are validated with the rest of the setting."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from leases import acquire, conf
from leases.errors import InvalidLeaseOption, LeasesImproperlyConfigured


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"MAX_TTL": 0}, "MAX_TTL"),
        ({"MAX_TTL": -1}, "MAX_TTL"),
        ({"MAX_TTL": "1"}, "MAX_TTL"),
        ({"MAX_TTL": 1e12}, "ten years"),
        ({"MAX_TTL": 10, "DEFAULT_TTL": 30}, "exceeds"),
        ({"HOLDER_LABEL": "bad\x00label"}, "printable"),
        # Not a number a clock can use: NaN passed every comparison, and a NaN DRIFT_MIN made
        # every lease born with no time left (remaining() == 0) while acquire() succeeded.
        ({"DEFAULT_TTL": float("nan")}, "finite"),
        ({"DRIFT_FACTOR": float("inf")}, "finite"),
        ({"DRIFT_MIN": float("nan")}, "finite"),
        # A drift allowance that eats the whole DEFAULT_TTL: every lease() without ttl= raised
        # InvalidLeaseOption at run time, while check only warned (W001).
        ({"DRIFT_FACTOR": 2}, "drift allowance"),
        ({"DEFAULT_TTL": 0.001}, "drift allowance"),
        # Longer labels were silently cut to 100 characters in every holder identity.
        ({"HOLDER_LABEL": "x" * 101}, "100"),
        # "@" ends the label in a holder identity: the admin, leader_of() and manage.py leases
        # could no longer find host, pid and thread in it and showed it raw.
        ({"HOLDER_LABEL": "svc@prod"}, "@"),
        # Revocations keep the alias in varchar(100): a force release on a longer one failed
        # with a DataError (a 500 in the admin, "database unavailable" from the command).
        ({"BACKENDS": {"b" + "x" * 100: {"ENGINE": "leases.backends.database"}}}, "at most 100"),
        ({"BACKENDS": {1: {"ENGINE": "leases.backends.database"}}}, "must be a string"),
        # Every call without backend= failed at its first use, past a clean `check`.
        ({"BACKENDS": {"primary": {"ENGINE": "leases.backends.database"}}}, 'no "default"'),
    ],
)
def test_bad_limits_are_reported_by_check(extra: dict[str, Any], problem: str) -> None:
    with override_settings(LEASES={**extra}):
        found = conf.problems()
    assert any(problem in message for message in found), found


def test_max_ttl_defaults_to_a_day() -> None:
    with override_settings(LEASES={}):
        assert conf.get().max_ttl == 86400.0


# A TTL's verdict is remembered per settings object (``acquiring._checked_ttl``: every acquire
# checks its TTL, mostly the same few). Each test reaches the check through ``acquire()`` and
# stops before any round trip: at an alias that is not configured (looked up after the TTL),
# or at a bad ``on_lost`` (checked after the keepalive warning).


def test_a_remembered_ttl_is_checked_again_under_new_settings() -> None:
    with pytest.raises(LeasesImproperlyConfigured, match="no backend"):
        acquire("ttl-memo", ttl=50, backend="not-configured")  # 50 s is valid: remembered
    with (
        override_settings(LEASES={**settings.LEASES, "MAX_TTL": 40}),
        pytest.raises(InvalidLeaseOption, match="MAX_TTL"),
    ):
        acquire("ttl-memo", ttl=50, backend="not-configured")
    with pytest.raises(LeasesImproperlyConfigured, match="no backend"):
        acquire("ttl-memo", ttl=50, backend="not-configured")  # the first settings again


def test_a_bool_ttl_is_refused_after_its_equal_number_was_accepted() -> None:
    with pytest.raises(LeasesImproperlyConfigured, match="no backend"):
        acquire("ttl-memo", ttl=1, backend="not-configured")
    with pytest.raises(InvalidLeaseOption, match="ttl"):
        acquire("ttl-memo", ttl=True, backend="not-configured")  # True == 1, but no number


def test_a_too_short_ttl_warns_on_every_acquire() -> None:
    for _ in range(3):
        with (
            pytest.warns(RuntimeWarning, match="to retry a failed renewal"),
            pytest.raises(InvalidLeaseOption, match="on_lost"),
        ):
            acquire("ttl-memo", ttl=0.12, on_lost="not callable")  # type: ignore[arg-type]


@pytest.mark.parametrize("alias", [["default"], {"default": 1}, {"default"}])
def test_an_unhashable_backend_alias_is_refused_as_unknown(alias: Any) -> None:
    """``backend=`` must be an alias: a list or dict reached the lookup of the process's
    backends and failed with a bare ``TypeError: unhashable type``, not the package's error."""
    with pytest.raises(LeasesImproperlyConfigured, match="no backend"):
        acquire("settings:alias", ttl=5, backend=alias, keepalive=False)
