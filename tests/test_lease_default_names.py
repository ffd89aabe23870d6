"""A bare ``@lease`` names the lease after the function, the same in every process: a module
run with ``python -m`` as when imported, and a script run by path (which has no such name)
refused rather than named ``__main__.<func>``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

#: A job module: ``run`` holds its bare-named lease and reports whether it holds ``argv[1]``
#: (acquiring a name this thread holds raises ``LeaseAlreadyHeld``; nothing waits).
JOB = """
import sys

import django

django.setup()

from leases import LeaseAlreadyHeld, acquire, lease


@lease
def run():
    try:
        acquire(sys.argv[1], timeout=0).release()
    except LeaseAlreadyHeld:
        print("held as", sys.argv[1])
    else:
        print("not held as", sys.argv[1])


if __name__ == "__main__":
    run()
"""


def _run(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env={**env, "PYTHONPATH": os.pathsep.join([str(cwd), env["PYTHONPATH"]])},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_module_run_with_dash_m_names_its_lease_as_when_imported(
    child_env: dict[str, str], tmp_path: Path
) -> None:
    """``python -m jobs.nightly`` and a worker importing ``jobs.nightly`` must exclude each
    other; the module used to be named ``__main__`` there, so they held different leases."""
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "__init__.py").write_text("")
    (tmp_path / "jobs" / "nightly.py").write_text(JOB)
    as_main = _run(child_env, tmp_path, "-m", "jobs.nightly", "jobs.nightly.run")
    imported = _run(
        child_env,
        tmp_path,
        "-c",
        "import sys; sys.argv[1:] = ['jobs.nightly.run']; import jobs.nightly; jobs.nightly.run()",
    )
    for done in (as_main, imported):
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == "held as jobs.nightly.run", done.stdout


def test_a_script_run_by_path_is_refused_a_lease_named_main(
    child_env: dict[str, str], tmp_path: Path
) -> None:
    """Every script's ``run`` would share ``__main__.run``, and the same function imported
    elsewhere would get another lease: the bare name is refused when the function is
    decorated, before anything runs, and the error says what to do."""
    (tmp_path / "nightly.py").write_text(JOB)
    done = _run(child_env, tmp_path, "nightly.py", "__main__.run")
    assert done.returncode == 1
    assert "held as" not in done.stdout, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("leases.errors.InvalidLeaseName: invalid lease name '__main__.run'"), (
        done.stderr[-2000:]
    )
    assert '(@lease("...")) or run the script as a module' in last
