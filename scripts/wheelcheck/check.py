"""Prove the distributions, not the checkout: build, validate, install the wheel, load the admin.

Run by ``scripts/test`` before pytest (``scripts/check-wheel``), with the project's ``.venv``
Python and the repository on ``PYTHONPATH``. Every test after this one imports the editable
checkout, where a file missing from ``package-data`` (the admin's templates, once) goes
unnoticed; here the wheel is installed, not linked, into a fresh virtualenv that has nothing
but it and its dependencies, and ``admin_pages.py`` GETs every admin page of both apps from
there against a real PostgreSQL database.

The test suite runs on one Django series (the project's ``.venv``); the wheel claims more
(``Django>=5.2,<6.1``). So the wheel is also installed with each further claimed series
(:data:`MORE_DJANGOS`) into a virtualenv of its own, made with a Python that series supports
(Django 6 needs 3.12), where the same script migrates, runs ``check`` and ``makemigrations
--check`` and loads every admin page. A machine without such a Python skips that series and
says so.

Downloads go through pip's own cache, so after the first run the install is offline-fast.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

from devservers import PostgresServer, RedisServer, configured_or_throwaway

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PACKAGES = ("leases", "idempotency")
#: Django series the wheel claims besides the test suite's, and the Python each needs.
MORE_DJANGOS = [("6.0", (3, 12))]
#: Where Pythons other than the running one are looked for (PATH first).
PYTHON_GLOBS = ("/root/.pyenv/versions/3.*/bin/python3", "/usr/local/bin/python3.*")
#: Top-level names a wheel of this project must never contain.
FORBIDDEN = ("tests", "demo_project", "devservers", "benchmarks", "docs", "scripts")


@contextmanager
def step(title: str) -> Iterator[None]:
    """Announce a step and say how long it took: this check runs on every CI run."""
    print(f"-- {title}", flush=True)
    started = time.monotonic()
    yield
    print(f"   {time.monotonic() - started:.1f} s", flush=True)


def outside_env() -> dict[str, str]:
    """This environment without ``PYTHONPATH`` (which names the checkout: pip would take the
    editable install's metadata there for the wheel already installed) or Django's settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "DJANGO"))}


def run(cmd: list[str], *, quiet: bool = True, **kwargs: object) -> None:
    """Run ``cmd``; its output is shown only when it fails (or when not ``quiet``)."""
    done = subprocess.run(
        cmd,
        check=False,
        stdout=subprocess.PIPE if quiet else None,
        stderr=subprocess.STDOUT if quiet else None,
        text=True,
        **kwargs,  # type: ignore[call-overload]
    )
    if done.returncode != 0:
        raise SystemExit(f"{done.stdout or ''}\nfailed ({done.returncode}): {' '.join(cmd)}")


def source_tree(into: Path) -> Path:
    """The checkout's files as git sees them (tracked, and new ones not ignored), copied.

    Never built in place: the editable install leaves ``django_leases.egg-info`` in the
    checkout, and setuptools reuses its ``SOURCES.txt``, which would put files in the wheel
    that the project's configuration does not (that hid the missing admin templates).
    """
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is not there
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name, follow_symlinks=False)
    return into


def build(out: Path) -> tuple[Path, Path]:
    with step("python -m build (sdist, then the wheel from the sdist)"):
        source = source_tree(out.parent / "src")
        run([sys.executable, "-m", "build", "--outdir", str(out), str(source)])
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    with step("twine check --strict"):
        run([sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)])
    return wheel, sdist


