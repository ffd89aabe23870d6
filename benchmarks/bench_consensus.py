"""etcd and ZooKeeper leases: our backends vs the client libraries' raw calls and the peers.

Everyone on the same 3-member etcd cluster and 3-member ZooKeeper ensemble (started for this
run) in the same run, taking turns round by round. Uncontended acquire + release per operation:

- etcd: the floor is etcd3gw's own calls for what any correct etcd lease needs (lease grant, a
  ``create_revision == 0`` put transaction, a compare-and-delete transaction, lease revoke: four
  round trips); the peer is tooz's etcd3gw driver (three: it leaves the lease to expire instead of
  revoking it); ours through the backend and through the public ``lease()``.
- ZooKeeper: the floor is kazoo's create of an ephemeral sequential znode then its delete (two
  round trips, the least any ZooKeeper lock costs); the peer is kazoo's ``Lock`` recipe; ours.

Then hand-off latency under contention: the time from the holder's release to the blocked
waiter's acquire returning.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.test import override_settings

from benchmarks.bench_lease import handoff
from benchmarks.bench_redis import ours
from benchmarks.common import Report, interleaved
from devservers.etcd import EtcdCluster, etcd_binary
from devservers.zookeeper import ZooKeeperEnsemble, zookeeper_classpath
from leases.lease import acquire

TITLE = "etcd and ZooKeeper leases: backends vs raw etcd3gw / kazoo, tooz etcd3gw, kazoo Lock"

TTL = 10.0
OPS, ROUNDS, WARMUP = 30, 9, 10
ETCD, ZK = "bench-etcd", "bench-zookeeper"

#: Blocks until it holds the contended lock, and returns the function that releases it.
Take = Callable[[], Callable[[], object]]


@contextmanager
def configured(endpoints: list[str], hosts: str) -> Iterator[None]:
    backends = {
        "default": {"ENGINE": "leases.backends.database"},
        ETCD: {"ENGINE": "leases.backends.etcd", "ENDPOINTS": endpoints},
        ZK: {"ENGINE": "leases.backends.zookeeper", "HOSTS": hosts, "SESSION_TIMEOUT": TTL},
    }
    with override_settings(DEBUG=False, LEASES={"BACKENDS": backends}):
        yield


def _b64(data: str) -> str:
    import base64

    return base64.b64encode(data.encode()).decode()


def etcd_floor_and_peer(endpoint: str, coordinator: Any) -> dict[str, Callable[[], object]]:
    import etcd3gw

    host, port = endpoint.rsplit("//", 1)[1].split(":")
    client = etcd3gw.client(host=host, port=int(port), api_path="/v3/")
    key = _b64(f"bench:raw:{uuid.uuid4().hex[:8]}")
    tooz_lock = coordinator.get_lock(f"bench:tooz:{uuid.uuid4().hex[:8]}".encode())

    def raw() -> None:
        granted = client.lease(int(TTL))
        created = client.transaction({
            "compare": [{"key": key, "result": "EQUAL", "target": "CREATE",
                         "create_revision": 0}],
            "success": [{"request_put": {"key": key, "value": _b64("x"),
                                         "lease": granted.id}}],
        })  # fmt: skip
        revision = int(created["header"]["revision"])
        client.transaction({
            "compare": [{"key": key, "result": "EQUAL", "target": "CREATE",
                         "create_revision": revision}],
            "success": [{"request_delete_range": {"key": key}}],
        })  # fmt: skip
        granted.revoke()

    def tooz() -> None:
        assert tooz_lock.acquire(blocking=False)
        tooz_lock.release()

    return {
        "raw etcd3gw: lease grant + put txn + delete txn + revoke (floor)": raw,
        "tooz etcd3gw Lock (no revoke: its lease lingers)": tooz,
    }


def zookeeper_floor_and_peer(client: Any) -> dict[str, Callable[[], object]]:
    base = f"/bench/{uuid.uuid4().hex[:8]}"
    client.ensure_path(f"{base}/raw")

    def raw() -> None:
        path = client.create(f"{base}/raw/c-", b"", ephemeral=True, sequence=True)
        client.delete(path)

    def kazoo_lock() -> None:
        held = client.Lock(f"{base}/kazoo", "bench")
        assert held.acquire(blocking=False)
        held.release()

    return {
        "raw kazoo: create ephemeral sequential + delete (floor)": raw,
        "kazoo Lock recipe": kazoo_lock,
    }


def takers(coordinator: Any, client: Any) -> dict[str, Take]:
    name = f"bench:handoff:{uuid.uuid4().hex[:8]}"

    def take_ours(alias: str) -> Take:
        def take() -> Callable[[], object]:
            return acquire(
                name + alias, ttl=TTL, backend=alias, keepalive=False, timeout=10
            ).release

        return take

    def tooz() -> Callable[[], object]:
        held = coordinator.get_lock(f"{name}:tooz".encode())
        assert held.acquire(blocking=10)
        release: Callable[[], object] = held.release
        return release

    def kazoo_lock() -> Callable[[], object]:
        held = client.Lock(f"/bench/{name}:kazoo", uuid.uuid4().hex)
        assert held.acquire(timeout=10)
        release: Callable[[], object] = held.release
        return release

    return {
        "ours, etcd (watch on the key's deletion)": take_ours(ETCD),
        "tooz etcd3gw Lock (retries the put)": tooz,
        "ours, zookeeper (watch on the predecessor)": take_ours(ZK),
        "kazoo Lock (watch on the predecessor)": kazoo_lock,
    }


def main(report: Report) -> None:
    if etcd_binary() is None or zookeeper_classpath() is None:
        report.note("skipped: needs etcd-server and zookeeper (apt-get install, as scripts/test)")
        return
    from kazoo.client import KazooClient  # type: ignore[import-untyped]
    from tooz import coordination

    with EtcdCluster() as cluster, ZooKeeperEnsemble() as ensemble:
        endpoint = cluster.endpoints[0]
        coordinator = coordination.get_coordinator(f"etcd3+{endpoint}?timeout={int(TTL)}", b"bench")
        coordinator.start()
        client = KazooClient(hosts=ensemble.hosts, timeout=TTL)
        client.start(timeout=30)
        try:
            with configured([endpoint, *cluster.endpoints[1:]], ensemble.hosts):
                etcd = {
                    **etcd_floor_and_peer(endpoint, coordinator),
                    **ours(ETCD, "etcd"),
                }
                rows = interleaved(etcd, ops=OPS, rounds=ROUNDS, warmup=WARMUP)
                report.table("etcd: uncontended acquire + release (median per op)", rows)
                zookeeper = {**zookeeper_floor_and_peer(client), **ours(ZK, "zookeeper")}
                rows = interleaved(zookeeper, ops=OPS, rounds=ROUNDS, warmup=WARMUP)
                report.table("zookeeper: uncontended acquire + release (median per op)", rows)
                report.table(
                    "hand-off latency under contention: release -> the waiter's acquire returns",
                    [
                        (label, handoff(take)[0])
                        for label, take in takers(coordinator, client).items()
                    ],
                    unit="ms",
                )
        finally:
            client.stop()
            client.close()
            coordinator.stop()
    report.note(
        "Ours on etcd makes the floor's four round trips (grant, put txn; delete txn, revoke); "
        "on ZooKeeper one for the acquire (create pipelined with the line's read) and one for "
        "the release (a multi)."
    )
