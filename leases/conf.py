"""The ``LEASES`` setting, read in one place.

Read lazily and re-read when Django's ``setting_changed`` fires, so ``override_settings`` works.
Problems are reported by ``manage.py check`` (see :mod:`leases.checks`) through
:func:`problems`; using a broken setting at run time raises
:class:`~leases.errors.LeasesImproperlyConfigured` with the same message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from .errors import LeasesImproperlyConfigured

__all__ = ["MIN_RETRY_WINDOW", "BackendConfig", "LeasesSettings", "get", "problems"]

SETTING_NAME = "LEASES"
#: Seconds a due renewal must have to be retried before the validity ends (below: W001).
MIN_RETRY_WINDOW = 0.1
#: The highest ``MAX_TTL`` accepted: ten years.
MAX_TTL_LIMIT = 10 * 365 * 86400.0
#: The longest ``HOLDER_LABEL``: with host, pid, thread and a random part it must still fit the
#: 255 characters of a holder identity.
MAX_LABEL_LENGTH = 100
#: The longest backend alias: revocations and the force-release audit keep it in a column this
#: wide (``Revocation.backend``, ``ForceRelease.backend``).
MAX_ALIAS_LENGTH = 100

DEFAULTS: dict[str, Any] = {
    "BACKENDS": {"default": {"ENGINE": "leases.backends.database"}},
    # Seconds a lease lasts unless renewed.
    "DEFAULT_TTL": 30.0,
    # The longest TTL accepted (a day): a longer one is almost surely a unit mistake (ms for
    # s), and an unbounded one writes expiries no datetime can read back (ttl=1e12: year 33715).
    "MAX_TTL": 86400.0,
    # Keepalive renews once this fraction of the TTL has passed (1/3 leaves two more tries).
    "RENEW_FRACTION": 1 / 3,
    # Clock drift allowance subtracted from every validity: TTL * factor + minimum (Redlock's).
    "DRIFT_FACTOR": 0.01,
    "DRIFT_MIN": 0.002,
    # Label added to every holder identity (e.g. a deployment or service name).
    "HOLDER_LABEL": "",
    # Record each advisory lock name on first use (from a background thread with a connection
    # of its own), so operators' views show names instead of 64-bit keys.
    "RECORD_ADVISORY_NAMES": True,
    # Django database aliases that reach PostgreSQL through a pooler which keeps each client's
    # server session (PgBouncer's session mode): session_lock is refused behind any other.
    "SESSION_POOLING": (),
}


@dataclass(frozen=True)
class BackendConfig:
    """One entry of ``LEASES["BACKENDS"]``: an engine module path and its options."""

    alias: str
    engine: str
    options: dict[str, Any]


@dataclass(frozen=True)
class LeasesSettings:
    backends: dict[str, BackendConfig]
    default_ttl: float
    max_ttl: float
    renew_fraction: float
    drift_factor: float
    drift_min: float
    holder_label: str
    record_advisory_names: bool = True
    session_pooling: frozenset[str] = frozenset()

    def retry_window(self, ttl: float) -> float:
        """Time between a renewal falling due and the holder's validity running out.

        This is all the time a failed renewal has to be retried; a TTL that leaves (almost)
        none loses its lease to the first slow round trip. It follows from the settings alone,
        so the checks, ``lease()``'s warning and keepalive all read it here.
        """
        return ttl * (1 - self.renew_fraction) - (ttl * self.drift_factor + self.drift_min)

    def backend(self, alias: str) -> BackendConfig:
        try:
            return self.backends[alias]
        except (KeyError, TypeError):  # TypeError: not hashable, so not an alias either
            known = ", ".join(sorted(self.backends)) or "none"
            raise LeasesImproperlyConfigured(
                f'LEASES["BACKENDS"] has no backend {alias!r} (configured: {known})'
            ) from None


def _raw() -> dict[str, Any]:
    value = getattr(django_settings, SETTING_NAME, {})
    if not isinstance(value, dict):
        raise LeasesImproperlyConfigured(f"{SETTING_NAME} must be a dict, not {type(value)}")
    return value


def problems() -> list[str]:
    """Every problem with the current setting, as messages (empty when it is valid)."""
    try:
        raw = _raw()
    except LeasesImproperlyConfigured as exc:
        return [str(exc)]
    found = [
        f"{SETTING_NAME} has an unknown key {key!r} (known: {', '.join(sorted(DEFAULTS))})"
        for key in raw
        if key not in DEFAULTS
    ]
    backends = raw.get("BACKENDS", DEFAULTS["BACKENDS"])
    if not isinstance(backends, dict) or not backends:
        found.append(f'{SETTING_NAME}["BACKENDS"] must be a non-empty dict of alias -> options')
    else:
        if "default" not in backends:
            # As Django's DATABASES: every call without backend= (lease(), acquire(), the
            # Celery decorators) names it, and each failed at its first use in production.
            found.append(
                f'{SETTING_NAME}["BACKENDS"] has no "default" backend, which every call '
                "without backend= uses (configured: " + ", ".join(sorted(map(str, backends))) + ")"
            )
        for alias, entry in backends.items():
            if not isinstance(alias, str) or len(alias) > MAX_ALIAS_LENGTH:
                # Else a force release on it failed in the database (DataError): its leases
                # could never be revoked, and nothing said so before the first incident.
                found.append(
                    f'{SETTING_NAME}["BACKENDS"] alias {alias!r} must be a string of at most '
                    f"{MAX_ALIAS_LENGTH} characters (revocations record it)"
                )
            if not isinstance(entry, dict) or not isinstance(entry.get("ENGINE"), str):
                found.append(
                    f'{SETTING_NAME}["BACKENDS"][{alias!r}] needs an "ENGINE" module path, '
                    'e.g. "leases.backends.database"'
                )
    for key in ("DEFAULT_TTL", "MAX_TTL", "RENEW_FRACTION", "DRIFT_FACTOR", "DRIFT_MIN"):
        value = raw.get(key, DEFAULTS[key])
        # NaN compares false with everything, so it would pass every bound below unseen.
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 <= value < math.inf
        ):
            found.append(
                f'{SETTING_NAME}["{key}"] must be a finite non-negative number, not {value!r}'
            )
    if not found:
        found += _time_problems(raw)
    found += _label_problems(raw.get("HOLDER_LABEL", ""))
    if not isinstance(raw.get("RECORD_ADVISORY_NAMES", True), bool):
        found.append(f'{SETTING_NAME}["RECORD_ADVISORY_NAMES"] must be True or False')
    pooled = raw.get("SESSION_POOLING", ())
    if not isinstance(pooled, list | tuple | set | frozenset) or not all(
        isinstance(alias, str) for alias in pooled
    ):
        found.append(f'{SETTING_NAME}["SESSION_POOLING"] must be a list of database aliases')
    return found


def _time_problems(raw: dict[str, Any]) -> list[str]:
    """How the (finite, non-negative) numbers fit together: a ``DEFAULT_TTL`` that every
    ``lease()`` without ``ttl=`` would refuse is an error here, not at the first call."""
    found = []
    ttl, fraction = float(raw.get("DEFAULT_TTL", 30)), float(raw.get("RENEW_FRACTION", 1 / 3))
    max_ttl = float(raw.get("MAX_TTL", DEFAULTS["MAX_TTL"]))
    drift_factor = float(raw.get("DRIFT_FACTOR", DEFAULTS["DRIFT_FACTOR"]))
    drift_min = float(raw.get("DRIFT_MIN", DEFAULTS["DRIFT_MIN"]))
    if ttl <= 0:
        found.append(f'{SETTING_NAME}["DEFAULT_TTL"] must be greater than 0')
    elif ttl * (1 - drift_factor) <= drift_min:
        found.append(
            f'{SETTING_NAME}["DEFAULT_TTL"] = {ttl:g} does not exceed its clock drift '
            "allowance (DEFAULT_TTL * DRIFT_FACTOR + DRIFT_MIN): a lease would be invalid "
            "the moment it is granted"
        )
    if drift_factor >= 1:
        found.append(
            f'{SETTING_NAME}["DRIFT_FACTOR"] must be below 1 (a fraction of the TTL): the '
            "drift allowance would exceed every TTL"
        )
    if not 0 < max_ttl <= MAX_TTL_LIMIT:
        found.append(
            f'{SETTING_NAME}["MAX_TTL"] must be greater than 0 and at most {MAX_TTL_LIMIT:g} '
            "seconds (ten years), so every expiry is a date every store and Python can hold"
        )
    elif ttl > max_ttl:
        found.append(
            f'{SETTING_NAME}["DEFAULT_TTL"] = {ttl:g} exceeds {SETTING_NAME}["MAX_TTL"] = '
            f"{max_ttl:g}"
        )
    if not 0 < fraction < 1:
        found.append(f'{SETTING_NAME}["RENEW_FRACTION"] must be between 0 and 1 (exclusive)')
    return found


def _label_problems(label: object) -> list[str]:
    if not isinstance(label, str) or not label.isprintable():
        return [f'{SETTING_NAME}["HOLDER_LABEL"] must be a string of printable characters']
    if "@" in label:
        return [
            f'{SETTING_NAME}["HOLDER_LABEL"] must not contain "@": it ends the label in a holder '
            "identity (label@host:pid:thread), which could then not be read back"
        ]
    if len(label) > MAX_LABEL_LENGTH:
        return [
            f'{SETTING_NAME}["HOLDER_LABEL"] is {len(label)} characters long; at most '
            f"{MAX_LABEL_LENGTH} fit in a holder identity"
        ]
    return []


@cache
def get() -> LeasesSettings:
    """The validated setting; cached until Django reports the setting changed."""
    found = problems()
    if found:
        raise LeasesImproperlyConfigured("; ".join(found))
    raw = {**DEFAULTS, **_raw()}
    backends = {
        alias: BackendConfig(
            alias=alias,
            engine=entry["ENGINE"],
            options={k: v for k, v in entry.items() if k != "ENGINE"},
        )
        for alias, entry in raw["BACKENDS"].items()
    }
    return LeasesSettings(
        backends=backends,
        default_ttl=float(raw["DEFAULT_TTL"]),
        max_ttl=float(raw["MAX_TTL"]),
        renew_fraction=float(raw["RENEW_FRACTION"]),
        drift_factor=float(raw["DRIFT_FACTOR"]),
        drift_min=float(raw["DRIFT_MIN"]),
        holder_label=str(raw["HOLDER_LABEL"]),
        record_advisory_names=bool(raw["RECORD_ADVISORY_NAMES"]),
        session_pooling=frozenset(raw["SESSION_POOLING"]),
    )


_reset_hooks: list[Any] = []


def on_reset(hook: Any) -> Any:
    """Register a callable run whenever the setting changes (backends drop cached clients)."""
    _reset_hooks.append(hook)
    return hook


@receiver(setting_changed)
def _setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in (SETTING_NAME, "DATABASES", "CACHES"):
        get.cache_clear()
        for hook in _reset_hooks:
            hook()
