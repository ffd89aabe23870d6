"""Run by ``test_clock_faults``: threads of one process read the wall clock at once.

Started under a :class:`devservers.clock.FakeClock` set far behind, it prints how many reads
it made and how many of them came out past ``LIMIT`` (seconds since the epoch), i.e. showed the
true time instead of the faked one. The reads go through libc's ``clock_gettime`` with ctypes,
which lets go of the GIL during the call, so the threads really are inside the preloaded
library together, as a JVM's threads are.

Usage: ``python tests/clock_readers.py LIMIT SECONDS``.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time

CLOCK_REALTIME = 0
THREADS = 8


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def main(limit: float, seconds: float) -> None:
    clock_gettime = ctypes.CDLL(None).clock_gettime
    counts: list[tuple[int, int]] = []
    deadline = time.monotonic() + seconds  # monotonic: not faked

    def read() -> None:
        now, reads, wrong = _Timespec(), 0, 0
        while time.monotonic() < deadline:
            clock_gettime(CLOCK_REALTIME, ctypes.byref(now))
            reads += 1
            wrong += now.tv_sec > limit
        counts.append((reads, wrong))

    threads = [threading.Thread(target=read) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(sum(r for r, _ in counts), sum(w for _, w in counts))


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[2]))
