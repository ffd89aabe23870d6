"""``scripts/demo``'s runner: its own servers, a printed admin login, a clean stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from devservers import free_port, reachable
from tests.harness import ROOT
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def demo_env(**extra: str) -> dict[str, str]:
    """No configured servers (the demo starts its own), no test settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def test_a_configured_server_that_does_not_answer_is_an_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "demo_project.run", "demo", "--list"],
        cwd=ROOT,
        env=demo_env(DATABASE_URL=f"postgres://demo:pw@127.0.0.1:{free_port()}/demo"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert (
        line.startswith("demo: DATABASE_URL is set to postgres://127.0.0.1:") and "pw" not in line
    )


_DEMO_TASKS_ROUTED = """
import warnings

from celery.exceptions import CDeprecationWarning

warnings.simplefilter("error", CDeprecationWarning)
from demo_project.celery import app
from demo_project.shop import tasks

app.finalize()  # binds every task: Celery 5.7 warns here of a queue set as a task attribute
for task in (tasks.finalise_invoice, tasks.charge_invoice, tasks.rebuild_report,
             tasks.nightly_summary):
    assert app.amqp.router.route({}, task.name)["queue"].name == tasks.QUEUE, task.name
for customer in ("a", "b", "c", "d", "e"):
    queue = tasks.sync_customer.partition_queue((customer,), {})
    assert queue.startswith("demo-customer."), queue
    assert app.amqp.router.route({"queue": queue}, tasks.sync_customer.name)["queue"].name == queue
print("routed")
"""


def test_the_demo_routes_its_tasks_with_task_routes_not_a_deprecated_queue_attribute() -> None:
    """Celery 5.7 deprecates ``queue=`` as a task option (``CDeprecationWarning``: "The 'queue'
    task attribute is deprecated ... Use the task_routes setting instead."): the demo's tasks
    reach its queue through ``CELERY_TASK_ROUTES``, and a partitioned task's per-call queue
    still wins over the route. (The Celery scenario runs them on real workers.)"""
    done = subprocess.run(
        [sys.executable, "-c", _DEMO_TASKS_ROUTED],
        cwd=ROOT,
        env=demo_env(DJANGO_SETTINGS_MODULE="demo_project.settings"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == "routed", done.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_runserver_prints_a_login_and_stops_cleanly_on_a_signal(sig: signal.Signals) -> None:
    """The admin login works, and SIGTERM / Ctrl-C leave no traceback and no server behind."""
    port = free_port()
    demo = subprocess.Popen(
        [sys.executable, "-m", "demo_project.run", "runserver", f"127.0.0.1:{port}"],
        cwd=ROOT,
        env=demo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append(line)
            if "password" in line:
                break
        login = re.search(r"admin: (\S+)  user (\S+)  password (\S+)", "".join(lines))
        assert login, "".join(lines)
        assert login[1] == f"http://127.0.0.1:{port}/admin/"
        servers = re.findall(r"started a throwaway \w+ at (\S+)", "".join(lines))
        assert len(servers) == 2 and all(reachable(url) for url in servers)
        wait_until(lambda: reachable(f"tcp://127.0.0.1:{port}"), 60, "runserver to listen")
        assert logs_in(port, login[2], login[3])
        demo.send_signal(sig)
        assert demo.wait(30) == 128 + sig
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    rest = demo.stdout.read() if demo.stdout else ""
    assert "Traceback" not in "".join(lines) + rest, rest
    time.sleep(0.2)
    assert not any(reachable(url) for url in [*servers, f"tcp://127.0.0.1:{port}"])


def logs_in(port: int, username: str, password: str) -> bool:
    """A POST to the admin's login form with the printed credentials lands on the index."""
    import http.cookiejar
    import urllib.parse
    import urllib.request

    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    url = f"http://127.0.0.1:{port}/admin/login/"
    page = opener.open(url, timeout=30).read().decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert token, page[:500]
    form = {"csrfmiddlewaretoken": token[1], "username": username, "password": password}
    request = urllib.request.Request(
        url + "?next=/admin/",
        data=urllib.parse.urlencode(form).encode(),
        headers={"Referer": url},
    )
    answer = opener.open(request, timeout=30)
    return bool(answer.geturl().endswith("/admin/") and "Log out" in answer.read().decode())
