"""The processes of one chaos workload: started, signalled, restarted by name, and all reaped.

``Cluster`` runs each actor (``parkway actor ROLE``) and the controller (``parkway run``) as a separate
OS process with the run's environment and ``PARKWAY_HISTORY=1``, each with its own log file; a fault
point to arm (``PARKWAY_FAULTS``) goes to one process at its start. ``ControllerTail`` reads the
controller's history as it is written, for the harness to follow the protocol's steps.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parkway.actors.runtime.faults import FAULTS_ENV
from parkway.actors.runtime.history import HISTORY_ENV, Record, parse_line

CONTROLLER = "controller"


@dataclass
class Proc:
    name: str  # "tq/0", ..., or "controller"
    popen: subprocess.Popen[bytes]
    armed: str = ""  # the PARKWAY_FAULTS it was started with
    stopped: bool = False  # SIGSTOPped by us and not continued yet

    @property
    def pid(self) -> int:
        return self.popen.pid


class Cluster:
    """The processes of one workload, started and restarted by name; every one is reaped at the end."""

    def __init__(self, *, url: str, run: str, state: Path, config: Path, secret: str, logs: Path) -> None:
        self.url, self.run, self.state, self.config, self.secret, self.logs = (
            url,
            run,
            state,
            config,
            secret,
            logs,
        )
        self.procs: dict[str, Proc] = {}
        self.everything: list[Proc] = []  # every process ever started, for the final clean-up
        self.starts: dict[str, int] = {}
        self.summary_path = logs / "summary.json"

    def env(self, faults: str = "") -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PARKWAY_")}
        env.update(
            PARKWAY_RUN=self.run,
            PARKWAY_SECRET=self.secret,
            PARKWAY_STATE_DIR=str(self.state),
            PARKWAY_BROKER_URL=self.url,
            PARKWAY_METRICS_PORT="0",
            **{HISTORY_ENV: "1"},
        )
        if faults:
            env[FAULTS_ENV] = faults
        return env

    def start(self, name: str, faults: str = "") -> Proc:
        count = self.starts[name] = self.starts.get(name, 0) + 1
        log = self.logs / f"{name.replace('/', '-')}-{count}.log"
        if name == CONTROLLER:
            args = ["run", "--config", str(self.config), "--json", "--log-level", "info"]
            stdout: Any = open(self.summary_path, "wb")  # noqa: SIM115 - the child owns it
        else:
            role, replica = name.split("/")
            args = ["actor", role, "--replica", replica, "--config", str(self.config), "--log-level", "info"]
            stdout = subprocess.DEVNULL
        with open(log, "wb") as stderr:
            popen = subprocess.Popen(
                [sys.executable, "-m", "parkway.actors", *args],
                env=self.env(faults),
                stdout=stdout,
                stderr=stderr,
            )
        if stdout is not subprocess.DEVNULL:
            stdout.close()
        proc = Proc(name, popen, faults)
        self.procs[name] = proc
        self.everything.append(proc)
        return proc

    def alive(self) -> list[Proc]:
        return [p for p in self.procs.values() if p.popen.poll() is None]

    def signal(self, name: str, sig: signal.Signals) -> None:
        proc = self.procs[name]
        if proc.popen.poll() is None:
            proc.popen.send_signal(sig)
            proc.stopped = sig == signal.SIGSTOP or (proc.stopped and sig != signal.SIGCONT)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.popen.poll() is None:
            proc.popen.kill()
        proc.popen.wait(30)

    def kill_all(self) -> None:
        for proc in self.alive():
            proc.popen.kill()  # all at once, then reap
        for proc in list(self.procs.values()):
            proc.popen.wait(30)

    def stop_actors(self) -> None:
        """Graceful stop of the actors after a finished workload: SIGTERM, SIGKILL if slow."""
        for proc in self.alive():
            if proc.stopped:
                proc.popen.send_signal(signal.SIGCONT)
            proc.popen.terminate()
        for proc in list(self.procs.values()):
            try:
                proc.popen.wait(20)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(10)

    def reap_everything(self) -> None:
        """Whatever happened: no process of ours survives (continued first, so a stopped one can die)."""
        for proc in self.everything:
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGCONT)
                    proc.popen.kill()
        for proc in self.everything:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)

    def log_tail(self, name: str, lines: int = 20) -> str:
        count = self.starts.get(name, 0)
        path = self.logs / f"{name.replace('/', '-')}-{count}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class ControllerTail:
    """The controller's history as it is written (every controller process of the run)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.offsets: dict[Path, int] = {}
        self.records: list[Record] = []

    def poll(self) -> list[Record]:
        fresh: list[Record] = []
        for path in sorted(self.directory.glob("controller-0-*.jsonl")):
            offset = self.offsets.get(path, 0)
            with open(path, "rb") as handle:
                handle.seek(offset)
                data = handle.read()
            end = data.rfind(b"\n") + 1
            if end == 0:
                continue
            self.offsets[path] = offset + end
            for line in data[:end].splitlines():
                if line.strip():
                    fresh.append(parse_line(line, path.name))
        fresh.sort(key=lambda r: r.t)
        self.records.extend(fresh)
        return fresh
