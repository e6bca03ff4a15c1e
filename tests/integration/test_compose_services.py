"""compose.yaml's services, each run as a plain process on the real RabbitMQ (no Docker engine here).

The commands and environment come from `compose config` itself; only what Docker would provide is
swapped: the broker URL (RabbitMQ on this machine), the state volume (a temporary directory), the image's
/app (this checkout), the run name (unique per test), the keys (each service its own role's, from the test client's keyring) and the metrics port (off: processes share a host).
Then `docker compose kill controller` and `up` again, as processes: the controller is SIGKILLed after a
snapshot is published while every other service keeps running, and a new controller process restores
that snapshot and finishes the run.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path

import pytest
from parkway.actors.launch import processes as launch
from parkway.actors.launch.processes import Process, clean_environment
from parkway.actors.storage.trainer import TrainerRecords
from parkway.protocol.signing import Keyring

from tests.support.compose import compose, example_env
from tests.support.paths import ROOT
from tests.support.processes import SECRET, wait_ready
from tests.support.waiting import until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


def service_commands() -> dict[str, tuple[list[str], dict[str, str]]]:
    result = compose("config", "--format", "json", env=example_env())
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    return {
        name: (svc["command"], svc["environment"]) for name, svc in services.items() if name != "rabbitmq"
    }


def as_process(command: list[str]) -> list[str]:
    """The service's ``parkway`` arguments, with the image's /app as this checkout."""
    assert command[0] == "parkway"
    return [arg.replace("/app/", f"{ROOT}/") for arg in command[1:]]


def service_env(environment: dict[str, str], *, url: str, run: str, state: Path) -> dict[str, str]:
    env = clean_environment()
    env.update(environment)
    # The service's own role's key, as compose hands it, but from the keyring the test's client holds.
    role = environment["PARKWAY_SIGNING_KEY"].partition(":")[0]
    keys = Keyring.derive(SECRET.encode(), run)
    env.update(
        PARKWAY_BROKER_URL=url,
        PARKWAY_RUN=run,
        PARKWAY_STATE_DIR=str(state),
        PARKWAY_METRICS_PORT="0",
        PARKWAY_SIGNING_KEY=keys.private_text([role]),
        PARKWAY_PUBLIC_KEYS=keys.public_text(),
        # A faster clock than the example's 5 s, so the test sees several snapshots in seconds.
        PARKWAY_CFG__SNAPSHOT_INTERVAL_S="0.5",
    )
    return env


async def test_the_compose_services_run_the_workload_and_a_killed_controller_resumes_it(
    client, amqp_url, run_name, tmp_path
) -> None:
    services = service_commands()
    state = tmp_path / "state"
    logs = tmp_path / "logs"
    logs.mkdir()
    processes: dict[str, subprocess.Popen[str]] = {}
    launched: dict[str, Process] = {}

    def start(name: str) -> subprocess.Popen[str]:
        command, environment = services[name]
        key = f"{name}-{len(processes)}"
        process = launch.start(
            as_process(command),
            env=service_env(environment, url=amqp_url, run=run_name, state=state),
            name=key,
            stdout=subprocess.PIPE if name == "controller" else subprocess.DEVNULL,
            stderr=logs / f"{key}.log",
            text=True,
        )
        launched[key] = process
        processes[key] = process.popen
        return process.popen

    try:
        actors = [name for name in services if name not in ("controller", "prometheus")]
        assert sorted(actors) == [
            "agent-0",
            "agent-1",
            "policy",
            "resources-0",
            "resources-1",
            "tq",
            "trainer",
        ]
        for name in actors:
            start(name)
        addresses = {
            "tq": "tq/0",
            "policy": "policy/0",
            "resources-0": "resources/0",
            "resources-1": "resources/1",
            "agent-0": "agent/0",
            "agent-1": "agent/1",
            "trainer": "trainer/0",
        }
        for index, name in enumerate(actors):
            await wait_ready(client, launched[f"{name}-{index}"], address=addresses[name], timeout=60)

        first = start("controller")
        snapshots = state / "snapshots" / run_name

        def published() -> list[Path]:
            return sorted(snapshots.glob("snapshot_*/manifest.json"))

        await until(lambda: len(published()) >= 2 or first.poll() is not None, timeout=120)
        assert first.poll() is None, "the run ended before two snapshots: it proves nothing"
        first.send_signal(signal.SIGKILL)  # docker compose kill controller
        first.wait(10)
        newest = json.loads(published()[-1].read_text())
        assert newest["episodes"], "the snapshot must hold rollouts mid-flight"

        second = start("controller")  # docker compose up: the same command again
        out, _ = await asyncio.to_thread(second.communicate, timeout=300)
        assert second.returncode == 0, (logs / f"controller-{len(processes) - 1}.log").read_text()[-3000:]
        summary = dict(line.split(None, 1) for line in out.splitlines() if line.strip())
        assert summary["restores"] == "1", out
        assert int(summary["rollouts_restored"]) >= 1
        assert summary["rollouts_sealed"] == summary["rollouts_expected"] == "36", out
        assert summary["rollouts_failed"] == "0" and summary["tool_mutations_duplicated"] == "0"
        assert summary["sessions_leaked"] == "0"
        # The trainer service lived through it and went back to the restored snapshot's step: its
        # records are contiguous and hold every group once.
        steps = TrainerRecords(state / "state" / run_name / "trainer" / "0" / "steps").steps()
        assert [r.step for r in steps] == list(range(1, len(steps) + 1)) and len(
            steps
        ) == 6  # 12 groups, 2 a step
        groups = [g for r in steps for g in r.groups]
        assert len(groups) == len(set(groups)) == 12
        # Every other service lived through it: the same processes still answer.
        for name, process in processes.items():
            if not name.startswith("controller"):
                assert process.poll() is None, f"{name} died"
    finally:
        launch.stop_all(launched.values(), grace=20)
