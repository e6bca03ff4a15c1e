"""The processes of one chaos workload: started, signalled, restarted by name, and all reaped.

``Cluster`` runs each actor (``parkway actor ROLE``) and the controller (``parkway run``) as a separate
OS process with the run's environment and ``PARKWAY_HISTORY=1``, each with its own log file; a fault
point to arm (``PARKWAY_FAULTS``) goes to one process at its start. ``ControllerTail`` reads the
controller's history as it is written, for the harness to follow the protocol's steps.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from parkway.actors.launch import processes
from parkway.actors.launch.processes import Process
from parkway.actors.runtime.faults import FAULTS_ENV
from parkway.actors.runtime.history import HISTORY_ENV, Record, parse_line

CONTROLLER = "controller"


@dataclass(eq=False)
class Proc(Process):
    """One process of the workload (``name``: ``tq/0``, ..., or ``controller``) and what the nemesis
    did to it."""

    armed: str = ""  # the PARKWAY_FAULTS it was started with
    stopped: bool = False  # SIGSTOPped by us and not continued yet


class Cluster:
    """The processes of one workload, started and restarted by name; every one is reaped at the end."""

    def __init__(
        self,
        *,
        url: str,
        run: str,
        state: Path,
        config: Path,
        secret: str,
        logs: Path,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.url, self.run, self.state, self.config, self.secret, self.logs = (
            url,
            run,
            state,
            config,
            secret,
            logs,
        )
        self.extra_env = dict(extra_env or {})
        self._first_node: dict[str, int] = {}  # a process's first node on a cluster
        self.procs: dict[str, Proc] = {}
        self.everything: list[Proc] = []  # every process ever started, for the final clean-up
        self.starts: dict[str, int] = {}
        self.summary_path = logs / "summary.json"

    def broker_url(self, name: str) -> str:
        """The broker URL process ``name`` is given: on a cluster (a comma-separated list of nodes),
        the controller's list starts at the first node and each actor's at another, in turn, so that
        the processes spread over the nodes and a node lost drops some of them and not others."""
        nodes = [url for url in self.url.split(",") if url]
        if len(nodes) < 2:
            return self.url
        if name not in self._first_node:  # in the order processes first start: stable over restarts
            self._first_node[name] = 0 if name == CONTROLLER else (1 + len(self._first_node)) % len(nodes)
        first = self._first_node[name]
        return ",".join(nodes[first:] + nodes[:first])

    def env(self, faults: str = "", name: str = CONTROLLER) -> dict[str, str]:
        env = processes.run_environment(
            run=self.run, secret=self.secret, state=self.state, broker_url=self.broker_url(name)
        )
        env.update(PARKWAY_METRICS_PORT="0", **{HISTORY_ENV: "1"}, **self.extra_env)
        if faults:
            env[FAULTS_ENV] = faults
        return env

    def start(self, name: str, faults: str = "") -> Proc:
        count = self.starts[name] = self.starts.get(name, 0) + 1
        log = self._log_path(name, count)
        if name == CONTROLLER:
            started = processes.start_run(
                self.config, env=self.env(faults, name), stderr=log, stdout=self.summary_path
            )
        else:
            role, replica = name.split("/")
            started = processes.start_actor(
                role,
                int(replica),
                env=self.env(faults, name),
                stderr=log,
                config=self.config,
                log_level="info",
            )
        proc = Proc(name, started.popen, started.log_path, armed=faults)
        self.procs[name] = proc
        self.everything.append(proc)
        return proc

    def alive(self) -> list[Proc]:
        return [p for p in self.procs.values() if p.alive()]

    def signal(self, name: str, sig: signal.Signals) -> None:
        proc = self.procs[name]
        if proc.alive():
            proc.signal(sig)
            proc.stopped = sig == signal.SIGSTOP or (proc.stopped and sig != signal.SIGCONT)

    def kill(self, name: str) -> None:
        self.procs[name].kill(timeout=30)

    def kill_all(self) -> None:
        processes.kill_all(self.procs.values(), timeout=30)

    def stop_actors(self) -> None:
        """Graceful stop of the actors after a finished workload: SIGTERM, SIGKILL if slow."""
        processes.stop_all(self.procs.values(), grace=20)

    def reap_everything(self) -> None:
        """Whatever happened: no process of ours survives (continued first, so a stopped one can die)."""
        processes.reap(self.everything, timeout=10)

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self._log_path(name, self.starts.get(name, 0))
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def exit_reason(self, name: str) -> str:
        """Why a process exited, from its log: its last ``parkway: ...`` line (what a command prints
        when it ends on an error), else its last three lines (a traceback's tail, a stray warning)."""
        tail = self.log_tail(name, 60).splitlines()
        said = [line for line in tail if line.startswith("parkway: ") and "fault point" not in line]
        return (said[-1] if said else " | ".join(tail[-3:]))[-400:]

    def _log_path(self, name: str, count: int) -> Path:
        return self.logs / f"{name.replace('/', '-')}-{count}.log"


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
