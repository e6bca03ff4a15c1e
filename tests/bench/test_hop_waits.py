"""``bench/hop_waits.py``: what a process is from its command line, its scheduler rates between two
samples, and a real run: a command measured while an idle process pings itself through RabbitMQ (no
time is asserted, only that each sampler measured something)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.rabbit import AMQP_URL

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ is scripts

import hop_waits

BENCH = Path(hop_waits.__file__).parent


def test_a_process_is_named_by_its_role_and_replica() -> None:
    actor = "/usr/bin/python -m parkway.actors actor agent --replica 1 --config /tmp/run.yaml"
    assert hop_waits.process_label(actor, command_pid=7, pid=9) == "agent/1"
    assert hop_waits.process_label("/usr/lib/erlang/erts/bin/beam.smp -W w -- -root", 7, 9) == "rabbitmq"
    assert hop_waits.process_label("python bench/snapshot_pause.py", command_pid=9, pid=9) == "command"
    assert hop_waits.process_label("sshd: root@pts/0", command_pid=7, pid=9) is None


def test_rates_are_between_a_processs_first_and_last_sample() -> None:
    # 2 s of wall time: 0.5 s on a core, 0.2 s waiting for one over 100 timeslices.
    samples = [
        (10.0, 1_000_000_000, 0, 50),
        (11.0, 1_200_000_000, 50_000_000, 90),
        (12.0, 1_500_000_000, 200_000_000, 150),
    ]
    assert hop_waits.rates(samples) == {
        "seconds": 2.0,
        "cpu": 0.25,
        "wait_ms_per_s": 100.0,
        "slices_per_s": 50.0,
        "wait_per_slice_us": 2000.0,
    }
    assert hop_waits.rates(samples[:1]) is None  # under a second: no rate


@pytest.mark.slow
@pytest.mark.rabbitmq
@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs Linux schedstat")
def test_a_command_is_measured_with_the_broker_pinged_alongside(tmp_path: Path) -> None:
    out = tmp_path / "waits.json"
    work = "import time\nend = time.time() + 2.5\nwhile time.time() < end: pass"  # a busy command
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "hop_waits.py"),
            "--every",
            "0.02",
            "--out",
            str(out),
            "--",
            sys.executable,
            "-c",
            work,
        ],
        env={**os.environ, "PARKWAY_BENCH_AMQP_URL": AMQP_URL},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["exit_code"] == 0 and record["ping"]["pings"] >= 10
    assert "broker ping every 0.02s" in done.stdout
    [command] = [p for p in record["processes"] if p["process"] == "command"]
    # It ran on a core for about its whole life (a share, not a duration), and got timeslices.
    assert command["cpu"] > 0.3 and command["slices_per_s"] > 0
    assert any(p["process"] == "rabbitmq" for p in record["processes"])  # the broker's VM is watched