def shipped_data_files() -> set[str]:
    """The package's non-Python files in git (templates, static, py.typed): all must ship."""
    listed = subprocess.run(
        ["git", "ls-files", "--", *PACKAGES],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return {name for name in listed if not name.endswith(".py")}


def check_contents(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {name.split("/", 1)[0] for name in names}
    leaked = sorted(tops & set(FORBIDDEN))
    missing = sorted(shipped_data_files() - names)
    licensed = any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    problems = [f"must not contain {top}/" for top in leaked]
    problems += [f"lacks {name}" for name in missing]
    problems += [] if licensed else ["lacks its LICENSE"]
    if problems:
        raise SystemExit(f"{wheel.name}: " + "; ".join(problems))


def check_sdist(sdist: Path) -> None:
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[-1] for name in archive.getnames()}
    missing = sorted({"LICENSE", "CHANGELOG.md", "README.md"} - names)
    if missing:
        raise SystemExit(f"{sdist.name} lacks {', '.join(missing)}")


def fresh_install(
    wheel: Path, venv: Path, base: str = sys.executable, django: str | None = None
) -> Path:
    """A virtualenv of ``base`` with only the wheel and its dependencies (``django``: that
    series of Django, e.g. ``6.0``); its Python."""
    run([base, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check"]
    pinned = [f"Django=={django}.*"] if django else []
    run([*pip, "install", "--quiet", f"{wheel}[binary]", *pinned], env=outside_env())
    return python


def python_at_least(version: tuple[int, int]) -> str | None:
    """A Python interpreter of at least ``version`` on this machine, if there is one."""
    names = [f"python3.{minor}" for minor in range(version[1], version[1] + 4)]
    found = [shutil.which(name) for name in names]
    candidates = [path for path in found if path]
    for pattern in PYTHON_GLOBS:
        candidates += sorted(glob.glob(pattern))
    for candidate in candidates:
        done = subprocess.run(
            [candidate, "-c", "import sys, venv; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode == 0 and tuple(map(int, done.stdout.split())) >= version:
            return candidate
    return None


@contextmanager
def scratch_database() -> Iterator[str]:
    """A new database on the configured (else a throwaway) PostgreSQL, dropped afterwards."""
    owned: list[PostgresServer | RedisServer] = []
    try:
        server_url = configured_or_throwaway(owned, ("DATABASE_URL",))["DATABASE_URL"]
        name = f"leases_wheelcheck_{secrets.token_hex(4)}"
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        try:
            yield urlunsplit(urlsplit(server_url)._replace(path=f"/{name}"))
        finally:
            with psycopg.connect(server_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        for server in owned:
            server.destroy()


def load_admin_pages(python: Path, database_url: str, workdir: Path) -> None:
    env = {**outside_env(), "WHEELCHECK_DATABASE_URL": database_url}
    # cwd outside the checkout and no PYTHONPATH: `import leases` can only find the wheel.
    run([str(python), str(HERE / "admin_pages.py")], quiet=False, cwd=workdir, env=env)


def list_more_djangos() -> int:
    """``--more-djangos``: each further claimed series and the Python to run it with, one
    ``series python`` line each (``-`` for none on this machine), for ``scripts/check-django``
    (so that the series, and how a Python is found for one, are written here only)."""
    for series, version in MORE_DJANGOS:
        print(series, python_at_least(version) or "-")
    return 0


def main() -> int:
    if sys.argv[1:] == ["--more-djangos"]:
        return list_more_djangos()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="leases-wheelcheck-"))
    try:
        wheel, sdist = build(work / "dist")
        with step("contents: the package data and LICENSE, nothing of the repository"):
            check_contents(wheel)
            check_sdist(sdist)
        with step(f"install {wheel.name}[binary] into a fresh virtualenv (not editable)"):
            python = fresh_install(wheel, work / "venv")
        pages = "every admin page of leases and idempotency, from the installed wheel"
        with step(pages), scratch_database() as database_url:
            load_admin_pages(python, database_url, work)
        for series, version in MORE_DJANGOS:
            base = python_at_least(version)
            if base is None:
                print(f"-- SKIPPED Django {series}: no Python {'.'.join(map(str, version))}+")
                continue
            venv = work / f"venv-django-{series}"
            with step(f"install the wheel with Django {series} ({base})"):
                python = fresh_install(wheel, venv, base, series)
            with step(f"Django {series}: {pages}"), scratch_database() as database_url:
                load_admin_pages(python, database_url, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"-- the wheel works ({time.monotonic() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
