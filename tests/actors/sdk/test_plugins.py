"""Plugins named by import path or entry point: found, checked at set-up, refused with a clear message.

The plugins under test are written into a module of a temporary directory put on ``sys.path``, as a
user's own package would be: nothing here is parkway's own code.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from parkway.actors.launch.plugins import actor_options, resolve_run
from parkway.actors.run.config import ConfigError, from_dict
from parkway.actors.run.tasks import Task
from parkway.actors.sdk import plugins
from parkway.actors.sdk.plugins import Kind, PluginError

from tests.support.embedded import embedded_run

USER_PLUGINS = """
from parkway.actors.sdk import AgentProgram, Environment, RolloutContext, ToolSpec, Trainer, TrainStep


class Tally(Environment):
    name = "tally"
    tools = (ToolSpec("add", (("n", "int"),)), ToolSpec("total", (), mutates=False))

    def initial_state(self, seed):
        return {"total": 0}

    def tool_add(self, n):
        self.state["total"] += n
        return {"total": self.state["total"]}

    def tool_total(self):
        return {"total": self.state["total"]}


class Adder(AgentProgram):
    name = "adder"

    async def run(self, ctx: RolloutContext) -> float:
        for turn in range(ctx.max_turns):
            await ctx.generate([])
            await ctx.call_tool("add", {"n": turn + 1})
            await ctx.end_tool_round()
        return await ctx.verify()


class Counting(Trainer):
    def __init__(self, start=0):
        self.version = start
        self.batches = 0

    def train(self, batch):
        self.version += 1
        self.batches += 1
        rows = [r for g in batch for r in g.rows]
        return TrainStep(step=self.batches, policy_version=self.version, groups=len(batch),
                         samples=len(rows), failed=0, mean_reward=1.0, tokens=0)

    def state(self):
        return {"policy_version": self.version}

    def load_state(self, state):
        self.version = state["policy_version"]


# -- the five bad kinds ---------------------------------------------------------------------------
class NotAnAgent:
    async def run(self, ctx):
        return 0.0


class Mismatched(Tally):
    name = "mismatched"
    tools = (ToolSpec("add", (("amount", "int"),)),)  # the method takes n


class Outside(Tally):
    name = "outside"
    state_lives_in = "a database"  # and no export or restore of its own

    def reset(self):  # what a fresh session needs of state outside the process
        self.state = self.initial_state(self.seed)


class Exploding(Tally):
    name = "exploding"

    def __init__(self, seed):
        raise RuntimeError("no database at localhost:1")


class Sync(AgentProgram):
    name = "sync"

    def run(self, ctx):
        return 0.0
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"user_plugins_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_PLUGINS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def refused(kind: Kind, spec: str, **check: Any) -> str:
    with pytest.raises(PluginError) as caught:
        plugin = plugins.resolve(kind, spec)
        if kind is Kind.ENVIRONMENT:
            plugins.check_environment(plugin, check.get("mode", "exported"))
        elif kind is Kind.AGENT:
            plugins.check_agent(plugin)
        else:
            plugins.check_trainer(plugin, check.get("options", {}))
    assert caught.value.kind is kind and caught.value.spec == spec
    return str(caught.value)


# -- found -----------------------------------------------------------------------------------------
def test_the_built_ins_are_entry_points_of_the_installed_distribution() -> None:
    found = {(str(p.kind), p.spec): p for p in plugins.installed()}
    assert {("agent", "tool"), ("agent", "counter"), ("environment", "bank"), ("trainer", "example")} <= set(
        found
    )
    tool = found["agent", "tool"]
    assert tool.target == "parkway.actors.builtin.agents:ToolAgent" and tool.source.startswith("parkway ")


def test_an_import_path_names_a_class_of_the_users_own(user_module: str) -> None:
    plugin = plugins.resolve(Kind.ENVIRONMENT, f"{user_module}:Tally")
    assert plugin.source == "import path" and plugin.target == f"{user_module}:Tally"
    assert plugins.check_environment(plugin, "exported").name == "tally"


# -- refused: the five kinds the issue names, and more ----------------------------------------------
def test_a_missing_module_is_refused_naming_it() -> None:
    message = refused(Kind.AGENT, "no_such_package.agents:Mine")
    assert message == (
        "agent plugin 'no_such_package.agents:Mine': cannot import module 'no_such_package.agents': "
        "No module named 'no_such_package'"
    )


def test_a_class_of_the_wrong_base_is_refused(user_module: str) -> None:
    message = refused(Kind.AGENT, f"{user_module}:NotAnAgent")
    assert f"{user_module}.NotAnAgent does not subclass parkway.actors.sdk.rollout.AgentProgram" in message


