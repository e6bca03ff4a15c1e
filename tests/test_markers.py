"""The marker check (``tests/support/markers.py``) fails a test that talks to RabbitMQ without the
``rabbitmq`` marker or starts a process without ``slow`` (itself, or through a shared fixture set up for
an earlier test), and passes the same tests marked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

CLOSED = 1  # a port nothing listens on: the inner tests try to connect, the real broker is not touched

INNER = f"""
import asyncio
import socket
import subprocess
import sys

import pytest


def knock() -> None:
    with socket.socket() as sock:
        sock.settimeout(1)
        try:
            sock.connect(("127.0.0.1", {CLOSED}))
        except OSError:
            pass


async def knock_async() -> None:
    try:
        await asyncio.open_connection("127.0.0.1", {CLOSED})
    except OSError:
        pass


def test_talks_unmarked():
    knock()


def test_talks_through_asyncio_unmarked():
    asyncio.run(knock_async())


@pytest.mark.rabbitmq
def test_talks_marked():
    knock()


def test_spawns_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_spawns_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_does_neither():
    pass


@pytest.fixture(scope="module")
def started():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_first_user_of_a_shared_fixture_marked(started):
    pass


def test_later_user_of_it_unmarked(started):
    pass  # the processes started for the first test serve this one too
"""


@pytest.mark.slow  # runs an inner pytest, which starts processes of its own
def test_unmarked_broker_talk_and_processes_fail_and_marked_ones_pass(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "PARKWAY_TEST_AMQP_URL": f"amqp://guest:guest@127.0.0.1:{CLOSED}/",
    }
    inner = ["-p", "tests.support.markers", "-p", "no:randomly", "-p", "no:cacheprovider", "-c", os.devnull]
    quiet = ["-W", "ignore::pytest.PytestUnknownMarkWarning"]  # the inner run registers no markers
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *inner, *quiet, "--rootdir", str(tmp_path), "test_inner.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "4 failed, 4 passed" in out, out
    failed = sorted(line.split("::")[1].split()[0] for line in out.splitlines() if line.startswith("FAILED"))
    assert failed == [
        "test_later_user_of_it_unmarked",
        "test_spawns_unmarked",
        "test_talks_through_asyncio_unmarked",
        "test_talks_unmarked",
    ]
    assert f"connected to the AMQP port at 127.0.0.1:{CLOSED}, but it is not marked 'rabbitmq'" in out
    assert "started the process `python" in out and "but it is not marked 'slow'" in out
    assert "test_later_user_of_it_unmarked uses the fixture 'started', which started the process" in out
