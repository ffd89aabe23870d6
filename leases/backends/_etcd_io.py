"""The etcd v3 HTTP/JSON gateway as the etcd backend talks to it: failover, deadlines, watches.

etcd3gw (OpenStack's maintained, pure-Python gateway client) provides a ``requests`` session per
member with the TLS pass-through (CA, client certificate); requests go through
:meth:`Gateway.call` rather than its helpers so that each one carries its own timeout (a wait's
deadline, not the client's fixed one) and fails over to the next member.

**Failover.** A request that cannot reach a member (refused, reset, timed out: a crashed or
stopped member) or that the member refuses for want of a leader is sent to the next member, at
most once per member; the member that answered is used first next time. A request may thus
reach the cluster twice; every mutation of the backend is a compare-and-swap transaction whose
replay the backend recognises (:attr:`Reply.replayed`), never a blind write.

**Watches** are one streaming request that ends on the caller's deadline: the socket's timeout
is re-armed with the time left before every read, so no thread or timer is needed to stop it.
"""

from __future__ import annotations

import base64
import json
import math
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests
from etcd3gw.client import Etcd3Client

from ..errors import BackendUnavailable

__all__ = ["Answer", "EtcdRefused", "Gateway", "Reply", "b64", "unb64"]

#: The gateway's path prefix since etcd 3.4 (3.3 served ``/v3beta``): no discovery round trip.
API_PATH = "/v3/"

#: Answers meaning "this member cannot serve now, another may": sent on to the next member.
_UNAVAILABLE = ("no leader", "leader changed", "timed out", "not capable", "too many requests")
_AUTH_EXPIRED = ("invalid auth token", "user name is empty")


def b64(data: str | bytes) -> str:
    """The gateway's encoding of keys and values (protobuf ``bytes`` as base64 JSON strings)."""
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def unb64(data: str) -> bytes:
    return base64.b64decode(data)