def test_an_exported_environment_that_cannot_export_is_refused(user_module: str) -> None:
    message = refused(Kind.ENVIRONMENT, f"{user_module}:Outside", mode="exported")
    assert "keeps its state in a database and does not implement export() and restore()" in message
    # The same class may run where nothing is exported.
    assert plugins.check_environment(plugins.resolve(Kind.ENVIRONMENT, f"{user_module}:Outside"), "stateless")


def test_a_plugin_raising_in_init_is_refused_with_what_it_raised(user_module: str) -> None:
    message = refused(Kind.ENVIRONMENT, f"{user_module}:Exploding")
    assert message.endswith("raised in __init__: RuntimeError: no database at localhost:1")
    message = refused(Kind.TRAINER, f"{user_module}:Counting", options={"begin": 3})
    assert "raised in __init__: TypeError" in message and "begin" in message


def test_a_tool_spec_that_does_not_match_its_method_is_refused(user_module: str) -> None:
    message = refused(Kind.ENVIRONMENT, f"{user_module}:Mismatched")
    assert (
        "tool add(amount:int) does not match its method tool_add(n): the spec's arguments are (amount)"
        in message
    )


def test_an_unknown_entry_point_lists_what_is_installed() -> None:
    message = refused(Kind.TRAINER, "ppo")
    assert "no installed package registers it under the entry-point group 'parkway.trainers'" in message
    assert "(installed: example" in message


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("user:Missing", "has no attribute 'Missing'"),
        ("user:", "an import path is 'package.module:Name'"),
        ("user:Sync", "run(self, ctx) must be an async def"),
        ("user:USER_NAME", "is a str, not a class"),
    ],
)
def test_other_bad_agents_are_refused(user_module: str, spec: str, problem: str) -> None:
    sys.modules.pop(user_module, None)
    module = __import__(user_module)
    module.USER_NAME = "not a class"
    assert problem in refused(Kind.AGENT, spec.replace("user", user_module))


# -- a run's plugins -------------------------------------------------------------------------------
def test_a_run_naming_user_plugins_resolves_each_and_checks_its_tasks(user_module: str) -> None:
    config = from_dict(
        {
            "agent": f"{user_module}:Adder",
            "environments": [f"{user_module}:Tally", "counter"],
            "trainer": {"kind": f"{user_module}:Counting", "options": {"start": 5}},
        }
    )
    found = resolve_run(config, [Task(env="tally", prompt="add"), Task(env="counter", prompt="count")])
    assert set(found.environments) == {"tally", "counter"}
    assert found.new_trainer(config).state() == {"policy_version": 5}
    with pytest.raises(ConfigError, match="task 2 runs in environment 'bank', which the run does not have"):
        resolve_run(config, [Task(env="tally", prompt="add"), Task(env="bank", prompt="pay")])
    options = actor_options("agent", config)
    assert options["programs"][f"{user_module}:Adder"].name == "adder"


def test_two_environments_of_one_name_are_refused(user_module: str) -> None:
    config = from_dict({"environments": [f"{user_module}:Tally", f"{user_module}:Tally"]})
    resolve_run(config)  # the same class twice is harmless
    sys.modules[user_module].Copy = type("Copy", (sys.modules[user_module].Tally,), {})
    config = from_dict({"environments": [f"{user_module}:Tally", f"{user_module}:Copy"]})
    with pytest.raises(PluginError, match=r"its name 'tally' is taken by user_plugins_.*\.Tally"):
        resolve_run(config)


def test_config_refuses_a_plugin_name_that_is_no_name() -> None:
    with pytest.raises(ConfigError, match="agent: 'two words' is neither an entry-point name nor"):
        from_dict({"agent": "two words"})
    with pytest.raises(ConfigError, match="environments: a run needs at least one environment"):
        from_dict({"environments": []})


async def test_a_whole_run_of_user_plugins_seals_every_rollout(user_module: str, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"env": "tally", "prompt": "add up"}\n' * 2)
    summary = await embedded_run(
        {
            "run": "plugins",
            "agent": f"{user_module}:Adder",
            "environments": [f"{user_module}:Tally"],
            "trainer": {"kind": f"{user_module}:Counting", "batch_groups": 1},
            "tasks": {"path": str(tasks)},
            "rollout": {"group_size": 2, "max_turns": 3},
            "policy": {"host": "inline"},
            "snapshot_interval_s": 0.05,
        },
        tmp_path / "state",
    )
    assert summary.rollouts_sealed == summary.rollouts_expected == 4
    assert summary.rollouts_failed == 0 and summary.train_steps == 2
    assert summary.tool_mutations_applied == 4 * 3  # the user's environment applied every add once
