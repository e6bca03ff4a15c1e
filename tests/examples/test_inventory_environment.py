"""The inventory plugin (examples/inventory-plugin) under the tool server, on SQLite and PostgreSQL:
the session hooks, exactly-once under redelivery and under a restarted tool server (answered from the
database's journal), and export/restore leaving exactly the snapshot's rows."""

from __future__ import annotations

import ast
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from parkway.actors.roles.resources import Resources
from parkway.brokers.memory import MemoryBroker, MemoryHub
from parkway.protocol.errors import ProtocolError
from parkway.protocol.messages import AttemptRef, Commit, EpisodeRef, Restore, ToolCall, ToolResult

from tests.support import inventory
from tests.support.inventory import Database
from tests.support.signed import SECRET

inventory.importable()
from parkway_inventory import store  # noqa: E402 - importable from its folder only after the line above
from parkway_inventory.environment import Inventory, initial_stock, replay  # noqa: E402

SEED = 12


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Database]:
    if request.param == "postgres" and (problem := inventory.postgres_problem()):
        pytest.skip(problem)
    chosen = inventory.database(request.param, tmp_path)
    monkeypatch.delenv("PARKWAY_INVENTORY_DSN", raising=False)
    for name, value in chosen.variables.items():
        monkeypatch.setenv(name, value)
    yield chosen
    store.close_all()
    chosen.drop()


@pytest.fixture
async def server() -> AsyncIterator[Any]:
    """A factory of tool servers on one broker; a second one is a tool server restarted."""
    async with MemoryBroker(MemoryHub(), "unit") as broker:
        yield lambda: Resources(broker, secret=SECRET, environments={"inventory": Inventory})


async def call(
    actor: Resources, index: int, tool: str, rollout: str = "r1", attempt: int = 0, **arguments: Any
) -> ToolResult:
    result = await actor.on_tool_call(
        ToolCall(
            rollout_id=rollout,
            attempt=attempt,
            call_index=index,
            env="inventory",
            tool=tool,
            arguments=arguments,
            seed=SEED,
        )
    )
    assert isinstance(result, ToolResult)
    return result


async def test_a_session_is_bound_and_opened_at_its_seeds_rows(db: Database, server) -> None:
    actor = server()
    result = await call(actor, 0, "stock", item="bolts")
    assert result.ok and result.output == {"item": "bolts", "qty": initial_stock(SEED)["bolts"]}
    env = actor.sessions["r1"].env
    assert (env.rollout_id, env.attempt) == ("r1", 0)
    assert db.stock() == {"r1": initial_stock(SEED)}
    assert db.rows("sessions") == [("r1", str(SEED), 0)]


async def test_mutations_are_journaled_once_and_a_redelivery_is_not_applied_again(
    db: Database, server
) -> None:
    actor = server()
    await call(actor, 0, "restock", item="nuts", qty=4)
    first = await call(actor, 1, "sell", item="nuts", qty=3)
    again = await call(actor, 1, "sell", item="nuts", qty=3)  # a retry after a lost reply
    assert again == first and actor.counts["tool_duplicates"] == 1
    assert db.stock()["r1"]["nuts"] == initial_stock(SEED)["nuts"] + 4 - 3
    assert [(i, t) for _, i, t, _ in db.journal()["r1"]] == [(0, "restock"), (1, "sell")]


async def test_a_restarted_tool_server_answers_a_redelivered_call_from_the_journal(
    db: Database, server
) -> None:
    before = server()
    await call(before, 0, "restock", item="gears", qty=5)
    applied = await call(before, 1, "sell", item="gears", qty=2)
    rows = db.rows("stock"), db.rows("journal")

    after = server()  # the first server died; the call it answered is delivered again to this one
    again = await call(after, 1, "sell", item="gears", qty=2)
    assert again.ok and again.output == applied.output
    assert after.counts["tool_duplicates"] == 1 and after.counts["tool_mutations_applied"] == 0
    assert after.counts["sessions_reattached"] == 1
    assert (db.rows("stock"), db.rows("journal")) == rows  # nothing applied twice, nothing written
    await call(after, 2, "restock", item="bolts", qty=1)  # and the session carries on in the new server
    assert after.sessions["r1"].revision == 3
    record = [
        {"tool": "restock", "arguments": {"item": "gears", "qty": 5}, "output": {}},
        {"tool": "sell", "arguments": {"item": "gears", "qty": 2}, "output": {}},
        {"tool": "restock", "arguments": {"item": "bolts", "qty": 1}, "output": {}},
    ]
    verdict = await call(after, 3, "verify", calls=record)
    assert verdict.output == {"reward": 1.0}


async def test_a_restarted_server_refuses_an_attempt_the_store_does_not_hold(db: Database, server) -> None:
    await call(server(), 0, "restock", item="gears", qty=5)
    with pytest.raises(ProtocolError, match="holds no session of r1 attempt 1"):
        await call(server(), 1, "restock", rollout="r1", attempt=1, item="gears", qty=5)


async def test_a_refused_call_is_journaled_and_answered_the_same_again(db: Database, server) -> None:
    actor = server()
    refused = await call(actor, 0, "sell", item="bolts", qty=50)
    assert not refused.ok and "only" in str(refused.output["error"])
    assert not (await call(server(), 0, "sell", item="bolts", qty=50)).ok  # a restarted server: the same
    assert db.stock()["r1"] == initial_stock(SEED) and db.journal() == {}