class EtcdRefused(Exception):
    """etcd answered with an error that another member would repeat (``lease not found``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.message = message


@dataclass(frozen=True)
class Reply:
    body: dict[str, Any]
    #: The request reached a member after an earlier attempt failed in a way that leaves it
    #: unknown whether that attempt was applied (timeout, reset): its effect may be there.
    replayed: bool


#: One member's reply body to :meth:`Gateway.ask_each`, or why it gave none.
Answer = dict[str, Any] | str


class Gateway:
    """The members of one cluster, reached in turn; safe to share between threads."""

    def __init__(self, alias: str, endpoints: Sequence[str], options: Mapping[str, Any]) -> None:
        self.alias = alias
        self.connect_timeout = float(options.get("CONNECT_TIMEOUT", 0.5))
        self.request_timeout = float(options.get("REQUEST_TIMEOUT", 2.0))
        self._user = options.get("USERNAME")
        self._password = options.get("PASSWORD")
        self._token: str | None = None
        self._clients = [self._client(url, options) for url in endpoints]
        self._current = 0
        self._lock = threading.Lock()

    @staticmethod
    def _client(url: str, options: Mapping[str, Any]) -> Etcd3Client:
        """etcd3gw's client for one member. Its session's ``verify`` (``CA_CERT``) is passed
        again with every request: ``requests`` lets ``REQUESTS_CA_BUNDLE``/``CURL_CA_BUNDLE``
        override a session's own ``verify``, which would distrust the cluster's CA on any
        machine that sets them."""
        parts = urlsplit(url)
        return Etcd3Client(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 2379,
            protocol=parts.scheme or "http",
            ca_cert=options.get("CA_CERT"),
            cert_key=options.get("CERT_KEY"),
            cert_cert=options.get("CERT_CERT"),
            api_path=API_PATH,
        )

    def _order(self) -> list[Etcd3Client]:
        with self._lock:
            start = self._current
        return self._clients[start:] + self._clients[:start]

    def _prefer(self, client: Etcd3Client) -> None:
        with self._lock:
            self._current = self._clients.index(client)

    def call(self, path: str, body: Mapping[str, Any], timeout: float | None = None) -> Reply:
        """POST ``body`` to ``path`` on the first member that answers: each member gets
        ``REQUEST_TIMEOUT``, and all of them together at most ``timeout`` when given.

        Raises :class:`EtcdRefused` for an answer another member would repeat and
        :class:`~leases.errors.BackendUnavailable` when no member answered in time.
        """
        deadline = time.monotonic() + (math.inf if timeout is None else timeout)
        problems: list[str] = []
        replayed = False
        for client in self._order():
            left = min(self.request_timeout, deadline - time.monotonic())
            if left <= 0:
                break
            try:
                response = self._post(client, path, body, left)
            except requests.ConnectTimeout as exc:  # never sent
                problems.append(f"{client.base_url}: {type(exc).__name__}")
                continue
            except (
                requests.ConnectionError,
                requests.Timeout,
                requests.exceptions.ChunkedEncodingError,  # a reply cut off by a clean close
            ) as exc:
                problems.append(f"{client.base_url}: {type(exc).__name__}")
                # Refused at connect: never sent. A reset or a read timeout may follow its apply.
                replayed = replayed or "Failed to establish" not in str(exc)
                continue
            if response.status_code == requests.codes.ok:
                self._prefer(client)
                return Reply(response.json(), replayed)
            message = _message(response)
            if any(part in message for part in _UNAVAILABLE):
                problems.append(f"{client.base_url}: {message}")
                replayed = True
                continue
            raise EtcdRefused(response.status_code, message)
        raise BackendUnavailable(self.alias, f"{path}: " + ("; ".join(problems) or "timed out"))

    def ask_each(self, path: str, body: Mapping[str, Any]) -> list[tuple[str, Answer]]:
        """``path`` asked of every member at once, without failover: each member's URL with
        its reply body, or with why it gave none, in the order of ``ENDPOINTS``. For what
        members do not share through the cluster (their own version and status), which
        :meth:`call` would ask of one only. At once, because the members that matter here
        are the ones that do not answer: asked in turn, each hung member would add its
        ``REQUEST_TIMEOUT`` to ``manage.py check --deploy`` and the health check; asked
        together, they cost one between them."""
        with ThreadPoolExecutor(
            max_workers=len(self._clients), thread_name_prefix=f"leases-etcd-{self.alias}"
        ) as pool:
            asked = [pool.submit(self._ask, client, path, body) for client in self._clients]
        return [
            (client.base_url, answer.result())
            for client, answer in zip(self._clients, asked, strict=True)
        ]

    def _ask(self, client: Etcd3Client, path: str, body: Mapping[str, Any]) -> Answer:
        """One member's answer to :meth:`ask_each`."""
        try:
            response = self._post(client, path, body, self.request_timeout)
        except requests.RequestException as exc:
            return f"no answer ({type(exc).__name__})"
        except EtcdRefused as exc:  # its authentication, refused
            return f"refused: {exc.message}"
        if response.status_code != requests.codes.ok:
            return f"refused: {_message(response)}"
        return dict(response.json())

    def _post(
        self, client: Etcd3Client, path: str, body: Mapping[str, Any], timeout: float
    ) -> requests.Response:
        """One POST, re-authenticating once if the auth token (5 minutes by default) lapsed."""
        for _ in range(2):
            response = client.session.post(
                client.get_url(path),
                json=body,
                headers=self._auth_header(client, timeout),
                timeout=(min(self.connect_timeout, timeout), timeout),
                verify=client.session.verify,
            )
            if response.status_code == requests.codes.ok or self._user is None:
                return response
            if not any(part in _message(response) for part in _AUTH_EXPIRED):
                return response
            self._token = None
        return response

    def _auth_header(self, client: Etcd3Client, timeout: float) -> dict[str, str]:
        if self._user is None:
            return {}
        if self._token is None:
            response = client.session.post(
                client.get_url("auth/authenticate"),
                json={"name": self._user, "password": self._password},
                timeout=(min(self.connect_timeout, timeout), timeout),
                verify=client.session.verify,
            )
            if response.status_code != requests.codes.ok:
                raise EtcdRefused(response.status_code, _message(response))
            self._token = str(response.json()["token"])
        return {"Authorization": self._token}

    def watch_deletion(self, key: str, start_revision: int, timeout: float) -> bool:
        """Block until ``key`` is deleted at or after ``start_revision`` (``True``), or until
        ``timeout`` passes (``False``): one streaming request, no polling."""
        return self.deletion(key, start_revision, timeout) is not None

    def deletion(self, key: str, start_revision: int, timeout: float) -> int | None:
        """The revision at which ``key`` was (or, within ``timeout``, is) first deleted at or
        after ``start_revision``; ``0`` when the history was compacted past it (a deletion may
        have been missed); ``None`` when none came in time."""
        deadline = time.monotonic() + timeout
        client = self._order()[0]
        body: dict[str, Any] = {
            "create_request": {"key": key, "start_revision": start_revision, "filters": ["NOPUT"]}
        }
        buffer = b""
        try:
            with client.session.post(
                client.get_url("watch"),
                json=body,
                headers=self._auth_header(client, timeout),
                stream=True,
                timeout=(min(self.connect_timeout, timeout), timeout),
                verify=client.session.verify,
            ) as response:
                if response.status_code != requests.codes.ok:
                    raise BackendUnavailable(self.alias, f"watch: {_message(response)}")
                sock = response.raw.connection.sock if response.raw.connection else None
                for chunk in response.iter_content(chunk_size=None):
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        revision = _deleted(line)
                        if revision is not None:
                            return revision
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    if sock is not None:
                        sock.settimeout(left)
        except requests.RequestException as exc:
            # Not only a reset or a timeout: a member that exits or drops the stream cleanly
            # ends the chunked reply mid-way (``ChunkedEncodingError``).
            if time.monotonic() >= deadline - 0.001:
                return None
            raise BackendUnavailable(self.alias, f"watch: {type(exc).__name__}") from exc
        return None

    def close(self) -> None:
        for client in self._clients:
            client.session.close()


def _deleted(line: bytes) -> int | None:
    """The revision of the deletion one message of the watch stream reports (only deletions
    are sent), ``0`` when the watch was canceled (compacted past its start: the caller tries
    again), ``None`` for a message without an event (the watch's creation)."""
    if not line.strip():
        return None
    result = json.loads(line).get("result", {})
    if result.get("canceled"):
        return 0
    events = result.get("events") or []
    if not events:
        return None
    return int(events[0].get("kv", {}).get("mod_revision", 0))


def _message(response: requests.Response) -> str:
    try:
        return str(response.json().get("error") or response.text)
    except ValueError:
        return response.text[:200]
