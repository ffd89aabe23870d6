"""The etcd backend against secured clusters: etcd's own authentication (users, passwords and a
role limited to the backend's prefix, ``auth enable``) and TLS with client certificates made by
``openssl`` for this run. One-member clusters of this module's own: what is tested is the
client's side of the handshake, which a cluster's size does not change.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from devservers.etcd import EtcdCluster, TlsFiles, etcd_binary, make_certificates
from leases import LeaseError, lease
from leases.backends import get_backend
from tests.extra_backends import added_backend
from tests.lease_backends import lease_name

__all__ = ["lease_name"]  # fixture, re-exported for pytest

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed"),
]

ROOT_PASSWORD, PASSWORD = "root-secret", "leases-secret"  # a throwaway cluster's


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def enable_auth(url: str) -> None:
    """Users ``root`` and ``leases`` (read-write on ``leases/`` only) and ``outsider`` (no
    rights), then ``auth enable``: from then on every request needs a user's token."""

    def call(path: str, body: dict[str, Any]) -> None:
        response = requests.post(f"{url}/v3/auth/{path}", json=body, timeout=5)
        assert response.status_code == 200, (path, response.text)

    call("role/add", {"name": "root"})
    call("role/add", {"name": "leases-rw"})
    perm = {"permType": "READWRITE", "key": _b64("leases/"), "range_end": _b64("leases0")}
    call("role/grant", {"name": "leases-rw", "perm": perm})
    for user, password, role in (
        ("root", ROOT_PASSWORD, "root"),
        ("leases", PASSWORD, "leases-rw"),
        ("outsider", PASSWORD, None),
    ):
        call("user/add", {"name": user, "password": password})
        if role:
            call("user/grant", {"user": user, "role": role})
    call("enable", {})


@pytest.fixture(scope="module")
def auth_cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(size=1) as cluster:
        enable_auth(cluster.endpoints[0])
        yield cluster


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_certificates(Path(tmp_path_factory.mktemp("etcd-tls")))


@pytest.fixture(scope="module")
def tls_cluster(tls_files: TlsFiles) -> Iterator[EtcdCluster]:
    with EtcdCluster(size=1, tls=tls_files) as cluster:
        yield cluster


def etcd_config(cluster: EtcdCluster, **options: Any) -> dict[str, Any]:
    return {"ENGINE": "leases.backends.etcd", "ENDPOINTS": cluster.endpoints, **options}


def acquire_renew_wake_release(alias: str, name: str) -> None:
    """The whole client side: grant, keepalive, a watch woken by the release, release."""
    store = get_backend(alias)
    with lease(name, ttl=5, backend=alias) as held:
        held.renew()
        woken: list[bool] = []
        waiter = threading.Thread(target=lambda: woken.append(store.wait_for_release(name, 10)))
        waiter.start()
        assert store.try_acquire(name, "other", 5) is None
    waiter.join(15)
    assert woken == [True]
    with lease(name, ttl=5, backend=alias, timeout=0) as again:
        assert again.token > held.token


def test_auth_user_with_rights_on_the_prefix_holds_renews_and_releases(
    auth_cluster: EtcdCluster, lease_name: str
) -> None:
    config = etcd_config(auth_cluster, USERNAME="leases", PASSWORD=PASSWORD)
    with added_backend("etcd-auth", config) as alias:
        acquire_renew_wake_release(alias, lease_name)
        info = get_backend(alias).inspect(lease_name)
        assert info is not None and not info.held


def test_auth_refuses_a_wrong_password_an_outsider_and_no_credentials(
    auth_cluster: EtcdCluster, lease_name: str
) -> None:
    refused = {
        "etcd-bad-password": {"USERNAME": "leases", "PASSWORD": "wrong"},
        "etcd-outsider": {"USERNAME": "outsider", "PASSWORD": PASSWORD},
        "etcd-anonymous": {},
    }
    for alias, options in refused.items():
        config = etcd_config(auth_cluster, **options)
        with added_backend(alias, config), pytest.raises(LeaseError):
            get_backend(alias).try_acquire(lease_name, "intruder", 5)
    config = etcd_config(auth_cluster, USERNAME="leases", PASSWORD=PASSWORD)
    with added_backend("etcd-auth", config) as alias:
        assert get_backend(alias).inspect(lease_name) is None  # nothing was written


def test_the_deploy_check_says_why_a_member_refused_it(auth_cluster: EtcdCluster) -> None:
    """With good credentials each member answers its status; with a wrong password the check
    fails (``leases.E003``) and says that the authentication was refused, not merely that
    nobody answered."""
    good = etcd_config(auth_cluster, USERNAME="leases", PASSWORD=PASSWORD)
    with added_backend("etcd-auth", good) as alias:
        problems = get_backend(alias).deploy_checks()
    assert not [p for p in problems if "refused" in p or "no answer" in p], problems
    bad = etcd_config(auth_cluster, USERNAME="leases", PASSWORD="wrong")
    with added_backend("etcd-bad-password", bad) as alias, pytest.raises(LeaseError) as raised:
        get_backend(alias).deploy_checks()
    assert "refused: " in str(raised.value) and "authentication failed" in str(raised.value)


def test_tls_with_the_ca_and_a_client_certificate(
    tls_cluster: EtcdCluster, tls_files: TlsFiles, lease_name: str
) -> None:
    files = tls_files
    assert all(url.startswith("https://") for url in tls_cluster.endpoints)
    config = etcd_config(
        tls_cluster,
        CA_CERT=str(files.ca),
        CERT_CERT=str(files.client_cert),
        CERT_KEY=str(files.client_key),
    )
    with added_backend("etcd-tls", config) as alias:
        acquire_renew_wake_release(alias, lease_name)


def test_tls_refuses_a_client_without_its_certificate_or_the_ca(
    tls_cluster: EtcdCluster, tls_files: TlsFiles, lease_name: str
) -> None:
    files = tls_files
    refused = {
        "etcd-no-client-cert": {"CA_CERT": str(files.ca)},
        "etcd-unknown-ca": {"CERT_CERT": str(files.client_cert), "CERT_KEY": str(files.client_key)},
    }
    for alias, options in refused.items():
        config = etcd_config(tls_cluster, CONNECT_TIMEOUT=1.0, **options)
        with added_backend(alias, config), pytest.raises(LeaseError):
            get_backend(alias).try_acquire(lease_name, "intruder", 5)
