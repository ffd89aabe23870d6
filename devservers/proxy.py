"""A user-space TCP proxy on loopback that breaks the network on command, unprivileged.

Fault tests put it between the library and a server they own, then switch its mode while
leases are held: the failures that matter for leases (a reply that never comes, a packet that
comes late, a connection that stays open but silent) cannot be made with SIGSTOP or a restart,
and iptables needs root. Modes apply to every connection, open or new, from the moment they
are set:

- :meth:`FaultProxy.pass_through`: bytes flow untouched;
- :meth:`FaultProxy.delay`: each chunk waits ``ms`` after it arrived, in each direction;
- :meth:`FaultProxy.blackhole`: connections are accepted and their bytes read and held, but
  nothing is forwarded (``replies_only``: requests reach the server, its answers are held);
  no FIN and no RST, so the client learns nothing until its own timeout. Held bytes are
  delivered, late, when the mode changes back;
- :meth:`FaultProxy.drop_next_reply`: the next chunk the server sends is discarded;
- :meth:`FaultProxy.reset_all`: every open connection is closed with an RST, both sides.

One thread per direction per connection, at most ``max_connections`` connections; every wait
is bounded by :data:`MAX_HOLD` and ends when the proxy closes. A chunk is what one ``recv``
returns: for request/reply protocols with one request in flight (Redis, PostgreSQL's simple
queries) that is one reply, which is what "drop one reply" means here.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass

__all__ = ["MAX_HOLD", "FaultProxy"]

#: The longest a chunk is ever held (blackhole or delay), so a forgotten mode cannot hang a run.
MAX_HOLD = 120.0
_CHUNK = 65536


@dataclass(frozen=True)
class _Mode:
    delay: float = 0.0
    hold_requests: bool = False
    hold_replies: bool = False


class _Link:
    """One proxied connection: the client's socket and ours to the server."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.closed = threading.Event()

    def reset(self, *, abort: bool = True) -> None:
        """Close both sides: with an RST (``SO_LINGER`` 0), as a middlebox's reset looks, or
        (``abort=False``) with a FIN, as a server that exits or drops a client cleanly does."""
        self.closed.set()
        for sock in (self.client, self.server):
            if abort:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            else:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class FaultProxy:
    """Listens on ``127.0.0.1:port`` and forwards to ``target_port`` on loopback."""

    def __init__(
        self, target_port: int, *, target_host: str = "127.0.0.1", max_connections: int = 256
    ) -> None:
        if target_host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError("the fault proxy forwards to loopback only")
        self.target = (target_host, target_port)
        self.max_connections = max_connections
        self._mode = _Mode()
        self._drop_replies = 0
        self._changed = threading.Condition()
        self._links: set[_Link] = set()
        self._closed = threading.Event()
        self.dropped = 0
        self.accepted = 0
        #: Chunks held by the blackhole right now (a test waits for its request to be in flight).
        self.holding = 0
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._acceptor.start()

    def url(self, scheme: str = "redis", path: str = "/0") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    # Modes -------------------------------------------------------------------------------

    def _set(self, mode: _Mode) -> None:
        with self._changed:
            self._mode = mode
            self._changed.notify_all()

    def pass_through(self) -> None:
        """Forward everything; bytes held by a blackhole are delivered now."""
        self._set(_Mode())

    def delay(self, ms: float) -> None:
        """Each chunk, either way, is forwarded ``ms`` milliseconds after it arrived."""
        self._set(_Mode(delay=ms / 1000))

    def blackhole(self, *, replies_only: bool = False) -> None:
        """Hold every byte (or only the server's), answering nothing and closing nothing."""
        self._set(_Mode(hold_requests=not replies_only, hold_replies=True))

    def drop_next_reply(self, count: int = 1) -> None:
        """Discard the next ``count`` chunks the server sends (any connection)."""
        with self._changed:
            self._drop_replies += count

    def reset_all(self) -> int:
        """RST every open connection; returns how many. New connections still pass."""
        return self._end_all(abort=True)

    def close_all(self) -> int:
        """Close every open connection cleanly (FIN), mid-reply or not; returns how many.
        New connections still pass."""
        return self._end_all(abort=False)

    def _end_all(self, *, abort: bool) -> int:
        with self._changed:
            links = list(self._links)
            self._links.clear()
        for link in links:
            link.reset(abort=abort)
        return len(links)

    @property
    def connections(self) -> int:
        with self._changed:
            return len(self._links)

    # Plumbing ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.connections >= self.max_connections:
                _Link(client, socket.socket()).reset()
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                _Link(client, socket.socket()).reset()  # the server is down: so is the proxy
                continue
            server.settimeout(None)
            client.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client, server)
            with self._changed:
                self._links.add(link)
                self.accepted += 1
            for source, sink, reply in ((client, server, False), (server, client, True)):
                threading.Thread(
                    target=self._pump, args=(link, source, sink, reply), daemon=True
                ).start()

    def _pump(self, link: _Link, source: socket.socket, sink: socket.socket, reply: bool) -> None:
        try:
            while not link.closed.is_set():
                data = source.recv(_CHUNK)
                arrived = time.monotonic()
                if not data:
                    break
                if not self._forward(link, reply, arrived):
                    continue
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._changed:
                self._links.discard(link)
            if not link.closed.is_set():
                # A clean close by one side closes the other side cleanly too (FIN, not RST).
                link.closed.set()
                for sock in (link.client, link.server):
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
                    with contextlib.suppress(OSError):
                        sock.close()

    def _forward(self, link: _Link, reply: bool, arrived: float) -> bool:
        """Wait out the current mode for one chunk; False if it is to be dropped."""
        deadline = arrived + MAX_HOLD
        with self._changed:
            if reply and self._drop_replies > 0:
                self._drop_replies -= 1
                self.dropped += 1
                return False
            counted = False
            try:
                while True:
                    mode = self._mode
                    held = mode.hold_replies if reply else mode.hold_requests
                    if held and not counted:
                        self.holding, counted = self.holding + 1, True
                    due = deadline if held else arrived + mode.delay
                    now = time.monotonic()
                    if now >= due or link.closed.is_set() or self._closed.is_set():
                        return not held or now >= deadline
                    self._changed.wait(min(due - now, 0.25))
            finally:
                if counted:
                    self.holding -= 1

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.reset_all()
        with self._changed:
            self._changed.notify_all()
        self._acceptor.join(timeout=2)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
