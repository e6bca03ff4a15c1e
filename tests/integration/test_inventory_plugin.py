"""The outside plugin package examples/inventory-plugin as a user runs it: installed with pip, found by
its entry points, ``parkway run --config examples/inventory-plugin/run.yaml`` embedded, and the whole
cluster over RabbitMQ SIGKILLed mid-run and restored, on SQLite and on PostgreSQL. What the database's
own rows say decides: each sealed rollout's mutations applied exactly once (journal == the agent's
record of its calls, stock == a replay of the journal) and no row of a dead timeline left."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from parkway.actors.runtime.packs import read_records
from parkway.actors.sdk import plugins

from tests.support import inventory
from tests.support.crash_cluster import cluster, start_driver
from tests.support.inventory import Database
from tests.support.processes import actor_env

pytestmark = pytest.mark.slow

RUN_YAML = inventory.PLUGIN / "run.yaml"


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package installed as a user installs it (pip, offline), its entry points visible here and
    to every process the tests start."""
    return inventory.install(tmp_path_factory.mktemp("inventory-plugin"))


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "postgres" and (problem := inventory.postgres_problem()):
        pytest.skip(problem)
    chosen = inventory.database(request.param, tmp_path / "db")
    yield chosen
    chosen.drop()


def test_the_entry_points_resolve_through_the_registry(installed: Path) -> None:
    environment = plugins.resolve(plugins.Kind.ENVIRONMENT, "inventory")
    agent = plugins.resolve(plugins.Kind.AGENT, "stocker")
    assert environment.target == "parkway_inventory.environment:Inventory"
    assert agent.target == "parkway_inventory.agent:Stocker"
    assert environment.source == agent.source == "parkway-inventory 0.1.0"
    assert Path(sys.modules[environment.cls.__module__].__file__ or "").is_relative_to(installed)
    assert plugins.check_environment(environment, "exported").state_lives_in == "database"
    assert plugins.check_agent(agent).name == "stocker"
    trainer = plugins.resolve(plugins.Kind.TRAINER, "ledger-advantage")
    assert trainer.target == "parkway_inventory.trainer:LedgerAdvantage"
    assert trainer.source == "parkway-inventory 0.1.0"
    assert plugins.check_trainer(trainer, {}).state()["steps"] == 0
    assert {"inventory", "counter"} <= set(plugins.installed_names(plugins.Kind.ENVIRONMENT))


def audit(db: Database, rollouts: int) -> dict[str, Any]:
    """What the database's rows prove about a finished run; raises on the first thing that is wrong."""
    from parkway_inventory.environment import replay

    verdicts = db.rows("verdicts")
    sessions = {rollout: (int(seed), attempt) for rollout, seed, attempt in db.rows("sessions")}
    journal, stock = db.journal(), db.stock()
    assert len(verdicts) == len({v[0] for v in verdicts}) == rollouts, verdicts  # one verdict each
    for rollout, attempt, reward, record in verdicts:
        seed, held = sessions[rollout]
        assert (held, reward) == (attempt, 1.0), (rollout, held, attempt, reward)
        calls = journal.get(rollout, [])
        indices = [index for _, index, _, _ in calls]
        assert len(indices) == len(set(indices)), f"{rollout}: a call index journaled twice: {calls}"
        assert all(a <= attempt for a, _, _, _ in calls), f"{rollout}: a row of a later attempt: {calls}"
        mutations = [[tool, arguments] for _, _, tool, arguments in calls]
        assert mutations == json.loads(record), f"{rollout}: the journal is not the agent's record"
        assert stock[rollout] == replay(seed, [(t, a) for t, a in mutations]), rollout
    return {
        "mutations": sum(len(c) for c in journal.values()),
        "attempts": sorted(a for _, a, _, _ in verdicts),
    }


