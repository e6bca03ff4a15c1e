"""compose.yaml's services, each run as a plain process on the real RabbitMQ (no Docker engine here).

The commands and environment come from `compose config` itself; only what Docker would provide is
swapped: the broker URL (RabbitMQ on this machine), the state volume (a temporary directory), the image's
/app (this checkout), the run name (unique per test), the secret (the test client's) and the metrics port (off: processes share a host).
Then `docker compose kill controller` and `up` again, as processes: the controller is SIGKILLed after a
snapshot is published while every other service keeps running, and a new controller process restores
that snapshot and finishes the run.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.processes import SECRET, wait_ready
from tests.test_compose import ROOT, compose, example_env
from tests.waiting import until

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]


def service_commands() -> dict[str, tuple[list[str], dict[str, str]]]:
    result = compose("config", "--format", "json", env=example_env())
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    return {
        name: (svc["command"], svc["environment"]) for name, svc in services.items() if name != "rabbitmq"
    }


def as_process(command: list[str]) -> list[str]:
    assert command[0] == "parkway"
    args = [arg.replace("/app/", f"{ROOT}/") for arg in command[1:]]
    return [sys.executable, "-m", "parkway.actors", *args]


def service_env(environment: dict[str, str], *, url: str, run: str, state: Path) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PARKWAY_")}
    env.update(environment)
    env.update(
        PARKWAY_BROKER_URL=url,
        PARKWAY_RUN=run,
        PARKWAY_STATE_DIR=str(state),
        PARKWAY_METRICS_PORT="0",
        PARKWAY_SECRET=SECRET,  # the test's client signs with this one
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

    def start(name: str) -> subprocess.Popen[str]:
        command, environment = services[name]
        process = subprocess.Popen(
            as_process(command),
            env=service_env(environment, url=amqp_url, run=run_name, state=state),
            stdout=subprocess.PIPE if name == "controller" else subprocess.DEVNULL,
            stderr=open(logs / f"{name}-{len(processes)}.log", "w"),  # noqa: SIM115 - the child owns it
            text=True,
        )
        processes[f"{name}-{len(processes)}"] = process
        return process

    try:
        actors = [name for name in services if name not in ("controller", "prometheus")]
        assert sorted(actors) == ["agent-0", "agent-1", "policy", "resources-0", "resources-1", "tq"]
        for name in actors:
            start(name)
        addresses = {
            "tq": "tq/0",
            "policy": "policy/0",
            "resources-0": "resources/0",
            "resources-1": "resources/1",
            "agent-0": "agent/0",
            "agent-1": "agent/1",
        }
        for index, name in enumerate(actors):
            service = _Service(addresses[name], processes[f"{name}-{index}"], logs / f"{name}-{index}.log")
            await wait_ready(client, service, timeout=60)  # type: ignore[arg-type]

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
        # Every other service lived through it: the same processes still answer.
        for name, process in processes.items():
            if not name.startswith("controller"):
                assert process.poll() is None, f"{name} died"
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
        for process in processes.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()


class _Service:
    """What ``wait_ready`` needs of a service process: its address, process and log."""

    def __init__(self, address: str, proc: subprocess.Popen[str], log_path: Path) -> None:
        self.address, self.proc, self.log_path = address, proc, log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        return self.log_path.read_text()
