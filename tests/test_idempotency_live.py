"""Idempotent views on a real HTTP server (gunicorn, several workers and threads).

Concurrency and crash properties need real sockets and real processes: 50 identical requests
racing on separate connections, repeated headers as a server joins them, and a server process
SIGKILLed after the view's effects were written but before it answered. Keyed requests carry a
session cookie: a client with no identity at all is refused (see ``test_idempotency``).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from devservers import free_port, reachable
from idempotency.http import PROBLEM_TYPE_BASE
from tests.testapp.models_idempotency import Charge
from tests.testapp.views_idempotency import CRASH_MARKER_ENV

pytestmark = pytest.mark.slow

APP = "django.core.wsgi:get_wsgi_application()"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def replayed(self) -> bool:
        return self.headers.get("idempotent-replayed") == "true"

    @property
    def problem(self) -> str:
        return (
            str(json.loads(self.body)["type"]).removeprefix(PROBLEM_TYPE_BASE).removesuffix(".html")
        )


class Gunicorn:
    """A gunicorn serving the test settings and URLs, in its own process group."""

    def __init__(self, env: dict[str, str], log: Path, workers: int = 2, threads: int = 8):
        self.env, self.log, self.port = env, log, free_port()
        self.args = [
            sys.executable,
            "-m",
            "gunicorn",
            f"--bind=127.0.0.1:{self.port}",
            f"--workers={workers}",
            f"--threads={threads}",
            "--worker-class=gthread",
            "--timeout=120",
            "--graceful-timeout=2",
            APP,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> Gunicorn:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.args, env=self.env, stdout=log, stderr=log, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited: {self.log.read_text()[-2000:]}")
            up = reachable(f"tcp://127.0.0.1:{self.port}", timeout=0.2)
            if up and send(self.port, "/no-such-page/", None, method="GET").status == 404:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"gunicorn did not serve in {timeout}s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL the master and every worker at once: no cleanup code runs anywhere."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()


def send(
    port: int,
    path: str,
    key: str | None,
    body: dict[str, Any] | None = None,
    *,
    method: str = "POST",
    extra_keys: tuple[str, ...] = (),
    cookie: str | None = None,
    timeout: float = 60.0,
) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = json.dumps(body or {}).encode()
        conn.putrequest(method, path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(payload)))
        if cookie is not None:
            conn.putheader("Cookie", cookie)
        for value in (key, *extra_keys) if key is not None else extra_keys:
            conn.putheader("Idempotency-Key", value)
        conn.endheaders(payload)
        response = conn.getresponse()
        headers = {name.lower(): value for name, value in response.getheaders()}
        return Reply(response.status, headers, response.read())
    finally:
        conn.close()


@pytest.fixture
def cookie(transactional_db: None) -> str:
    """The cookie of a saved session, committed so the server's processes see it."""
    session = import_module(settings.SESSION_ENGINE).SessionStore()
    session.create()
    return f"{settings.SESSION_COOKIE_NAME}={session.session_key}"


@pytest.fixture
def server(child_env: dict[str, str], tmp_path: Path) -> Iterator[Gunicorn]:
    live = Gunicorn(child_env, tmp_path / "gunicorn.log")
    try:
        yield live.start()
    finally:
        live.stop()


