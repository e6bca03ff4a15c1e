"""The one process launcher: the run's environment, and processes started, stopped, killed and reaped.

The processes here are ``parkway up`` on the in-memory broker (a real parkway process that serves
until it is told to stop, and needs no RabbitMQ); ``parkway actor`` on the real broker is started the
same way by the integration tests, the benchmarks and the chaos harness."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
from parkway.actors.launch import processes
from parkway.actors.launch.processes import Process, ProcessExited
from parkway.actors.runtime.client import Client
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.signing import Keyring


def test_the_clean_environment_drops_every_parkway_variable_and_keeps_the_rest() -> None:
    base = {"PARKWAY_RUN": "stray", "PARKWAY_CFG__SEED": "9", "PYTHONPATH": "/checkout", "PATH": "/bin"}
    assert processes.clean_environment(base) == {"PYTHONPATH": "/checkout", "PATH": "/bin"}
    assert processes.clean_environment(base, strip=("PARKWAY_", "PATH")) == {"PYTHONPATH": "/checkout"}


def test_the_run_environment_is_the_clean_one_plus_the_runs_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARKWAY_FAULTS", "after_prepare@1")  # left in the developer's shell
    monkeypatch.setenv("PARKWAY_BROKER_URL", "amqp://elsewhere/")
    monkeypatch.setenv("PYTHONPATH", "/checkout")
    env = processes.run_environment(
        run="r1", secret="s3", state=tmp_path, broker_url="amqp://here/", PARKWAY_HISTORY="1"
    )
    assert {k: v for k, v in env.items() if k.startswith("PARKWAY_")} == {
        "PARKWAY_RUN": "r1",
        "PARKWAY_SECRET": "s3",
        "PARKWAY_STATE_DIR": str(tmp_path),
        "PARKWAY_BROKER_URL": "amqp://here/",
        "PARKWAY_HISTORY": "1",
    }
    assert env["PYTHONPATH"] == "/checkout"  # a checkout on the path is the one the child imports
    without_broker = processes.run_variables(run="r1", secret="s3", state=tmp_path)
    assert "PARKWAY_BROKER_URL" not in without_broker


def test_the_run_environment_keeps_the_trace_file_of_the_otel_settings_it_passes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # OTEL_* is not PARKWAY_*, so a file exporter chosen in this shell reaches every process; its file
    # must reach them too, or each refuses to start ("needs PARKWAY_TRACE_FILE").
    from parkway.actors.runtime.tracing_sdk import from_env

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "file")
    monkeypatch.setenv("PARKWAY_TRACE_FILE", str(tmp_path / "spans.jsonl"))
    env = processes.run_environment(run="r1", secret="s3", state=tmp_path)
    assert env["OTEL_TRACES_EXPORTER"] == "file"
    assert env["PARKWAY_TRACE_FILE"] == str(tmp_path / "spans.jsonl")
    setup = from_env("agent/0", env)  # what an actor started with it sets up: no SettingsError
    assert setup is not None and setup.exporters == ("file",)
    monkeypatch.delenv("PARKWAY_TRACE_FILE")
    assert "PARKWAY_TRACE_FILE" not in processes.run_environment(run="r1", secret="s3", state=tmp_path)


def test_each_process_gets_its_own_role_key_and_the_table_never_the_secret(tmp_path: Path) -> None:
    env = processes.run_environment(run="r1", secret="s3", state=tmp_path)
    agent = processes.own_keys(env, ["agent"])
    assert "PARKWAY_SECRET" not in agent and env["PARKWAY_SECRET"] == "s3"  # the caller keeps its copy
    derived = Keyring.derive(b"s3", "r1")
    assert agent["PARKWAY_SIGNING_KEY"] == derived.private_text(["agent"])
    assert agent["PARKWAY_PUBLIC_KEYS"] == derived.public_text()
    driver = Keyring.from_text(
        processes.own_keys(env, ["controller", "trainer"])["PARKWAY_SIGNING_KEY"], derived.public_text()
    )
    assert set(driver.private) == {"controller", "trainer"}
    given = {**env, "PARKWAY_SIGNING_KEY": "tq:x"}  # keys named by the caller are left alone
    assert processes.own_keys(given, ["agent"]) == given


def test_the_command_is_this_interpreters_parkway() -> None:
    assert processes.parkway_command("actor", "tq") == [sys.executable, "-m", "parkway.actors", "actor", "tq"]


def wait_for_line(process: Process, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in process.log_text():
        assert process.alive(), process.log_text()
        assert time.monotonic() < deadline, f"no {text!r} within {timeout}s:\n{process.log_text()}"
        time.sleep(0.05)


def up(tmp_path: Path, name: str) -> Process:
    env = processes.run_environment(run="launcher", secret="s", state=tmp_path / "state")
    return processes.start(
        ["up", "--topology", "tq=1"], env=env, name=name, stderr=tmp_path / f"{name}.log", cwd=tmp_path
    )


@pytest.mark.slow  # starts `parkway up` processes
def test_stop_is_graceful_and_its_log_is_in_its_file(tmp_path: Path) -> None:
    process = up(tmp_path, "up-0")
    assert process.log_path == tmp_path / "up-0.log"
    wait_for_line(process, "Ctrl-C stops them")
    process.stop(grace=30)
    assert process.returncode == 0  # SIGTERM: the actors stopped, the process exited cleanly
    assert '"event":"actor_stopped"' in process.log_text()
    process.signal(signal.SIGTERM)  # an exited process is not signalled (no error, no stray pid)


@pytest.mark.slow  # starts `parkway up` processes
def test_kill_all_and_reap_leave_nothing_running_not_even_a_stopped_process(tmp_path: Path) -> None:
    first, second = up(tmp_path, "up-1"), up(tmp_path, "up-2")
    wait_for_line(first, "Ctrl-C stops them")
    first.signal(signal.SIGSTOP)  # a stopped process ignores SIGTERM; SIGKILL still ends it
    processes.kill_all([first])
    assert first.returncode == -signal.SIGKILL
    second.signal(signal.SIGSTOP)
    processes.reap([first, second])
    assert second.returncode == -signal.SIGKILL


@pytest.mark.slow  # starts a `parkway up` process
async def test_wait_ready_says_when_the_process_exited_and_shows_its_log(tmp_path: Path) -> None:
    env = processes.clean_environment()
    doomed = processes.start(
        ["up", "--topology", "wizard=2"], env=env, name="tq/0", stderr=tmp_path / "doomed.log"
    )
    doomed.wait(60)
    async with MemoryBroker(MemoryHub(), "launcher") as broker:
        client = Client(broker, secret=b"s", sender="test/0")
        with pytest.raises(ProcessExited) as exited:
            await processes.wait_ready(client, doomed, timeout=5)
    assert str(exited.value).startswith("tq/0 exited (2):") and "topology item 'wizard=2'" in str(
        exited.value
    )


def test_a_workload_with_a_trainer_service_starts_a_trainer_process() -> None:
    from parkway.actors.launch.processes import service_roles
    from parkway.actors.run.config import from_dict

    inline = service_roles(from_dict({"topology": {"agents": 1, "resources": 1}}))
    assert inline == [("tq", 0), ("policy", 0), ("resources", 0), ("agent", 0)]
    service = service_roles(
        from_dict({"topology": {"agents": 2, "resources": 1}, "trainer": {"host": "service"}})
    )
    assert service == [("tq", 0), ("policy", 0), ("resources", 0), ("agent", 0), ("agent", 1), ("trainer", 0)]
