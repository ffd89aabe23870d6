"""The etcd cluster and ZooKeeper ensemble behind the shared suite's ``etcd`` and ``zookeeper``
aliases: started only when a test asks for them, kept for the rest of the session.

``tests/settings.py`` names them from ``LEASES_ETCD_ENDPOINTS`` / ``LEASES_ZOOKEEPER_HOSTS`` when
those are set (a shop's own cluster, or the parent of a child process), else an address nobody
listens on. The first test that needs one (:func:`etcd_ready`, :func:`zookeeper_ready`, which
``tests/lease_backends.SETUP`` and the backends' own tests call) starts it in this process,
points the alias at it in the settings and in the environment (so child processes and Celery
workers started from then on use the same cluster) and keeps it until the process ends. Its
members die with this process's main thread (``PR_SET_PDEATHSIG``), so a killed test run leaves
nothing behind. A run that draws no such test pays nothing: no JVM, no etcd.

Under pytest-xdist each worker that needs a cluster starts its own. Sharing one through a file
lock was the alternative, but the cluster would then belong to whichever worker started it,
and xdist lets a worker exit as soon as its own share of tests is done (right after the first
distribution, when that covers every test) while the other may still be using it; a keeper
process that outlives both would be more machinery than the second start costs (about 1 s for
etcd, 3 s of JVM start for ZooKeeper, and only when both workers draw such tests).
"""

from __future__ import annotations

import atexit
import json
import os
import urllib.request
from typing import Any

import pytest

from devservers.etcd import EtcdCluster, etcd_binary
from devservers.zookeeper import ZooKeeperEnsemble, wait_serving, zookeeper_classpath

__all__ = [
    "UNAVAILABLE_ETCD",
    "UNAVAILABLE_ZOOKEEPER",
    "etcd_member_versions",
    "etcd_ready",
    "zookeeper_ready",
]

#: What the settings name until a cluster is started: nothing listens on the discard port.
UNAVAILABLE_ETCD = "http://127.0.0.1:9"
UNAVAILABLE_ZOOKEEPER = "127.0.0.1:9"

#: What each alias was pointed at in this process, once ready.
_started: dict[str, str] = {}


def _point(alias: str, option: str, value: Any, variable: str, shown: str) -> None:
    """Point ``alias`` at a cluster: in the settings (the alias's dict is shared with every
    ``override_settings`` copy of ``LEASES``), in the environment for children, and drop the
    backend instances built on the old address."""
    from django.conf import settings
    from django.core.signals import setting_changed

    leases: dict[str, Any] = settings.LEASES
    leases["BACKENDS"][alias][option] = value
    os.environ[variable] = shown
    setting_changed.send(sender=None, setting="LEASES", value=settings.LEASES, enter=False)


def _stop(cluster: EtcdCluster | ZooKeeperEnsemble) -> None:
    """At exit: close the backends first (a kazoo client whose ensemble is gone logs every
    reconnection attempt until the interpreter ends), then stop the members."""
    from leases.backends import reset

    reset()
    cluster.destroy()


def etcd_ready(request: pytest.FixtureRequest | None = None) -> str:
    """The ``etcd`` alias, on the configured cluster or on this process's own (started now if
    need be); skips the test when etcd is not installed."""
    if "etcd" not in _started:
        configured = os.environ.get("LEASES_ETCD_ENDPOINTS", "")
        if not configured:
            if etcd_binary() is None:
                pytest.skip("etcd: no etcd binary installed (apt-get install etcd-server)")
            cluster = EtcdCluster().start()
            atexit.register(_stop, cluster)
            configured = ",".join(cluster.endpoints)
            _point("etcd", "ENDPOINTS", cluster.endpoints, "LEASES_ETCD_ENDPOINTS", configured)
        _started["etcd"] = configured
    return "etcd"


def etcd_member_versions(alias: str) -> dict[str, str]:
    """Each member's etcd version behind ``alias``, asked of it directly (not through the
    backend, whose deploy check the tests compare with this)."""
    from django.conf import settings

    leases: dict[str, Any] = settings.LEASES
    versions = {}
    for url in leases["BACKENDS"][alias]["ENDPOINTS"]:
        request = urllib.request.Request(f"{url}/v3/maintenance/status", data=b"{}")
        with urllib.request.urlopen(request, timeout=5) as reply:
            versions[url] = str(json.loads(reply.read())["version"])
    return versions


def zookeeper_ready(request: pytest.FixtureRequest | None = None) -> str:
    """The ``zookeeper`` alias, on the configured ensemble (waited for until a quorum serves)
    or on this process's own, started now if need be; skips without ZooKeeper."""
    if "zookeeper" not in _started:
        configured = os.environ.get("LEASES_ZOOKEEPER_HOSTS", "")
        if configured:
            wait_serving(configured)
        else:
            if zookeeper_classpath() is None:
                pytest.skip("ZooKeeper: apt-get install zookeeper default-jre-headless")
            ensemble = ZooKeeperEnsemble().start()
            atexit.register(_stop, ensemble)
            configured = ensemble.hosts
            _point("zookeeper", "HOSTS", configured, "LEASES_ZOOKEEPER_HOSTS", configured)
        _started["zookeeper"] = configured
    return "zookeeper"
