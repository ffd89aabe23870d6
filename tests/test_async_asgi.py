"""The async API end to end: a real uvicorn process, async views, concurrent httpx requests.

One uvicorn worker is one event loop, so every request below is a coroutine on the same loop:
the leases they take (``alease``), their fenced writes and ``@idempotent`` all have to work
without blocking it, and the shared history checker decides whether the fence held.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import import_module
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from devservers import free_port
from tests.checker import check_history, new_register
from tests.lease_backends import lease_backend
from tests.testapp.models_fencing import FencedRegister
from tests.testapp.models_idempotency import Charge

__all__ = ["lease_backend"]  # a fixture, re-exported for pytest

pytestmark = pytest.mark.slow


class Uvicorn:
    """``uvicorn`` serving Django's ASGI application with the test settings, on a free port."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log, self.port = env, log, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> Uvicorn:
        args = [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "django.core.asgi:get_asgi_application",
            "--host=127.0.0.1",
            f"--port={self.port}",
            "--no-access-log",
            "--lifespan=off",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, env=self.env, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"uvicorn exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/no-such-page/", timeout=1).status_code == 404:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError(f"uvicorn did not serve in {timeout}s: {self.log.read_text()[-2000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


@pytest.fixture
def server(child_env: dict[str, str], tmp_path: Path) -> Iterator[Uvicorn]:
    live = Uvicorn(child_env, tmp_path / "uvicorn.log")
    try:
        yield live.start()
    finally:
        live.stop()


@pytest.fixture
def cookie(transactional_db: None) -> str:
    """A saved session's cookie: keyed requests need an identity (see ``test_idempotency``)."""
    session = import_module(settings.SESSION_ENGINE).SessionStore()
    session.create()
    return f"{settings.SESSION_COOKIE_NAME}={session.session_key}"


def test_concurrent_requests_lease_and_write_through_the_fence(
    server: Uvicorn, lease_backend: str
) -> None:
    """20 requests, one loop, one lease name: never two inside at once, and the checker
    accepts the register's history (tokens increase with every write that took effect)."""
    register = new_register("aio")

    async def main() -> list[dict[str, int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            replies = await asyncio.gather(
                *(
                    client.post(
                        f"/aio/register/{register}/",
                        params={"backend": lease_backend, "writer": f"w{i}"},
                    )
                    for i in range(20)
                )
            )
        assert [r.status_code for r in replies] == [200] * 20, replies[0].text[-2000:]
        return [r.json() for r in replies]

    results = asyncio.run(main())
    tokens = sorted(result["token"] for result in results)
    assert len(set(tokens)) == 20, tokens
    assert all(result["accepted"] for result in results)
    assert max(result["most"] for result in results) == 1
    summary = check_history(register, tokens)
    assert summary.accepted == 20


@pytest.mark.parametrize(
    "url", ["/aio/charge/", "/idem/aio-charge-tx/"], ids=["row_claim", "claim_in_transaction"]
)
def test_fifty_concurrent_duplicate_requests_make_one_effect(
    server: Uvicorn, cookie: str, url: str
) -> None:
    """50 requests with one key against an async ``@idempotent`` view that leases and writes
    fenced: one effect, the rest refused (409) or replayed byte for byte."""
    body = json.dumps({"account": new_register("acct"), "amount": 3, "sleep": 1.0})
    headers = {"Idempotency-Key": "aio-race-1", "Cookie": cookie}

    async def main() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, headers=headers) as client:
            replies = await asyncio.gather(*(client.post(url, content=body) for _ in range(50)))
            later = await client.post(url, content=body)
        return list(replies), later

    replies, later = asyncio.run(main())
    statuses = [r.status_code for r in replies]
    ran = [r for r in replies if r.status_code == 201 and "idempotent-replayed" not in r.headers]
    assert len(ran) == 1, statuses
    assert set(statuses) <= {201, 409}, statuses
    assert 409 in statuses, "no request overlapped the first one: the race did not happen"
    assert later.status_code == 201 and later.headers["idempotent-replayed"] == "true"
    assert later.content == ran[0].content
    assert Charge.objects.count() == 1
    account = json.loads(body)["account"]
    row = FencedRegister.objects.get(name=account)
    assert row.value == "charged" and row.fencing_token == ran[0].json()["token"]
