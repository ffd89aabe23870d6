"""The ZooKeeper ensemble the ``zookeeper`` lease backend of the shared suite runs on.

``tests/settings.py`` calls :func:`zookeeper_hosts` while pytest-django imports it in the
controller, before xdist starts its workers: the controller launches the three JVMs at once
(without waiting, so they boot while the test database is made) and exports
``LEASES_ZOOKEEPER_HOSTS``, which workers, children and Celery workers inherit. The first test
that uses the backend waits until a quorum serves (:func:`ready`). A configured
``LEASES_ZOOKEEPER_HOSTS`` is used as is; without ZooKeeper installed the backend's tests skip.
"""

from __future__ import annotations

import atexit
import os

import pytest

from devservers.zookeeper import ZooKeeperEnsemble, wait_serving, zookeeper_classpath

__all__ = ["ready", "zookeeper_hosts"]

#: What ``HOSTS`` says when no ZooKeeper is installed: nothing listens there, tests skip.
UNAVAILABLE = "127.0.0.1:9"


def zookeeper_hosts() -> str:
    """The session ensemble's connection string, launching one if none is configured."""
    hosts = os.environ.get("LEASES_ZOOKEEPER_HOSTS")
    if hosts:
        return hosts
    if zookeeper_classpath() is None:
        return UNAVAILABLE
    ensemble = ZooKeeperEnsemble().launch()
    atexit.register(ensemble.destroy)
    os.environ["LEASES_ZOOKEEPER_HOSTS"] = ensemble.hosts
    return ensemble.hosts


def ready(request: pytest.FixtureRequest) -> None:
    """Before a test on the ``zookeeper`` backend: skip without ZooKeeper, else wait (once per
    process, bounded) until the ensemble serves."""
    hosts = os.environ.get("LEASES_ZOOKEEPER_HOSTS", UNAVAILABLE)
    if hosts == UNAVAILABLE:
        pytest.skip("ZooKeeper: apt-get install zookeeper default-jre-headless (scripts/test does)")
    if not _ready:  # once per process
        wait_serving(hosts)
        _ready.append(hosts)


_ready: list[str] = []
