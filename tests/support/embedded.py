"""Small helpers for actor tests on the in-memory broker."""

from __future__ import annotations

import time

from parkway.actors.runtime.client import Client
from parkway.brokers.base import Envelope
from parkway.protocol import codec
from parkway.protocol.signing import SENDER_HEADER, SIGNATURE_HEADER, sign

SECRET = b"unit-test-secret"


def signed_raw(
    run: str,
    body: bytes,
    *,
    correlation_id: str,
    content_type: str = codec.JSON,
    sender: str = "test/0",
    secret: bytes = SECRET,
) -> Envelope:
    """An envelope around arbitrary bytes, correctly signed: what a buggy but authorised client sends."""
    signature = sign(
        secret, run=run, sender=sender, correlation_id=correlation_id, content_type=content_type, body=body
    )
    return Envelope(body, content_type, correlation_id, {SENDER_HEADER: sender, SIGNATURE_HEADER: signature})


async def raw_request(client: Client, address: str, envelope: Envelope, timeout: float = 5.0):
    reply = await client.broker.request(address, envelope, deadline=time.time() + timeout)
    return client.open(reply)


async def embedded_run(
    data: dict, state, *, snapshots: bool = True, stop_after: int | None = None, trainer=None
):
    """One workload of configuration ``data`` on a fresh in-memory cluster (a fresh "machine" each call)."""
    from parkway.actors.launch.workload import run_workload
    from parkway.actors.run.config import from_dict
    from parkway.actors.run.tasks import load_tasks
    from parkway.brokers.memory import MemoryBroker, MemoryHub

    config = from_dict(data)
    async with MemoryBroker(MemoryHub(), config.run) as broker:
        return await run_workload(
            broker,
            SECRET,
            config,
            load_tasks(config.tasks),
            embedded=True,
            state_root=state,
            snapshots=snapshots,
            stop_after_snapshots=stop_after,
            trainer=trainer,
        )


SNAPSHOT_RUN = {
    "run": "snaps",
    "seed": 3,
    "policy": {"host": "inline", "per_token_delay_s": 0.0003},
    "tasks": {"builtin": "bank", "limit": 3},
    "rollout": {"group_size": 3, "max_turns": 6},
    "snapshot_interval_s": 0.05,
}


async def crashed_run(state, published: int = 2):
    """The run directory of ``SNAPSHOT_RUN`` stopped dead right after its ``published``-th snapshot:
    real snapshots on disk, no COMPLETED marker."""
    from parkway.actors.roles.controller.controller import SimulatedCrash

    try:
        await embedded_run(SNAPSHOT_RUN, state, stop_after=published)
    except SimulatedCrash:
        return state / "snapshots" / SNAPSHOT_RUN["run"]
    raise AssertionError("the run finished before its snapshots were published")
