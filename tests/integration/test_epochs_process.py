"""Epochs on data messages, over the real RabbitMQ with TQ and the policy each their own process.

Attempt numbers repeat across a restore: the restored ledger dispatches attempt 1 of ``t0000_g0``
again. A model call of the timeline that died, attempt 1 too, waits in the policy's queue while the
cluster restores (the policy process is SIGSTOPped: its delivery sits there unhandled). TQ is restored
at epoch 2 and resumed; then the policy wakes, generates the dead call and stages its row, stamped
with epoch 1. TQ must refuse that row (``stale_epoch``, dead-lettered, counted) and stage the new
timeline's row of the same key instead.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from parkway.actors.runtime.client import Client
from parkway.protocol.messages import (
    CanonicalRows,
    FetchRows,
    Generate,
    Generated,
    Message,
    Ok,
    Restore,
    Restored,
    Resume,
    SealRows,
)

from tests.support.processes import SECRET, Process, status_of, wait_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

CONFIG = "policy: {host: inline}\n"
ROLLOUT, ATTEMPT = "t0000_g0", 1
CAPTURE_KEY = f"{ROLLOUT}-a{ATTEMPT}"
STAGING_KEY = f"{CAPTURE_KEY}:0"


def model_call(epoch: int, prompt: tuple[int, ...]) -> Generate:
    """Model call 0 of attempt 1 of ``t0000_g0``, of timeline ``epoch``."""
    return Generate(
        rollout_id=ROLLOUT, attempt=ATTEMPT, call_index=0, token_ids=prompt, max_tokens=8, epoch=epoch
    )


def empty_tq_snapshot(state: Path, run: str) -> None:
    """``snapshot_1`` of the run, as TQ reads it: no rows."""
    tq = state / "snapshots" / run / "snapshot_1" / "tq"
    tq.mkdir(parents=True)
    for name in ("staging.msgpack", "canonical.msgpack", "lineage.msgpack"):
        (tq / name).write_bytes(msgspec.msgpack.encode([]))


async def rows_handled(client: Client, at_least: int) -> dict[str, int]:
    """TQ's counts once it handled (staged or refused) ``at_least`` Rows messages."""
    async with asyncio.timeout(30):
        while True:
            counts = (await status_of(client, "tq/0")).counts
            if counts.get("Rows", 0) + counts.get("refused:stale_epoch", 0) >= at_least:
                return counts
            await asyncio.sleep(0.05)


async def test_a_dead_timelines_row_staged_after_the_restore_is_refused_and_the_new_one_kept(
    spawn: Callable[..., Process], client: Client, run_name: str, tmp_path: Path
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    tq = spawn("tq")
    policy = spawn("policy", args=("--config", str(config)))
    for actor in (tq, policy):
        await wait_ready(client, actor, timeout=60)
    empty_tq_snapshot(tmp_path / "state", run_name)

    agent = Client(client.broker, secret=SECRET.encode(), sender="agent/0")  # model calls are an agent's
    policy.signal(signal.SIGSTOP)  # the dead timeline's call waits in the policy's queue
    dead_call = asyncio.ensure_future(
        agent.request("policy/0", model_call(1, (7, 7, 7)), correlation_id=STAGING_KEY, timeout=60)
    )
    deadline = time.time() + 30
    restored = await client.request(
        "tq/0", Restore(checkpoint_id="restore-e2", deadline=deadline, location="snapshot_1", epoch=2)
    )
    assert isinstance(restored, Restored), restored
    assert isinstance(await client.request("tq/0", Resume(checkpoint_id="restore-e2", deadline=deadline)), Ok)
    policy.signal(signal.SIGCONT)
    dead_reply = await dead_call
    assert isinstance(dead_reply, Generated), dead_reply  # the policy (never restored) answered it
    await rows_handled(client, 1)

    live: Message = await agent.request(
        "policy/0", model_call(2, (1, 2, 3)), correlation_id=f"{STAGING_KEY}:live", timeout=60
    )
    assert isinstance(live, Generated) and live.token_ids != dead_reply.token_ids, live
    counts = await rows_handled(client, 2)

    sealed = await client.request(
        "tq/0",
        SealRows(
            rollout_id=ROLLOUT,
            attempt=ATTEMPT,
            capture_key=CAPTURE_KEY,
            reward=1.0,
            staging_keys=(STAGING_KEY,),
        ),
        correlation_id=f"seal:{CAPTURE_KEY}",
    )
    assert isinstance(sealed, Ok), sealed
    trainer = Client(client.broker, secret=SECRET.encode(), sender="trainer/0")  # who fetches rows
    fetched = await trainer.request("tq/0", FetchRows(rollout_ids=(ROLLOUT,)), correlation_id="fetch-1")
    assert isinstance(fetched, CanonicalRows)
    [row] = fetched.rows
    assert [turn.token_ids for turn in row.turns] == [live.token_ids]  # the new timeline's row, not the dead
    assert counts.get("refused:stale_epoch") == 1 and counts.get("staging_rows") == 1, counts
    letters = [x for x in await client.broker.read_dead_letters() if x.origin == "tq/0"]
    assert [letter.code for letter in letters] == ["stale_epoch"], letters
