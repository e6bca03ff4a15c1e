"""``parkway report`` on the real RabbitMQ: the picture of a run read back from the run's log stream.

Every actor runs in its own process and publishes its lines to the stream; the controller (``parkway
run``) kills itself with SIGKILL right after publishing its second snapshot, the rest of the cluster is
killed with it, a fresh cluster restores the snapshot and finishes. ``parkway report RUN --broker URL``
then draws it: the crash is inferred (a SIGKILL leaves no last word), the restore is of that snapshot.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import pytest

from tests.support.crash_cluster import CONFIG, cluster, start_driver
from tests.support.processes import actor_env

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


async def test_report_of_a_crashed_run_from_the_broker(spawn, client, amqp_url, run_name, tmp_path) -> None:
    config_path = tmp_path / "run.yaml"
    config_path.write_text(CONFIG)
    state = tmp_path / "state"

    first = await cluster(spawn, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url, faults="after_publish@2")
    _, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == -signal.SIGKILL, err[-3000:]
    for actor in first:
        actor.kill()
    [newest] = sorted((state / "snapshots" / run_name).glob("snapshot_*"))[-1:]
    manifest = json.loads((newest / "manifest.json").read_text())

    await cluster(spawn, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["restores"] == 1

    out_dir = tmp_path / "report"
    result = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "parkway.actors",
            "report",
            run_name,
            "--broker",
            amqp_url,
            "--out",
            str(out_dir),
            "--json",
        ],
        env=actor_env(run_name, tmp_path / "cli"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    drawn = json.loads(result.stdout)
    assert drawn["run"] == run_name and drawn["finished"] is True
    assert drawn["rollouts"] == drawn["rollouts_sealed"] == summary["rollouts_sealed"] == 6
    assert drawn["attempts"] == 6 + summary["rollouts_restored"]  # each continued rollout: one more attempt
    assert drawn["crashes"] == 1 and drawn["restores"] == 1 and drawn["incarnations"] == 2
    assert drawn["pauses"] >= 2 and drawn["turns_kept"] > 0
    assert drawn["lines"]["malformed"] == 0 and drawn["lines"]["other_runs"] == 0
    png = out_dir / f"{run_name}.png"
    assert drawn["png"] == str(png) and png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    page = (out_dir / f"{run_name}.html").read_text()
    assert run_name in page and manifest["checkpoint_id"] in page
    assert "inferred: the controller started again" in page