async def test_a_fresh_attempt_resets_the_rows_to_the_seeds(db: Database, server) -> None:
    actor = server()
    await call(actor, 0, "restock", item="bolts", qty=9)
    await call(actor, 0, "restock", attempt=1, item="nuts", qty=1)  # the rollout restarted from its prompt
    assert db.stock()["r1"] == {**initial_stock(SEED), "nuts": initial_stock(SEED)["nuts"] + 1}
    assert [(a, i) for a, i, _, _ in db.journal()["r1"]] == [(1, 0)]
    assert db.rows("sessions") == [("r1", str(SEED), 1)]


async def test_restore_leaves_exactly_the_snapshots_rows(db: Database, server, tmp_path: Path) -> None:
    actor = server()
    await call(actor, 0, "restock", item="bolts", qty=3)
    await call(actor, 1, "sell", item="bolts", qty=2)
    await call(actor, 0, "restock", rollout="r2", item="nuts", qty=1)  # another rollout: left alone
    # The cut holds each rollout at its agent's boundary after its calls so far.
    held = (
        EpisodeRef(rollout_id="r1", attempt=0, replica=0, tools=2),
        EpisodeRef(rollout_id="r2", attempt=0, replica=0, tools=1),
    )
    commit = Commit(checkpoint_id="c1", deadline=time.time() + 10, location="tmp_c1", episodes=held)
    await actor.write_snapshot(tmp_path, commit)  # the tool server's own save of its sessions
    at_snapshot = (
        [r for r in db.rows("stock") if r[0] == "r1"],
        [r for r in db.rows("journal") if r[0] == "r1"],
    )
    # The dead timeline carries on after the snapshot: two more mutations, then the crash.
    await call(actor, 2, "restock", item="gears", qty=7)
    await call(actor, 3, "sell", item="nuts", qty=1)
    other = [r for r in db.rows("stock") if r[0] == "r2"]
    assert [r for r in db.rows("journal") if r[0] == "r1"] != at_snapshot[1]

    resumed = server()  # a restarted tool server installs the snapshot for r1's continuing attempt 1
    scope = (EpisodeRef(rollout_id="r1", attempt=1, replica=0),)
    restore = Restore(checkpoint_id="c2", deadline=time.time() + 10, location="snapshot_1", episodes=scope)
    assert await resumed.install_snapshot(tmp_path, restore) == (AttemptRef(rollout_id="r1", attempt=1),)
    assert [r for r in db.rows("stock") if r[0] == "r1"] == at_snapshot[0]
    assert [r for r in db.rows("journal") if r[0] == "r1"] == at_snapshot[1]
    assert [r for r in db.rows("stock") if r[0] == "r2"] == other  # not in the scope: untouched

    # The continuing attempt goes on from the snapshot, its call indices after the saved ones.
    await call(resumed, 2, "restock", attempt=1, item="bolts", qty=1)
    assert ("r1", str(SEED), 1) in db.rows("sessions")
    mutations = [(t, a) for _, _, t, a in db.journal()["r1"]]
    assert mutations == [
        ("restock", {"item": "bolts", "qty": 3}),
        ("sell", {"item": "bolts", "qty": 2}),
        ("restock", {"item": "bolts", "qty": 1}),
    ]
    assert db.stock()["r1"] == replay(SEED, mutations)
    assert resumed.sessions["r1"].revision == 3 and resumed.counts["tool_mutations_duplicated"] == 0


def test_export_and_restore_round_trip(db: Database) -> None:
    env = Inventory(SEED)
    env.bind("r9", 0)
    env.reset()
    saved = env.export()
    assert Inventory.restore(saved).export() == saved and Inventory.restore(saved) == env


async def test_verify_scores_from_the_database(db: Database, server) -> None:
    actor = server()
    await call(actor, 0, "restock", item="bolts", qty=3)
    wrong = [{"tool": "restock", "arguments": {"item": "bolts", "qty": 4}, "output": {}}]
    assert (await call(actor, 1, "verify", calls=wrong)).output == {"reward": 0.0}
    assert [(r[0], r[2]) for r in db.rows("verdicts")] == [("r1", 0.0)]
    actor = server()
    await call(actor, 0, "restock", rollout="r3", item="bolts", qty=3)
    right = [{"tool": "restock", "arguments": {"item": "bolts", "qty": 3}, "output": {}}]
    assert (await call(actor, 1, "verify", rollout="r3", calls=right)).output == {"reward": 1.0}


def test_constructing_it_needs_no_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARKWAY_INVENTORY_DB", str(tmp_path / "never" / "made.sqlite3"))
    monkeypatch.delenv("PARKWAY_INVENTORY_DSN", raising=False)
    Inventory(0)  # the set-up check constructs it; the database is opened on first use only
    assert not (tmp_path / "never").exists()


def test_the_package_imports_parkway_only_through_the_public_api() -> None:
    imported = {
        name
        for path in sorted((inventory.PLUGIN / "parkway_inventory").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        for name in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        )
    }  # fmt: skip
    framework = {name for name in imported if name.split(".")[0] == "parkway"}
    assert framework == {"parkway.actors.sdk"}, framework
