"""``parkway chaos``: the nemesis. Real processes on a real RabbitMQ, faults from a seed, a history check.

For each workload of the plan (``chaos.schedule``) it starts a cluster of separate OS processes, every
one recording its history (``PARKWAY_HISTORY=1``): ``tq``, ``policy``, ``resources`` x2, ``agent`` x2
(``parkway actor``) and the controller (``parkway run``). While the workload runs it injects the plan's
faults: processes SIGKILL themselves at exact protocol points (``PARKWAY_FAULTS``), and the harness
SIGKILLs one actor or all of them, SIGSTOPs and SIGCONTs one process or all, and restarts or kills the
broker (a throwaway RabbitMQ node this run owns). Like a supervisor, it starts again whatever died:
an actor comes back as a new process, a controller comes back and restores the newest snapshot.

When the controller finishes, the history checker (``chaos.check``) reads every process's history
and the snapshots on disk; a workload passes when every check passes and the controller's summary
says every rollout was sealed. Every workload has a deadline, the run has one too, and every process
the harness started is gone when it returns, whatever happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parkway.actors.chaos.check import NEMESIS, check, load_run
from parkway.actors.chaos.cluster import CONTROLLER, Cluster, ControllerTail, Proc
from parkway.actors.chaos.outages import OutageError, is_stopped, outage, stopped_at
from parkway.actors.chaos.results import ChaosResult, WorkloadResult
from parkway.actors.chaos.schedule import (
    BETWEEN,
    PARTICIPANTS,
    FaultKind,
    Injected,
    TimedFault,
    WorkloadPlan,
    controller_step,
    matrix,
    plan_cells,
    quick_matrix,
    random_plan,
    relabel,
)
from parkway.actors.launch.rabbit_cluster import RabbitCluster
from parkway.actors.launch.rabbit_node import BrokerNodeError, RabbitNode
from parkway.actors.runtime.client import Client
from parkway.actors.runtime.history import History, history_dir, read_file
from parkway.brokers.base import BrokerError
from parkway.brokers.rabbitmq_layout import QUEUE_TYPE_ENV
from parkway.protocol.history import FaultInjected, Record, SnapshotStep, UnplannedExit
from parkway.protocol.layout import SNAPSHOTS_DIR
from parkway.protocol.messages import Status, StatusReport

POLL_S = 0.02  # how often the harness looks at its processes and the controller's history

WORKLOAD_CONFIG = """\
run: {run}
seed: {seed}
rollout: {{group_size: 3, max_turns: 6, stall_timeout_s: 120}}
tasks: {{builtin: bank, limit: {tasks}}}
policy: {{host: inline, per_token_delay_s: {token_delay}}}
topology: {{agents: 2, resources: 2}}
trainer: {{batch_groups: 1}}
recovery: {{target_level: turn}}
snapshot_interval_s: {interval}
prepare_timeout_s: 5
keep_latest_k: 1000000
"""


class ChaosError(Exception):
    """The harness itself could not do its job (a broker that will not start, a process that will not
    come up); the message says what."""


@dataclass
class Options:
    seed: int = 1
    workdir: Path = Path(".parkway/chaos")
    broker_url: str | None = None  # None: a throwaway RabbitMQ node this run owns (broker faults on)
    broker_nodes: int = 1  # more: a throwaway cluster of that many nodes, with quorum queues
    minutes: float | None = None  # a long run: random workloads until this much time has passed
    quick: bool = True  # the short matrix (CI) instead of the full one
    workloads: int | None = None  # at most this many workloads
    workload_timeout_s: float = 240.0
    tasks: int = 4  # bank tasks, 3 rollouts each
    token_delay_s: float = 0.01
    snapshot_interval_s: float = 0.5
    keep_passing: bool = False  # keep the state of passing workloads too
    plans: list[WorkloadPlan] | None = None  # exactly these workloads (tests), instead of a matrix
    log: Any = None  # a callable(str) for progress lines


# -- one workload -------------------------------------------------------------------------------
class Workload:
    def __init__(
        self,
        plan: WorkloadPlan,
        *,
        options: Options,
        url: str,
        node: RabbitNode | None,
        secret: str,
        broker_cluster: RabbitCluster | None = None,
    ) -> None:
        self.plan = plan
        self.options = options
        self.node = node
        self.broker_cluster = broker_cluster
        self.run = f"chaos{options.seed}-w{plan.index}-{secrets.token_hex(3)}"
        self.root = options.workdir / self.run
        self.state = self.root / "state"
        self.logs = self.root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.config = self.root / "run.yaml"
        self.config.write_text(
            WORKLOAD_CONFIG.format(
                run=self.run,
                seed=plan.seed,
                tasks=options.tasks,
                token_delay=options.token_delay_s,
                interval=options.snapshot_interval_s,
            )
        )
        self.cluster = Cluster(
            url=url,
            run=self.run,
            state=self.state,
            config=self.config,
            secret=secret,
            logs=self.logs,
            extra_env={QUEUE_TYPE_ENV: "quorum"} if broker_cluster is not None else None,
        )
        self.history_dir = history_dir(self.state, self.run)
        self.nemesis = History(self.history_dir / f"nemesis-0-{os.getpid()}.jsonl", f"{NEMESIS}/0")
        self.result = WorkloadResult(plan.index, self.run, plan.describe())
        self.controller_points = list(plan.controller_points)
        self.actor_points = {p.address: p for p in plan.actor_points}
        self.timed = sorted(plan.timed, key=lambda t: t.at_s)
        self.outages = list(plan.outage_points)  # armed on every controller until each happened
        self.started = 0.0

    def say(self, text: str) -> None:
        if self.options.log is not None:
            self.options.log(f"[w{self.plan.index} {time.monotonic() - self.started:6.1f}s] {text}")

    def inject(
        self, kind: FaultKind | str, target: str, step: str, detail: str = "", *, exact: bool = True
    ) -> Injected:
        fault = Injected(self.plan.index, str(kind), target, step, time.time(), detail, exact)
        self.result.faults.append(fault)
        self.nemesis.record(FaultInjected(fault=str(kind), target=target, step=step, detail=detail))
        self.say(f"fault {kind} {target} at {step} {detail}".rstrip())
        return fault

    # -- starting things ---------------------------------------------------------------------------
    def start_actor(self, address: str) -> Proc:
        point = self.actor_points.get(address)  # armed on each process of it until it fires
        return self.cluster.start(address, point.spec if point is not None else "")

    def start_controller(self) -> Proc:
        """A controller armed with the next kill point and every outage still to happen: those at a
        restore step only on a controller that restores (one started after another); an outage at
        the kill's own point waits for the next controller (one action per point)."""
        point = self.controller_points[0] if self.controller_points else None
        restores = self.result.controllers > 0
        self.result.controllers += 1
        specs = [point.spec] if point is not None else []
        specs += [
            o.spec
            for o in self.outages
            if (restores or not o.in_restore) and (point is None or o.point != point.point)
        ]
        return self.cluster.start(CONTROLLER, ",".join(specs))

    async def wait_ready(self, client: Client, addresses: list[str], timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        for address in addresses:
            proc = self.cluster.procs[address]
            while True:
                if proc.popen.poll() is not None:
                    if proc.popen.returncode == -signal.SIGKILL and proc.armed:
                        break  # died at its armed point already: the main loop handles it
                    raise ChaosError(
                        f"{address} exited ({proc.popen.returncode}):\n{self.cluster.log_tail(address)}"
                    )
                try:
                    reply = await client.request(
                        address,
                        Status(checkpoint_id=f"ready-{time.monotonic_ns()}", deadline=time.time() + 1.0),
                    )
                    if isinstance(reply, StatusReport) and reply.pid == proc.pid:
                        break
                except BrokerError:
                    pass
                if time.monotonic() > deadline:
                    raise ChaosError(
                        f"{address} did not answer within {timeout:.0f}s:\n{self.cluster.log_tail(address)}"
                    )
                await asyncio.sleep(0.1)

    # -- the run -----------------------------------------------------------------------------------
    async def go(self) -> WorkloadResult:
        from parkway.brokers.rabbitmq import RabbitBroker
        from parkway.brokers.rabbitmq_layout import QueueKind

        self.started = time.monotonic()
        deadline = self.started + self.options.workload_timeout_s
        self.say(f"run {self.run}: {self.plan.describe()}")
        try:
            async with RabbitBroker(
                self.cluster.url,
                self.run,
                connection_name=f"parkway-{self.run}-nemesis",
                queue_kind=QueueKind.from_env(self.cluster.extra_env),  # the actors' kind of queue
            ) as broker:
                client = Client(broker, secret=self.cluster.secret.encode(), sender="cli/nemesis")
                for address in PARTICIPANTS:
                    self.start_actor(address)
                await self.wait_ready(client, list(PARTICIPANTS))
                self.start_controller()
                workload_start = time.monotonic()
                tail = ControllerTail(self.history_dir)
                while True:
                    if time.monotonic() > deadline:
                        self.result.error = (
                            f"the workload did not finish within {self.options.workload_timeout_s:.0f}s "
                            f"(controller at {controller_step(tail.records)})"
                        )
                        break
                    tail.poll()
                    if await self._check_controller(client):
                        break
                    await self._check_actors(client)
                    await self._check_outage()
                    await self._timed(client, tail, time.monotonic() - workload_start)
                    await asyncio.sleep(POLL_S)
        except ChaosError as exc:
            self.result.error = str(exc)
        except (BrokerError, OSError) as exc:
            self.result.error = f"harness: {type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.cluster.stop_actors)
            self.cluster.reap_everything()
            self.nemesis.close()
        self.result.wall_s = time.monotonic() - self.started
        for missed in self.outages:
            self.result.notes.append(f"planned {missed.kind} at {missed.point}@{missed.nth} never happened")
        self._relabel()
        try:
            self.result.verdict = check(load_run(self.state, self.run, chaos=True))
        except (OSError, ValueError) as exc:
            self.result.error = (self.result.error or "") + f"; history unreadable: {exc}"
        if self.result.summary is None and self.result.error is None:
            self.result.error = "the controller printed no summary"
        self.say(
            f"{'pass' if self.result.passed else 'FAIL'}: {len(self.result.faults)} faults, "
            f"{self.result.controllers} controllers"
        )
        return self.result

    async def _check_controller(self, client: Client) -> bool:
        """True when the workload is over (the controller finished). A controller that died is
        started again: it restores the newest snapshot."""
        proc = self.cluster.procs[CONTROLLER]
        code = proc.popen.poll()
        if code is None:
            return False
        if code == 0:
            try:
                self.result.summary = json.loads(self.cluster.summary_path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                self.result.error = f"the controller's summary is not JSON: {exc}"
            return True
        summary = self._summary() if code == 1 else None
        if summary is not None:  # it finished its run, with rollouts that failed for good
            self.result.summary = summary
            self.result.error = f"the run finished with {summary.get('rollouts_failed')} rollouts failed"
            return True
        point = self.controller_points[0] if self.controller_points else None
        if code == -signal.SIGKILL and point is not None and point.spec in proc.armed.split(","):
            self.controller_points.pop(0)
            self.inject(point.kind, "cluster" if point.cluster else CONTROLLER, point.point)
            if point.cluster:
                self.cluster.kill_all()
                for address in PARTICIPANTS:
                    self.start_actor(address)
                await self.wait_ready(client, list(PARTICIPANTS))
        else:
            reason = self.cluster.exit_reason(CONTROLLER)
            self.result.notes.append(f"controller exited {code} unplanned: {reason}")
            self.nemesis.record(UnplannedExit(target=CONTROLLER, code=code))
            self.say(f"controller exited {code}: {reason}")
            if self.result.controllers > 12:
                raise ChaosError(
                    f"the controller keeps exiting ({self.result.controllers} processes): {reason}"
                )
        self.start_controller()
        return False

    def _summary(self) -> dict[str, Any] | None:
        """The summary the controller printed, if it printed one (it finished its run)."""
        try:
            summary = json.loads(self.cluster.summary_path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return summary if isinstance(summary, dict) else None

    async def _check_actors(self, client: Client) -> None:
        for address in PARTICIPANTS:
            proc = self.cluster.procs[address]
            code = proc.popen.poll()
            if code is None:
                continue
            if code == -signal.SIGKILL and proc.armed:
                self.actor_points.pop(address, None)
                point = proc.armed.split("@")[0]
                self.inject(
                    FaultKind.KILL_ACTOR,
                    address,
                    point if not point.startswith("participant_prepare") else "participant_prepare",
                )
            else:
                reason = self.cluster.exit_reason(address)
                self.result.notes.append(f"{address} exited {code} unplanned: {reason}")
                self.nemesis.record(UnplannedExit(target=address, code=code))
            self.start_actor(address)
            await self.wait_ready(client, [address])

    async def _check_outage(self) -> None:
        """The controller stopped itself at an outage point: break the broker or the state directory,
        let it go on under the outage, repair it ``down_s`` later."""
        proc = self.cluster.procs[CONTROLLER]
        if proc.stopped or not proc.alive() or not is_stopped(proc.pid):
            return
        point = stopped_at(self.cluster.log_tail(CONTROLLER, 200))
        planned = next((o for o in self.outages if o.point == point), None)
        if planned is None:
            raise ChaosError(f"the controller stopped at {point!r}, where no outage was planned")
        self.outages.remove(planned)
        fault = self.inject(planned.kind, planned.target, planned.point, f"{planned.down_s:.0f}s down")
        try:
            await outage(
                planned.kind,
                planned.down_s,
                node=self.node,
                cluster=self.broker_cluster,
                snapshots=self.state / SNAPSHOTS_DIR / self.run,
                resume=lambda: self.cluster.signal(CONTROLLER, signal.SIGCONT),
            )
        except (OutageError, BrokerNodeError, OSError) as exc:
            raise ChaosError(f"{planned.kind} at {planned.point}: {exc}") from exc
        fault.ended = time.time()
        self.say(f"{planned.kind} over after {planned.down_s:.0f}s")

    async def _timed(self, client: Client, tail: ControllerTail, elapsed: float) -> None:
        if not self.timed:
            return
        fault = self.timed[0]
        if elapsed < fault.at_s:
            return
        if fault.at_step is not None and not started_lately(tail.records, fault.at_step):
            return  # wait for the controller to start that step (the tail lags by one poll at most)
        self.timed.pop(0)
        await self._fire(client, fault)

    async def _fire(self, client: Client, fault: TimedFault) -> None:
        kind, target = fault.kind, fault.target
        planned = fault.at_step or BETWEEN
        if kind is FaultKind.KILL_ACTOR:
            self.cluster.kill(target)
            self.inject(kind, target, planned, exact=False)
            self.start_actor(target)
            await self.wait_ready(client, [target])
        elif kind is FaultKind.PAUSE_ACTOR:
            name = CONTROLLER if target == "controller" else target
            self.cluster.signal(name, signal.SIGSTOP)
            self.inject(kind, target, planned, f"{fault.hold_s:.1f}s", exact=False)
            await asyncio.sleep(fault.hold_s)
            self.cluster.signal(name, signal.SIGCONT)
        elif kind is FaultKind.PAUSE_CLUSTER:
            names = [p.name for p in self.cluster.alive()]
            for name in names:
                self.cluster.signal(name, signal.SIGSTOP)
            self.inject(kind, "cluster", planned, f"{fault.hold_s:.1f}s", exact=False)
            await asyncio.sleep(fault.hold_s)
            for name in names:
                self.cluster.signal(name, signal.SIGCONT)
        elif kind in (FaultKind.BROKER_RESTART, FaultKind.BROKER_KILL):
            if self.node is None:
                self.result.notes.append(f"{kind} skipped: the broker is not this run's own node")
                return
            self.inject(kind, "broker", planned, exact=False)
            action = self.node.restart_app if kind is FaultKind.BROKER_RESTART else self.node.kill_and_start
            try:
                await asyncio.to_thread(action)
            except BrokerNodeError as exc:
                raise ChaosError(f"{kind}: {exc}") from exc

    def _relabel(self) -> None:
        """Timed faults get the step the controller's history shows at their moment."""
        records: list[Record] = []
        for path in sorted(self.history_dir.glob("controller-0-*.jsonl")):
            with contextlib.suppress(OSError, ValueError):
                records.extend(read_file(path))
        relabel(self.result.faults, records)


def started_lately(records: list[Record], step: str, within_s: float = 1.0) -> bool:
    """Whether the controller started ``step`` in the last ``within_s``. Any such start counts, not
    only the newest step: a step of a few milliseconds (``prepare`` since the window shrank) was
    rarely the newest at a poll, and a fault waiting for it held back every timed fault after it
    (CI's seeded schedule: a workload ended with its two pauses never fired)."""
    since = time.time() - within_s
    for record in reversed(records):
        if record.t < since:
            return False
        if isinstance(record, SnapshotStep) and record.step == step:
            return True
    return False


# -- the run ------------------------------------------------------------------------------------
async def delete_run(url: str, run: str) -> None:
    """Remove one workload's queues (both lanes of each actor's) and exchanges from a shared broker."""
    import aio_pika
    from parkway.brokers.rabbitmq_layout import run_exchanges, run_queues

    with contextlib.suppress(Exception):
        connection = await aio_pika.connect(url)
        async with connection:
            channel = await connection.channel()
            # The controller's process also hosts the trainer (inline) and declares its queues.
            for name in run_queues(run, [*PARTICIPANTS, "controller/0", "trainer/0"]):
                await channel.queue_delete(name)
            for name in run_exchanges(run):
                await channel.exchange_delete(name)


def plans_for(options: Options, *, broker: bool, nodes: bool = False) -> Iterator[WorkloadPlan]:
    if options.plans is not None:
        yield from options.plans
        return
    if options.minutes is not None:
        index = 0
        while options.workloads is None or index < options.workloads:
            yield random_plan(index, options.seed, broker=broker, nodes=nodes)
            index += 1
        return
    cells = quick_matrix(broker=broker, nodes=nodes) if options.quick else matrix(broker=broker, nodes=nodes)
    plans = plan_cells(cells, options.seed)
    yield from plans[: options.workloads] if options.workloads is not None else plans


async def run_chaos(options: Options) -> ChaosResult:
    """Every workload of the plan, each checked; bounded by ``minutes`` (long runs) or the plan."""
    started = time.monotonic()
    options.workdir.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_hex(16)
    node: RabbitNode | None = None
    broker_cluster: RabbitCluster | None = None
    results: list[WorkloadResult] = []
    try:
        if options.broker_url is None and options.broker_nodes > 1:
            broker_cluster = RabbitCluster(f"parkway-chaos-{os.getpid()}-", options.broker_nodes)
            await asyncio.to_thread(broker_cluster.start)
        elif options.broker_url is None:
            node = RabbitNode(f"parkway-chaos-{os.getpid()}")
            await asyncio.to_thread(node.start)
        url = options.broker_url or (
            node.url if node is not None else broker_cluster.url_list if broker_cluster is not None else ""
        )
        deadline = started + options.minutes * 60 if options.minutes is not None else None
        for plan in plans_for(options, broker=node is not None, nodes=broker_cluster is not None):
            if deadline is not None and time.monotonic() > deadline:
                break
            workload = Workload(
                plan, options=options, url=url, node=node, secret=secret, broker_cluster=broker_cluster
            )
            try:
                results.append(await workload.go())
            finally:
                if options.broker_url is not None:  # a shared broker keeps nothing of ours
                    await delete_run(url, workload.run)
            if results[-1].passed and not options.keep_passing:
                shutil.rmtree(workload.root / "state" / SNAPSHOTS_DIR, ignore_errors=True)
    finally:
        if node is not None:
            await asyncio.to_thread(node.stop)
        if broker_cluster is not None:
            await asyncio.to_thread(broker_cluster.stop)
    broker_text = (
        "shared"
        if options.broker_url is not None
        else f"own cluster of {options.broker_nodes}"
        if broker_cluster is not None
        else "own node"
    )
    return ChaosResult(options.seed, results, time.monotonic() - started, broker_text)
