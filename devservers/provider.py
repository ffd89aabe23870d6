"""A stand-in payment provider on loopback: a real HTTP server in a process of its own.

It behaves as Stripe's API does with ``Idempotency-Key``: the first request with a key makes
the effect (a charge, an email) and stores the answer; a request with a key it has seen gets
that stored answer again (``Idempotent-Replayed: true``) and makes nothing. It records every
request it received, so a test or the demo can tell "called twice, deduplicated" (a crash after
the call) from "charged twice" (a missing or unstable key).

``python -m devservers.provider PORT`` serves; :class:`Provider` starts one, dies with its owner
(``PR_SET_PDEATHSIG``), and reads its ledger. :func:`post` is the client the demo and the test
workflows call it with.

- ``POST /charges``, ``POST /emails``: JSON body in, ``{"id": ..., ...body}`` out (201).
- ``GET /ledger``: ``{"received": [{"path", "key"}...], "effects": {"/charges": n, ...}}``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from devservers.servers import _child_setup, free_port, reachable

__all__ = ["Provider", "post"]

EFFECT_PATHS = ("/charges", "/emails")


class _Ledger:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: list[dict[str, str]] = []
        self.answers: dict[tuple[str, str], bytes] = {}
        self.effects: dict[str, int] = {}


class _Handler(BaseHTTPRequestHandler):
    ledger = _Ledger()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: bytes, replayed: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if replayed:
            self.send_header("Idempotent-Replayed", "true")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path != "/ledger":
            self._answer(404, b"{}")
            return
        with self.ledger.lock:
            body = {"received": self.ledger.received, "effects": self.ledger.effects}
            self._answer(200, json.dumps(body).encode())

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        payload = json.loads(self.rfile.read(length) or b"{}")
        key = self.headers.get("Idempotency-Key", "")
        if self.path not in EFFECT_PATHS:
            self._answer(404, b"{}")
            return
        ledger = self.ledger
        with ledger.lock:
            ledger.received.append({"path": self.path, "key": key})
            stored = ledger.answers.get((self.path, key)) if key else None
            if stored is None:
                count = ledger.effects.get(self.path, 0) + 1
                ledger.effects[self.path] = count
                prefix = "ch" if self.path == "/charges" else "em"
                stored = json.dumps({**payload, "id": f"{prefix}_{count}"}).encode()
                if key:
                    ledger.answers[(self.path, key)] = stored
                self._answer(201, stored)
                return
        self._answer(201, stored, replayed=True)


def post(base_url: str, path: str, body: dict[str, Any], key: str, timeout: float = 10) -> Any:
    """POST JSON with an ``Idempotency-Key`` to the provider; its JSON answer."""
    if not base_url.startswith("http://"):
        raise ValueError(f"the provider is served over http://, not {base_url!r}")
    request = urllib.request.Request(  # noqa: S310 (http only, checked above)
        base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (loopback)
        return json.loads(response.read())


class Provider:
    """The provider process: ``start()``, ``url``, ``ledger()``, ``stop()``."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> Provider:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "devservers.provider", str(self.port)],
            preexec_fn=_child_setup(signal.SIGKILL),
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the provider exited with {self.proc.returncode}")
            if reachable(f"tcp://127.0.0.1:{self.port}", timeout=0.2):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the provider did not listen on {self.port} within {timeout}s")

    def ledger(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/ledger", timeout=10) as response:  # noqa: S310
            return dict(json.loads(response.read()))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def main(port: int) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]))
