"""The nemesis soak (``./scripts/soak``, :mod:`tests.soak`) stays runnable: a few seconds of it
on one backend, and its replay of a saved history finds what the checker finds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import soak

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.fault, pytest.mark.slow]


def test_a_short_soak_on_redis_injects_faults_and_finds_no_violation(tmp_path: Path) -> None:
    """Two workers (one proxied) for 5 s with a fault every ~0.3 s: the summary counts critical
    sections and faults, and the checker found nothing (exit status 0)."""
    args = ["--backends", "redis", "--seconds", "5", "--procs", "2", "--interval", "0.3"]
    run = subprocess.run(
        [sys.executable, "-m", "tests.soak", *args, "--seed", "7", "--save-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "soak: seed 7" in run.stdout
    line = re.search(
        r"soak redis: (\d+) critical sections, (\d+) faults .*, (\d+) violations", run.stdout
    )
    assert line, run.stdout
    sections, faults, violations = map(int, line.groups())
    assert sections > 0 and faults > 0 and violations == 0, run.stdout
    assert "0 workers broke the error contract" in run.stdout, run.stdout
    assert "soak total:" in run.stdout
    assert not list(tmp_path.iterdir()), "a history was saved although nothing failed"


def test_replay_of_a_saved_history_reports_the_violation(tmp_path: Path) -> None:
    """``--check FILE`` runs the checker on a saved history: one token accepted from two
    writers is found again."""
    rows = [
        {"seq": 1, "writer": "a", "token": 1, "accepted": True, "outcome": "accepted"},
        {"seq": 2, "writer": "b", "token": 1, "accepted": True, "outcome": "accepted"},
    ]
    for row in rows:
        row.update(stored=None, value=f"{row['writer']}@1", at=None, register="r")
    saved = tmp_path / "history.json"
    saved.write_text(json.dumps(rows))
    assert soak.replay(str(saved)) == 1
    saved.write_text(json.dumps(rows[:1]))
    assert soak.replay(str(saved)) == 0
