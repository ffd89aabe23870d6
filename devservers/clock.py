"""A wall clock that a test steps forward and backward under a running server (libfaketime).

Clock faults are the other half of what breaks distributed locks (Kleppmann's "How to do
distributed locking"; Redis' own warnings): an NTP step or an operator's ``date -s`` moves a
server's ``CLOCK_REALTIME`` while its monotonic clock runs on. :class:`FakeClock` reproduces
exactly that for one process tree, unprivileged: the server starts with libfaketime preloaded,
reading its offset from a file on every clock call (``FAKETIME_NO_CACHE``; once a second for a
threaded server, below), and :meth:`FakeClock.jump` rewrites that file, so the server's wall
clock steps while it runs. ``FAKETIME_DONT_FAKE_MONOTONIC`` leaves ``CLOCK_MONOTONIC`` alone, as
a real step does.

Three things the obvious setup gets wrong, found the hard way:

- Debian's ``redis-server`` links the system ``libjemalloc``; jemalloc reads the clock inside
  ``malloc`` and libfaketime allocates while it initialises, so the server aborts with
  "recursive calls to clock_gettime()" (with either library, with or without monotonic faking).
  Preloading ``libc.so.6`` after libfaketime binds ``malloc`` to glibc's (symbol lookup takes
  preloaded objects before a program's own dependencies), which ends the recursion; jemalloc
  stays loaded only for Redis' statistics calls.
- The offset file is replaced atomically (write, then rename): libfaketime re-reads it on every
  call, and a half-written file would be read as no offset at all.
- Re-reading it on every call (``FAKETIME_NO_CACHE``) is not safe when many threads read the
  clock at once: libfaketime 0.9.10 then now and again returns the true time instead of the
  faked one (measured: 25 of 404,000 reads by eight threads in three seconds, 4,988 of 5.7
  million from C; none with a single thread). A JVM reads the clock from many threads, so a
  ZooKeeper server stamped a write now and then with the unstepped time. ``threaded=True``
  re-reads the file at most once a second instead (``FAKETIME_CACHE_DURATION=0``: at the first
  read in each new second of real time), which showed no wrong read in 86 million; a step then
  shows up to a second late (:attr:`FakeClock.lag`), and a test waits until the server shows it.

The library is found like the servers' binaries: ``LEASES_LIBFAKETIME``, else the distribution's
paths (``apt-get install libfaketime``); :func:`libfaketime` returns ``None`` when it is missing,
and tests skip with that reason.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["FakeClock", "libfaketime"]

_CANDIDATES = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/lib64/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
    "/opt/homebrew/lib/faketime/libfaketime.1.dylib",
)


def libfaketime() -> str | None:
    """The path of libfaketime's preload library, or ``None`` when it is not installed."""
    configured = os.environ.get("LEASES_LIBFAKETIME")
    if configured:
        return configured if Path(configured).exists() else None
    for pattern in _CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            return path
    return None


class FakeClock:
    """An offset file and the environment that makes a process's wall clock follow it.

    Start a server with ``env=clock.env()``, then :meth:`jump` its wall clock by any number of
    seconds, any number of times, while it runs. The file is readable by every user, because
    PostgreSQL runs as an unprivileged user when the tests run as root.

    ``threaded``: the server reads its clock from many threads at once (a JVM); see the module's
    notes. Single-threaded servers (PostgreSQL's backends, Redis) see a step at their next read.
    """

    def __init__(self, *, threaded: bool = False) -> None:
        library = libfaketime()
        if library is None:
            raise RuntimeError(
                "libfaketime is not installed (apt-get install libfaketime), or "
                "LEASES_LIBFAKETIME names a file that does not exist"
            )
        self.library = library
        self.threaded = threaded
        #: The most real seconds a step may take to show in the server (0: its next read).
        self.lag = 1.0 if threaded else 0.0
        self.dir = Path(tempfile.mkdtemp(prefix="leases-clock-"))
        self.dir.chmod(0o755)
        self.file = self.dir / "faketimerc"
        #: The current offset from the real wall clock, in seconds.
        self.offset = 0.0
        self._write(0.0)

    def env(self) -> dict[str, str]:
        """Environment variables for a process whose wall clock this object steps."""
        return {
            "LD_PRELOAD": f"{self.library} libc.so.6",
            "FAKETIME_TIMESTAMP_FILE": str(self.file),
            **({"FAKETIME_CACHE_DURATION": "0"} if self.threaded else {"FAKETIME_NO_CACHE": "1"}),
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    def jump(self, seconds: float) -> None:
        """Step the wall clock by ``seconds`` (negative: backward) from where it is now."""
        self.set(self.offset + seconds)

    def set(self, offset: float) -> None:
        """Put the wall clock ``offset`` seconds away from the real one (0: back to true)."""
        self._write(offset)
        self.offset = offset

    def _write(self, offset: float) -> None:
        staging = self.dir / "faketimerc.new"
        staging.write_text(f"{offset:+.3f}\n")
        staging.chmod(0o644)
        staging.replace(self.file)

    def destroy(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> FakeClock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()
