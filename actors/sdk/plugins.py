"""Plugins: the agent programs, environments and trainers a run names, found and checked at set-up.

A run names each plugin either by import path (``package.module:Name``) or by a short name that an
installed distribution registers under an entry-point group, as pytest and Ray find theirs:

    [project.entry-points."parkway.environments"]
    inventory = "my_package.inventory:Inventory"

parkway's own built-ins register the same way (its pyproject.toml). Everything is checked before any
actor starts: a plugin that cannot be imported, is not a class of the right base, breaks its contract
(a tool spec that does not match its method, an exported environment that cannot export) or raises
when constructed is a ``PluginError`` naming it and what is wrong.

Import paths are taken from configuration only. An actor that receives a plugin's name in a message
resolves it among the plugins its own configuration named, or among installed entry points, never by
importing a path the message spells.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from importlib import metadata
from typing import Any

from parkway.actors.sdk.environments import Environment
from parkway.actors.sdk.rollout import AgentProgram
from parkway.actors.sdk.trainer import Trainer


class Kind(StrEnum):
    AGENT = "agent"
    ENVIRONMENT = "environment"
    TRAINER = "trainer"

    @property
    def group(self) -> str:
        """The entry-point group a distribution registers this kind under."""
        return f"parkway.{self.value}s"

    @property
    def base(self) -> type:
        return {Kind.AGENT: AgentProgram, Kind.ENVIRONMENT: Environment, Kind.TRAINER: Trainer}[self]


class PluginError(Exception):
    """A plugin the run names cannot be used; the message names it and what is wrong."""

    def __init__(self, kind: Kind, spec: str, problem: str) -> None:
        super().__init__(f"{kind} plugin {spec!r}: {problem}")
        self.kind = kind
        self.spec = spec
        self.problem = problem


@dataclass(frozen=True)
class Plugin:
    kind: Kind
    spec: str  # as the configuration wrote it
    target: str  # module:qualname of the class
    source: str  # the distribution that registers it ("parkway 0.1.0"), or "import path"
    cls: type


def is_import_path(spec: str) -> bool:
    return ":" in spec


def resolve(kind: Kind, spec: str) -> Plugin:
    """The class ``spec`` names (import path or entry-point name), checked to be of ``kind``'s base."""
    if not isinstance(spec, str) or not spec.strip():
        raise PluginError(
            kind, str(spec), "a plugin is named by 'package.module:Name' or an entry-point name"
        )
    if is_import_path(spec):
        obj, source = _import(kind, spec), "import path"
    else:
        entry = _entry_points(kind).get(spec)
        if entry is None:
            known = ", ".join(sorted(_entry_points(kind))) or "none"
            raise PluginError(
                kind,
                spec,
                f"no installed package registers it under the entry-point group {kind.group!r} "
                f"(installed: {known}); name a class as 'package.module:Name' instead",
            )
        try:
            obj = entry.load()
        except Exception as exc:  # a broken plugin is refused, whatever it raised
            raise PluginError(kind, spec, f"entry point {entry.value!r} does not load: {_say(exc)}") from None
        source = _distribution(entry)
    if not inspect.isclass(obj):
        raise PluginError(kind, spec, f"is a {type(obj).__name__}, not a class")
    if not issubclass(obj, kind.base):
        raise PluginError(
            kind, spec, f"{obj.__module__}.{obj.__qualname__} does not subclass {_path(kind.base)}"
        )
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise PluginError(kind, spec, f"does not implement {missing}")
    return Plugin(kind, spec, f"{obj.__module__}:{obj.__qualname__}", source, obj)


def installed_names(kind: Kind) -> list[str]:
    """The entry-point names installed distributions register for ``kind``."""
    return sorted(_entry_points(kind))


def installed() -> list[Plugin]:
    """Every plugin installed distributions register, built-ins included (``parkway plugins``)."""
    found = []
    for kind in Kind:
        for name in sorted(_entry_points(kind)):
            try:
                found.append(resolve(kind, name))
            except PluginError as exc:
                found.append(
                    Plugin(kind, name, _entry_points(kind)[name].value, f"broken: {exc.problem}", object)
                )
    return found


# -- the contracts ---------------------------------------------------------------------------------
def check_agent(plugin: Plugin) -> type[AgentProgram]:
    cls = plugin.cls
    assert issubclass(cls, AgentProgram)
    if not inspect.iscoroutinefunction(cls.run):
        raise PluginError(plugin.kind, plugin.spec, "run(self, ctx) must be an async def")
    _construct(plugin)
    return cls


def check_environment(plugin: Plugin, mode: str) -> type[Environment]:
    """The environment contract (docs/environments.md): a name, tool specs that match their methods,
    and what ``mode`` needs (exported: a state that can be exported and imported)."""
    cls = plugin.cls
    assert issubclass(cls, Environment)
    problems = environment_problems(cls, mode)
    if problems:
        raise PluginError(plugin.kind, plugin.spec, "; ".join(problems))
    _construct(plugin, seed=0)
    return cls


