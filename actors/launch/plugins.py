"""The plugins of one run, resolved and checked before any actor starts (``actors/sdk/plugins.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from parkway.actors.builtin.blackbox.program import CommandAgent, command_agent
from parkway.actors.run.config import ConfigError, RunConfig
from parkway.actors.run.tasks import Task
from parkway.actors.sdk import plugins
from parkway.actors.sdk.environments import Environment
from parkway.actors.sdk.rollout import AgentProgram
from parkway.actors.sdk.trainer import Trainer


@dataclass(frozen=True)
class RunPlugins:
    programs: dict[str, type[AgentProgram]]  # by the name the run's Run messages carry
    environments: dict[str, type[Environment]]  # by the name tasks use
    trainer: plugins.Plugin

    def new_trainer(self, config: RunConfig) -> Trainer:
        return plugins.check_trainer(self.trainer, dict(config.trainer.options))


def resolve_run(config: RunConfig, tasks: Sequence[Task] | None = None) -> RunPlugins:
    """Every plugin ``config`` names, checked; with ``tasks``, every task's environment must be one of
    them. ``PluginError`` or ``ConfigError`` naming what is wrong."""
    programs = {config.agent: plugins.agent(config.agent)}
    environments = plugins.environments(config.environments, config.resources.mode)
    trainer = plugins.resolve(plugins.Kind.TRAINER, config.trainer.kind)
    plugins.check_trainer(trainer, dict(config.trainer.options))  # constructing it is part of the check
    for number, task in enumerate(tasks or (), start=1):
        if task.env not in environments:
            raise ConfigError(
                f"tasks: task {number} runs in environment {task.env!r}, which the run does not have "
                f"(environments: {', '.join(sorted(environments))})"
            )
    return RunPlugins(programs, environments, trainer)


def actor_options(role: str, config: RunConfig) -> dict[str, Any]:
    """The catalogues an agent or a resources actor is built with."""
    if role == "agent":
        program = plugins.agent(config.agent)
        if issubclass(program, CommandAgent):  # a black-box program: bound to its command
            program = command_agent(
                config.command.argv, timeout_s=config.command.timeout_s, env=config.command.env
            )
        return {
            "programs": {config.agent: program},
            "environments": plugins.environments(config.environments, config.resources.mode),
        }
    if role == "resources":
        return {"environments": plugins.environments(config.environments, config.resources.mode)}
    return {}
