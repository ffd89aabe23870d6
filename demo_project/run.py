"""Run the demo end to end: servers (configured or throwaway), migrations, scenarios.

``python -m demo_project.run [manage.py arguments]``; with no arguments it runs ``demo``.
"""

from __future__ import annotations

import os
import subprocess
import sys

from devservers import PostgresServer, RedisServer, configured_or_throwaway


def main(argv: list[str]) -> int:
    owned: list[PostgresServer | RedisServer] = []
    try:
        urls = configured_or_throwaway(owned)
        for server in owned:
            print(f"started a throwaway {type(server).__name__[:-6]} at {server.url}")
        env = {**os.environ, **urls, "DJANGO_SETTINGS_MODULE": "demo_project.settings"}
        manage = [sys.executable, "manage.py"]
        subprocess.run([*manage, "migrate", "--verbosity", "0"], env=env, check=True)
        return subprocess.run([*manage, *(argv or ["demo"])], env=env, check=False).returncode
    finally:
        for server in owned:
            server.destroy()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
