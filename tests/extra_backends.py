"""Lease backends a test adds to the settings for its own duration: one at a loopback port
nobody listens on (a store that is down; connection refused is immediate, so these tests wait
for no timeout), or one on a server the test owns."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from devservers import free_port

__all__ = ["CLOSED", "added_backend", "closed_port_backend"]

#: The alias of the backend at the closed port.
CLOSED = "closed-port"


@contextlib.contextmanager
def added_backend(alias: str, config: dict[str, Any]) -> Iterator[str]:
    """``LEASES["BACKENDS"][alias] = config`` inside the block; yields ``alias``."""
    leases: dict[str, Any] = settings.LEASES
    backends = {**leases["BACKENDS"], alias: config}
    with override_settings(LEASES={**leases, "BACKENDS": backends}):
        yield alias


@pytest.fixture
def closed_port_backend() -> Iterator[str]:
    """``CLOSED``: a Redis backend at ``127.0.0.1:<a free port>``."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    config = {"ENGINE": "leases.backends.redis", "URL": url, "SOCKET_TIMEOUT": 1.0}
    with added_backend(CLOSED, config) as alias:
        yield alias
