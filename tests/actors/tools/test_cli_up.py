"""``parkway up``: the embedded cluster (every actor in one process on the in-memory broker)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from parkway.actors.launch.processes import clean_environment
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow  # each runs `parkway up` as a process


def env() -> dict[str, str]:
    return clean_environment()


def test_up_starts_every_actor_and_each_answers(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "parkway.actors", "up", "--for", "0.5"],
        env=env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    table = [
        line.split()
        for line in result.stderr.splitlines()
        if line.startswith(("agent", "controller", "policy", "resources", "tq", "trainer"))
    ]
    assert sorted(f"{row[0]}/{row[1]}" for row in table) == [
        "agent/0",
        "agent/1",
        "controller/0",
        "policy/0",
        "resources/0",
        "resources/1",
        "tq/0",
        "trainer/0",
    ]
    assert "8 actors of run 'default' on memory:// answer" in result.stderr
    assert result.stderr.count('"event":"actor_stopped"') == 8


def test_up_stops_cleanly_on_sigterm(tmp_path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "parkway.actors", "up", "--topology", "tq=1,agent=1"],
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
        [sys.executable, "-m", "parkway.actors", "up", "--topology", "wizard=2"],
        env=env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "topology item 'wizard=2'" in result.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_up_serves_the_metrics_of_every_actor_from_one_endpoint(tmp_path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "parkway.actors", "up", "--topology", "tq=1,agent=2"],
        env={**env(), "PARKWAY_METRICS_PORT": str(port)},
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 30
        for line in proc.stderr:
            if "answer; Ctrl-C stops them" in line or time.monotonic() > deadline:
                break
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    families = {f.name: f for f in text_string_to_metric_families(text)}
    actors = {(s.labels["role"], s.labels["replica"]) for s in families["parkway_messages"].samples}
    assert actors == {("tq", "0"), ("agent", "0"), ("agent", "1")}  # each answered a Status and a Probe
    assert text.count("# TYPE parkway_messages_total counter") == 1
    assert [s.labels for s in families["parkway_rollouts_in_flight"].samples] == [
        {"role": "agent", "replica": "0"},
        {"role": "agent", "replica": "1"},
    ]
    assert len(families["parkway_broker_reconnects"].samples) == 1  # one per process, not per actor
    # Stopped: the port is free for the next process.
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", port))
        sock.listen()


def test_a_metrics_port_in_use_is_a_clear_error(tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "parkway.actors", "up", "--for", "0.1", "--metrics-port", str(port)],
            env=env(),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2 and f"cannot serve metrics on port {port}" in result.stderr
