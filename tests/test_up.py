"""``parkway up``: the embedded cluster (every actor in one process on the in-memory broker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PARKWAY_")}


def test_up_starts_every_actor_and_each_answers(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "parkway.actors.cli", "up", "--for", "0.5"],
        env=env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    table = [line for line in result.stderr.splitlines() if line[:1].isalpha() and "/" in line.split()[0]]
    assert sorted(line.split()[0] for line in table) == [
        "agent/0",
        "agent/1",
        "controller/0",
        "policy/0",
        "resources/0",
        "resources/1",
        "tq/0",
    ]
    assert "7 actors of run 'default' on memory:// answer" in result.stderr
    assert result.stderr.count('"event":"actor_stopped"') == 7


def test_up_stops_cleanly_on_sigterm(tmp_path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "parkway.actors.cli", "up", "--topology", "tq=1,agent=1"],
        env=env(),
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    for line in proc.stderr:
        if "answer; Ctrl-C stops them" in line or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(30) == 0
    assert rest.count('"event":"actor_stopped"') == 2


def test_a_bad_topology_is_a_clear_error(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "parkway.actors.cli", "up", "--topology", "wizard=2"],
        env=env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "topology item 'wizard=2'" in result.stderr