def environment_problems(cls: type[Environment], mode: str) -> list[str]:
    problems = []
    if not isinstance(cls.name, str) or cls.name == Environment.name or not cls.name:
        problems.append("has no name of its own (set the class attribute 'name': what tasks call it)")
    if not cls.tools:
        problems.append("has no tools (the class attribute 'tools': a tuple of ToolSpec)")
    for spec in cls.tools:
        method = getattr(cls, f"tool_{spec.name}", None)
        if method is None or not callable(method):
            problems.append(f"tool {spec.signature()} has no method tool_{spec.name}")
            continue
        parameters = [
            p.name
            for p in list(inspect.signature(method).parameters.values())[1:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        expected = [name for name, _ in spec.args]
        if sorted(parameters) != sorted(expected):
            problems.append(
                f"tool {spec.signature()} does not match its method tool_{spec.name}"
                f"({', '.join(parameters)}): the spec's arguments are ({', '.join(expected)})"
            )
    if cls.state_lives_in != "process" and not _overrides(cls, "reset"):
        problems.append(
            f"keeps its state in {cls.state_lives_in} and does not implement reset(): a fresh session "
            "(a new attempt, a stateless reopen) must put the store's rows back to the seed's"
        )
    if mode not in cls.modes:
        problems.append(
            f"does not support resources.mode {mode!r} (it supports: {', '.join(sorted(cls.modes))})"
        )
    elif mode == "exported" and not cls.exports_state():
        problems.append(
            f"keeps its state in {cls.state_lives_in} and does not implement export() and restore(): "
            "resources.mode 'exported' saves each session's state at a boundary and imports it on restore"
        )
    return problems


def _overrides(cls: type[Environment], method: str) -> bool:
    return any(
        method in k.__dict__ for k in cls.__mro__ if k is not Environment and issubclass(k, Environment)
    )


def check_trainer(plugin: Plugin, options: dict[str, Any]) -> Trainer:
    """The trainer the run uses: constructed with ``trainer.options`` as keywords."""
    trainer = _construct(plugin, **options)
    assert isinstance(trainer, Trainer)
    return trainer


def _construct(plugin: Plugin, **kwargs: Any) -> object:
    try:
        return plugin.cls(**kwargs)
    except Exception as exc:  # its own bug or a bad option: refused here, not in a running actor
        raise PluginError(plugin.kind, plugin.spec, f"raised in __init__: {_say(exc)}") from None


# -- catalogues --------------------------------------------------------------------------------
def environments(specs: Iterable[str], mode: str) -> dict[str, type[Environment]]:
    """The run's environments by the name tasks use, each checked for ``mode``."""
    catalogue: dict[str, type[Environment]] = {}
    for spec in specs:
        plugin = resolve(Kind.ENVIRONMENT, spec)
        cls = check_environment(plugin, mode)
        if cls.name in catalogue and catalogue[cls.name] is not cls:
            raise PluginError(
                Kind.ENVIRONMENT, spec, f"its name {cls.name!r} is taken by {_path(catalogue[cls.name])}"
            )
        catalogue[cls.name] = cls
    return catalogue


def agent(spec: str) -> type[AgentProgram]:
    return check_agent(resolve(Kind.AGENT, spec))


def find_environment(name: str) -> type[Environment] | None:
    """An installed environment by entry-point name (a snapshot names its sessions' environments)."""
    try:
        cls = resolve(Kind.ENVIRONMENT, name).cls if not is_import_path(name) else None
    except PluginError:
        return None
    return cls if cls is not None and issubclass(cls, Environment) else None


def find_agent(name: str) -> type[AgentProgram] | None:
    """An installed agent program by entry-point name, for an actor started without a configuration."""
    if is_import_path(name):
        return None
    try:
        return agent(name)
    except PluginError:
        return None


# -- plumbing ----------------------------------------------------------------------------------
def _import(kind: Kind, spec: str) -> object:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise PluginError(kind, spec, "an import path is 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise PluginError(kind, spec, f"cannot import module {module_name!r}: {exc}") from None
    except Exception as exc:
        raise PluginError(kind, spec, f"importing module {module_name!r} raised {_say(exc)}") from None
    obj: object = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise PluginError(kind, spec, f"module {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    return obj


def _entry_points(kind: Kind) -> dict[str, metadata.EntryPoint]:
    return {entry.name: entry for entry in metadata.entry_points(group=kind.group)}


def _distribution(entry: metadata.EntryPoint) -> str:
    dist = entry.dist
    return f"{dist.name} {dist.version}" if dist is not None else "an entry point"


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _say(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
