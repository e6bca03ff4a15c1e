"""Running a configured workload: every actor in one process on the in-memory broker (embedded),
or the controller alone driving actors that run as services on a real broker.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from parkway.actors.launch.plugins import actor_options
from parkway.actors.roles.controller.controller import Controller, RunSummary
from parkway.actors.run.config import RunConfig
from parkway.actors.run.tasks import Task
from parkway.actors.runtime import tracing
from parkway.actors.runtime.actor import Actor
from parkway.actors.runtime.logs import BrokerLogSink, attach_sink, detach_sink
from parkway.actors.runtime.metrics import metrics_endpoint
from parkway.actors.runtime.participant import Participant
from parkway.actors.sdk.trainer import Trainer
from parkway.brokers.base import Broker
from parkway.protocol.ids import Role
from parkway.protocol.layout import ACTOR_STATE_DIR, SNAPSHOTS_DIR
from parkway.protocol.signing import Keyring


def role_options(role: str, config: RunConfig | None) -> dict[str, Any]:
    """Constructor keywords a role takes from the run configuration."""
    if config is None:
        return {}
    if role == Role.POLICY:
        from parkway.actors.engines.ray_host import EngineSpec
        from parkway.actors.engines.ray_placement import RayPlacement

        policy = config.policy
        if policy.engine == "vllm":
            kwargs: dict[str, Any] = {
                "model": policy.model,
                "max_model_len": policy.max_model_len,
                "tensor_parallel_size": policy.tensor_parallel_size,
                "gpu_memory_utilization": policy.gpu_memory_utilization,
                "kv_cache_memory_bytes": policy.kv_cache_memory_bytes,
            }
        else:
            kwargs = {
                "per_token_delay_s": policy.per_token_delay_s,
                "cpu_per_token_s": policy.cpu_per_token_s,
                "filler_words": policy.filler_words,
            }
        if policy.engine_record:
            kwargs["record"] = policy.engine_record
        return {
            "engine": EngineSpec(kind=policy.engine, kwargs=kwargs),
            "engine_host": policy.host,
            "engines": policy.engines,
            "placement": RayPlacement(
                address=policy.ray_address,
                gpus_per_engine=policy.gpus_per_engine,
                cpus_per_engine=policy.cpus_per_engine,
                resources=dict(policy.engine_resources),
            ),
            "keep_prefixes": config.recovery.target_level == "prefix",
            "progress_interval_s": policy.progress_interval_s,
            "prefetch": data_prefetch(config),
            "tq_shards": config.topology.tq_shards,
        }
    if role == Role.RESOURCES:
        return {
            "mode": config.resources.mode,
            "tool_delay_s": config.resources.tool_delay_s,
            "prefetch": data_prefetch(config),
            **actor_options(role, config),
        }
    if role == Role.TRAINER:
        return {
            "kind": config.trainer.kind,
            "options": dict(config.trainer.options),
            "tq_shards": config.topology.tq_shards,
        }
    return actor_options(role, config)


CONTROL_HEADROOM = 64  # deliveries left for control commands beside every rollout's call in flight


def data_prefetch(config: RunConfig) -> int:
    """Prefetch of the policy, the resources and the controller. Each rollout has at most one model
    call and one tool call in flight, and a model call waits at a closed admission gate holding its
    delivery; were the prefetch not above every rollout's call, a checkpoint's own Commit and Resume
    would queue behind the calls that wait for them (seen at 1024 rollouts in flight: the commit timed
    out). Each rollout has at most one receipt on its way to the controller, whose handler holds the
    delivery while the seal goes to TQ; below every rollout's receipt, a wave of rollouts finishing
    together would wait for other seals before its receipts even arrive, and a snapshot's drain with
    them."""
    return config.rollout.max_in_flight + CONTROL_HEADROOM


def workload_controller(broker: Broker, credentials: bytes | Keyring, config: RunConfig) -> Controller:
    """The controller of one workload, its data prefetch sized for the workload's rollouts."""
    return Controller(
        broker, keyring=as_keyring(credentials, broker.run), replica=0, prefetch=data_prefetch(config)
    )


def as_keyring(credentials: bytes | Keyring, run: str) -> Keyring:
    """A keyring as given, or every role's keys derived from a secret (``Keyring.derive``)."""
    return credentials if isinstance(credentials, Keyring) else Keyring.derive(credentials, run)


def embedded_actors(
    broker: Broker, credentials: bytes | Keyring, config: RunConfig, state_root: Path
) -> list[Actor]:
    """The whole cluster of a configuration, on one broker connection (one address space: every actor
    signs with the same keyring, its own role's key)."""
    from parkway.actors.launch.roles import ROLES

    keyring = as_keyring(credentials, broker.run)
    actors: list[Actor] = []
    layout = [
        (Role.TQ, config.topology.tq_shards),
        (Role.POLICY, config.topology.policies),
        (Role.RESOURCES, config.topology.resources),
        (Role.AGENT, config.topology.agents),
    ]
    for role, count in layout:
        cls = ROLES[role]
        for replica in range(count):
            kwargs: dict[str, Any] = {"keyring": keyring, "replica": replica, **role_options(role, config)}
            if issubclass(cls, Participant):
                kwargs["snapshot_root"] = state_root / SNAPSHOTS_DIR
            actors.append(cls(broker, **kwargs))
    if config.trainer.host == "service":  # inline, the controller hosts it; embedded, it is here
        trainer_dir = state_root / ACTOR_STATE_DIR / broker.run / Role.TRAINER / "0"
        options = {"keyring": keyring, "state_dir": trainer_dir, **role_options(Role.TRAINER, config)}
        actors.append(ROLES[Role.TRAINER](broker, **options))
    return actors


async def run_workload(
    broker: Broker,
    credentials: bytes | Keyring,
    config: RunConfig,
    tasks: list[Task],
    *,
    embedded: bool,
    state_root: Path,
    trainer: Trainer | None = None,
    snapshots: bool = True,
    stop_after_snapshots: int | None = None,
    metrics_port: int = 0,
    controller: Controller | None = None,
) -> RunSummary:
    """Start what this process hosts, run the workload to completion, stop, return the summary.
    With ``metrics_port``, their Prometheus metrics are served on it while the workload runs."""
    keyring = as_keyring(credentials, broker.run)
    actors = embedded_actors(broker, keyring, config, state_root) if embedded else []
    controller = controller or workload_controller(broker, keyring, config)
    started: list[Actor] = []
    # Driving actors on a real broker, the controller's lines join theirs on the run's log stream
    # (``parkway logs``, ``parkway report``); an embedded run's stream would die with the process.
    sink = None if embedded else BrokerLogSink(broker)
    if sink is not None:
        sink.start()
        attach_sink(sink)
    tracing.configure("parkway" if embedded else "parkway-controller")  # off unless OTEL_* ask
    with metrics_endpoint(broker, [*actors, controller], metrics_port):
        try:
            for actor in [*actors, controller]:
                await actor.start()
                started.append(actor)
            return await controller.run_workload(
                config,
                tasks,
                trainer,
                snapshot_root=state_root / SNAPSHOTS_DIR if snapshots else None,
                stop_after_snapshots=stop_after_snapshots,
            )
        finally:
            for actor in reversed(started):
                await actor.stop()
            await asyncio.to_thread(tracing.flush)
            if sink is not None:
                await sink.stop()
                detach_sink(sink)


__all__ = ["RunSummary", "embedded_actors", "role_options", "run_workload"]