def race(
    port: int, path: str, key: str, body: dict[str, Any], cookie: str, count: int = 50
) -> list[Reply]:
    """``count`` identical requests on separate connections, released at the same moment."""
    barrier = threading.Barrier(count, timeout=60)
    replies: list[Reply | BaseException] = [RuntimeError("no reply")] * count

    def one(i: int) -> None:
        try:
            barrier.wait()
            replies[i] = send(port, path, key, body, cookie=cookie)
        except BaseException as exc:
            replies[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    failed = [r for r in replies if not isinstance(r, Reply)]
    assert not failed, failed[:3]
    return [r for r in replies if isinstance(r, Reply)]


# The default claim (a committed started row) and the claim in the view's transaction.
CLAIMS = pytest.mark.parametrize("claim", ["", "-tx"], ids=["row", "in_transaction"])


@CLAIMS
def test_fifty_concurrent_identical_requests_apply_the_effect_once(
    server: Gunicorn, cookie: str, claim: str
) -> None:
    body = {"amount": 5, "sleep": 1.5}
    url = f"/idem/charge{claim}/"
    replies = race(server.port, url, "race-1", body, cookie)
    ran = [r for r in replies if r.status == 201 and not r.replayed]
    refused = [r for r in replies if r.status == 409]
    assert len(ran) == 1, [r.status for r in replies]
    assert refused, "no request overlapped the first one: the race did not happen"
    assert all(r.problem == "idempotency-key-in-progress" for r in refused)
    assert all(r.headers.get("retry-after") for r in refused)
    assert all(r.body == ran[0].body for r in replies if r.status == 201)
    assert {r.status for r in replies} <= {201, 409}
    later = send(server.port, url, "race-1", body, cookie=cookie)
    assert later.replayed and later.status == 201 and later.body == ran[0].body
    assert later.headers["x-charge"] == ran[0].headers["x-charge"]
    assert Charge.objects.count() == 1


@CLAIMS
def test_fifty_concurrent_requests_in_wait_mode_all_get_the_one_response(
    server: Gunicorn, cookie: str, claim: str
) -> None:
    url = f"/idem/wait{claim}/"
    replies = race(server.port, url, "race-2", {"amount": 7, "sleep": 1.0}, cookie)
    assert [r.status for r in replies] == [201] * 50
    assert sum(not r.replayed for r in replies) == 1
    assert len({r.body for r in replies}) == 1
    assert Charge.objects.count() == 1


def test_repeated_idempotency_key_headers_are_refused(server: Gunicorn) -> None:
    reply = send(server.port, "/idem/charge/", '"one"', extra_keys=('"two"',))
    assert reply.status == 400 and reply.problem == "idempotency-key-multiple"
    assert Charge.objects.count() == 0


def _idle_in_transaction_queries() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT query FROM pg_stat_activity "
            "WHERE datname = current_database() AND state = 'idle in transaction'"
        )
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.fault
@CLAIMS
def test_sigkill_after_the_effect_was_written_does_not_apply_it_twice(
    child_env: dict[str, str], tmp_path: Path, cookie: str, claim: str
) -> None:
    """With the default claim the retry waits for the killed attempt's lock (1 s) to lapse;
    claimed in the transaction, the key went with the killed session and the retry runs."""
    url = f"/idem/crash{claim}/"
    marker = tmp_path / "written"
    env = {**child_env, CRASH_MARKER_ENV: str(marker)}
    first = Gunicorn(env, tmp_path / "first.log", workers=1, threads=2).start()
    second: Gunicorn | None = None
    outcome: list[object] = []
    client = threading.Thread(
        target=lambda: outcome.append(_try_send(first.port, url, "crash-1", cookie))
    )
    try:
        client.start()
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the view never reached the point after its write"
        assert any("testapp_charge" in q for q in _idle_in_transaction_queries())
        first.kill()
        client.join(30)
        assert outcome and isinstance(outcome[0], Exception), "the first request was answered"
        second = Gunicorn(env, tmp_path / "second.log", workers=1, threads=2).start()
        retry = send(second.port, url, "crash-1", {"amount": 5}, cookie=cookie)
        deadline = time.monotonic() + 30
        while retry.status == 409 and time.monotonic() < deadline:
            time.sleep(0.2)  # the crashed attempt's lock (1 s) or its session has to end first
            retry = send(second.port, url, "crash-1", {"amount": 5}, cookie=cookie)
        assert retry.status == 201 and not retry.replayed
        again = send(second.port, url, "crash-1", {"amount": 5}, cookie=cookie)
        assert again.replayed and again.body == retry.body
        assert Charge.objects.count() == 1
    finally:
        first.kill()
        if second is not None:
            second.stop()


def _try_send(port: int, path: str, key: str, cookie: str) -> object:
    try:
        return send(port, path, key, {"amount": 5}, cookie=cookie)
    except Exception as exc:
        return exc