def test_parkway_run_embedded_with_only_the_plugins(installed: Path, db: Database, tmp_path: Path) -> None:
    env = actor_env("inventory", tmp_path / "state", **db.variables)
    done = subprocess.run(
        [sys.executable, "-m", "parkway.actors", "run", "--config", str(RUN_YAML), "--json"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6 and summary["rollouts_failed"] == 0
    assert summary["mean_reward"] == 1.0 and summary["sessions_leaked"] == 0
    found = audit(db, rollouts=6)
    assert found["mutations"] == summary["tool_mutations_applied"] > 0


CRASH_CONFIG = """
run: inventory-crash
seed: 5
agent: stocker
environments: [inventory]
trainer: {{kind: ledger-advantage, batch_groups: 1}}
tasks: {{path: {tasks}}}
rollout: {{group_size: 2, max_turns: 6}}
policy: {{host: inline, per_token_delay_s: 0.004}}
topology: {{agents: 2, resources: 2}}
recovery: {{target_level: turn}}
snapshot_interval_s: 0.3
prepare_timeout_s: 10
"""


@pytest.mark.rabbitmq
@pytest.mark.parametrize("fault", ["after_commit@4", "after_publish@4"])
async def test_the_cluster_killed_mid_run_leaves_each_mutation_applied_once_in_the_database(
    installed: Path, db: Database, spawn, client, amqp_url, run_name, tmp_path, fault
) -> None:
    config_path = tmp_path / "run.yaml"
    config_path.write_text(CRASH_CONFIG.format(tasks=inventory.PLUGIN / "tasks.jsonl"))
    state = tmp_path / "state"

    def spawn_here(role: str, replica: int = 0, args: tuple[str, ...] = (), **env: str) -> Any:
        return spawn(role, replica, args, **env, **db.variables)

    first = await cluster(spawn_here, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url, faults=fault)
    _, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == -signal.SIGKILL, f"the controller did not die at {fault}:\n{err[-3000:]}"
    for actor in first:  # the rest of the cluster dies with it
        actor.kill()
    snapshots = sorted((state / "snapshots" / run_name).glob("snapshot_*"))
    assert snapshots, "at least the first snapshot was published before the crash"
    manifest = json.loads((snapshots[-1] / "manifest.json").read_text())
    assert manifest["episodes"], "the snapshot must catch rollouts mid-flight, or this case proves nothing"
    # What the restore will install: the newest snapshot's saved sessions, each with its saved rows.
    saved = {
        item["rollout_id"]: item
        for path in sorted(snapshots[-1].glob("participants/resources/*/sessions.msgpack"))
        for item in read_records(path)
    }
    scope = {rollout: attempt for rollout, attempt in manifest["episodes"]}
    dead = db.journal()  # the dead timeline's rows, at the crash
    beyond = sum(
        len([c for c in dead.get(r, []) if c[1] >= len(saved[r]["applied"])]) for r in scope if r in saved
    )

    await cluster(spawn_here, client, config_path, state)
    driver = start_driver(config_path, run_name, state, amqp_url)
    out, err = await asyncio.to_thread(driver.communicate, timeout=240)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["restores"] == 1 and summary["rollouts_restored"] == len(scope) > 0
    assert summary["rollouts_sealed"] == summary["rollouts_expected"] == 6 and summary["rollouts_failed"] == 0
    assert summary["mean_reward"] == 1.0 and summary["tool_mutations_duplicated"] == 0
    assert summary["sessions_leaked"] == 0
    found = audit(db, rollouts=6)
    assert found["mutations"] > 0
    # Each rollout the snapshot saved continued as a later attempt, and its rows of the saved attempt
    # are exactly the snapshot's: none of the dead timeline's later mutations stayed, none before it lost.
    after = db.journal()
    final = {rollout: attempt for rollout, attempt, _, _ in db.rows("verdicts")}
    continued = [r for r in scope if r in saved]
    assert continued, "the snapshot held sessions of rollouts in flight"
    for rollout in continued:
        assert final[rollout] > scope[rollout], (rollout, final[rollout], scope[rollout])
        kept = [
            [a, i, t, json.dumps(args, sort_keys=True, separators=(",", ":"))]
            for a, i, t, args in after[rollout]
            if a <= scope[rollout]
        ]
        snapshot_rows = [[a, i, t, args] for a, i, t, args, ok, _ in saved[rollout]["env"]["journal"] if ok]
        assert kept == snapshot_rows, rollout
    if fault.startswith("after_commit"):  # the snapshot restored is the one before: ~0.3 s of work after it
        assert beyond > 0, "the dead timeline had mutations after the snapshot (what the restore must drop)"
    print(  # shown with -s: what this case exercised
        f"{db.kind} {fault}: restored {len(continued)} sessions, dropped {beyond} dead-timeline rows, "
        f"{found['mutations']} mutations journaled, final attempts {found['attempts']}"
    )
