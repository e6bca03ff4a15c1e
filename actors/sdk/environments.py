"""Tool environments: the state behind a rollout's tool calls, pure and deterministic (no I/O).

An environment starts from a seed, applies tool calls, and scores a session against the agent's own
record of the calls that succeeded. The score is what makes crash recovery visible: it is 1.0 only
when the state equals what applying exactly the recorded mutations once gives, so a mutation applied
twice (a redelivered call run again) or lost (a crash between apply and reply) costs the reward.

State is a plain JSON-friendly dict, so ``export``/``restore`` round-trip exactly through msgpack or
JSON, and two environments compare equal when their states do.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeGuard, cast

from parkway.actors.sdk.chat import ToolSpec

# Bounds of a ``word`` argument: one token as a model writes it, not free text.
MAX_WORD_LENGTH = 64
# Bounds of a ``text`` argument (a file's contents, a command line) and of a ``path`` one.
MAX_TEXT_LENGTH = 1 << 20
MAX_PATH_LENGTH = 1024

Record = list[tuple[str, dict[str, Any], dict[str, Any]]]


@dataclass(frozen=True)
class CallKey:
    """The key of one tool call: an environment whose state lives outside the process keeps its own
    exactly-once with it (a journal row unique on the key, written in the mutation's transaction)."""

    rollout_id: str
    attempt: int
    call_index: int


@dataclass(frozen=True)
class CallAnswer:
    """What ``Environment.call`` answers: the output, and whether it came from the environment's own
    journal (the call was applied before, by this tool server or one that died) rather than applied now."""

    output: dict[str, Any]
    from_journal: bool = False


class ToolError(Exception):
    """A tool call the environment refuses (unknown tool, bad arguments, an illegal action).

    It is the agent's mistake, not a protocol error: the tool server answers it as ``ok=False``, with
    ``code`` beside the message when the environment gives one (``path_escapes``, ``timeout``, ...).
    """

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def output(self) -> dict[str, Any]:
        """What the tool server answers: the message, and the code when there is one."""
        return {"error": self.message} if self.code is None else {"error": self.message, "code": self.code}


class Environment:
    """Base of every environment. Subclasses set ``name`` and ``tools``, fill ``initial_state`` and
    write one ``tool_<name>(self, **arguments) -> dict`` method per tool; ``apply`` validates the
    arguments against the tool's ``ToolSpec`` before calling it, so tool methods see clean values.
    """

    name: ClassVar[str] = "environment"
    tools: ClassVar[tuple[ToolSpec, ...]] = ()
    # The resources modes it can run in (docs/environments.md): exported (each session's state is
    # saved at a boundary and imported on restore), stateless (a session reopens from its seed),
    # restart_only (a session restarts from the prompt after a crash).
    modes: ClassVar[frozenset[str]] = frozenset({"exported", "stateless", "restart_only"})
    # Where a session's state lives: "process" (``self.state``, exported as plain data by the base
    # class) or somewhere outside (a database), which must implement export and restore itself.
    state_lives_in: ClassVar[str] = "process"
    # Tools whose method is a coroutine (a command that runs for seconds): the tool server awaits
    # ``call_async`` for them, so other sessions' calls go on meanwhile.
    async_tools: ClassVar[frozenset[str]] = frozenset()
    # Tools whose call records the session's state before it starts (docs/workspace.md): the agent passes
    # a boundary right before sending one and counts as parked while it runs, so a checkpoint does not
    # wait for it; the snapshot keeps the session as it was when the call started.
    boundary_before: ClassVar[frozenset[str]] = frozenset()
    # Whether the tool server may keep a copy of a session as it was at the agent's last boundary
    # while a tool round runs (``export()`` before the round's first mutation): a snapshot then cuts
    # such a rollout mid-round, at that boundary, and never waits for its tool calls. None: yes when the
    # state lives in the process (a copy of a small dict); an environment whose export is costly or
    # reads an outside store says False, or True if its export is a cheap copy (docs/environments.md).
    round_copies: ClassVar[bool | None] = None
    # Whether a saved session can be reopened by another tool server than the one that saved it (a
    # restore onto another number of tool servers, docs/recovery.md#another-topology). False for an
    # environment whose export refers to files in its own server's directory.
    portable: ClassVar[bool] = True

    @classmethod
    def keeps_round_copy(cls) -> bool:
        """Whether a snapshot may cut its sessions mid-round (``round_copies``); else it waits for them."""
        if cls.round_copies is not None:
            return cls.round_copies
        return cls.state_lives_in == "process" and "export" not in _own_overrides(cls)

    @classmethod
    def exports_state(cls) -> bool:
        """Whether a session's state can be saved and imported (what exported mode needs)."""
        if cls.state_lives_in == "process":
            return True
        own = [k for k in cls.__mro__ if k is not Environment and issubclass(k, Environment)]
        return all(any(method in k.__dict__ for k in own) for method in ("export", "restore"))

    def __init__(self, seed: int) -> None:
        if not _is_int(seed):
            raise ValueError(f"seed must be an int, not {type(seed).__name__}")
        self.seed = seed
        self.state: dict[str, Any] = self.initial_state(seed)
        # The session this environment serves (``bind``); None until a tool server binds it.
        self.rollout_id: str | None = None
        self.attempt: int | None = None

    def initial_state(self, seed: int) -> dict[str, Any]:
        return {}

    # -- the session's life (docs/environments.md); in-process environments keep the defaults --------
    def bind(self, rollout_id: str, attempt: int) -> None:
        """Tell the environment whose session it is, before any other hook or call: an external store
        namespaces its rows by ``rollout_id``. Called again with the continuing attempt after a restore."""
        self.rollout_id = rollout_id
        self.attempt = attempt

    def locate(self, home: Path) -> None:
        """Where the tool server keeps this environment's files (its replica's own directory), given
        before ``bind``. Environments that keep no files ignore it."""

    def reset(self) -> None:
        """A fresh session (a new attempt, a stateless reopen, a restart-only restart): the session's
        state becomes the seed's. In-process state already is (``__init__``); an external store must
        put its rows back, dropping whatever an earlier attempt left there."""
        self.state = self.initial_state(self.seed)

    def reattach(self) -> tuple[int, ...] | None:
        """A restarted tool server meets a call of a session it no longer holds: the call indices the
        session's store has journaled for the bound attempt's timeline, or None when the store does not
        hold that attempt (the call is then refused as stale). In-process state died with the server."""
        return None

    def call(self, key: CallKey, tool: str, arguments: dict[str, Any]) -> CallAnswer:
        """Run one tool call under its key. The default applies it: the tool server keeps exactly-once
        for in-process state itself. An external store overrides this to journal the call in the
        mutation's own transaction and to answer a key it has journaled from the journal."""
        return CallAnswer(self.apply(tool, arguments))

    async def call_async(self, key: CallKey, tool: str, arguments: dict[str, Any]) -> CallAnswer:
        """Run one call of an ``async_tools`` tool: its method is awaited."""
        spec = self.spec(tool)
        values = _check_arguments(spec, arguments)
        return CallAnswer(await getattr(self, f"tool_{spec.name}")(**values))

    def close(self) -> None:
        """The session ended (verified, released, retired, superseded or forgotten): release what it
        holds (connections). Its rows may stay; the next fresh session of the rollout resets them."""

    # -- tools ---------------------------------------------------------------------------------
    @classmethod
    def spec(cls, tool: str) -> ToolSpec:
        for spec in cls.tools:
            if spec.name == tool:
                return spec
        known = ", ".join(s.name for s in cls.tools)
        raise ToolError(f"unknown tool {tool!r} in {cls.name}; the tools are: {known}")

    def apply(self, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Run one tool call and return its output; ``ToolError`` for anything the call gets wrong."""
        spec = self.spec(tool)
        values = _check_arguments(spec, arguments)
        return getattr(self, f"tool_{spec.name}")(**values)

    # -- scoring -------------------------------------------------------------------------------
    def verify(self, calls: Record) -> float:
        """1.0 when the state equals a fresh replay of exactly the recorded mutations, else 0.0.

        ``calls`` is the agent's record of (tool, arguments, output) of its successful calls. Read-only
        calls are skipped; a recorded mutation that does not replay (bad arguments, insufficient funds)
        means the record and this environment disagree, so it scores 0.0. A tool this environment does
        not have is a malformed record: ``ToolError``.
        """
        mutations = [
            (tool, arguments) for tool, arguments, _ in _check_record(calls) if self.spec(tool).mutates
        ]
        replay = type(self)(self.seed)
        for tool, arguments in mutations:
            try:
                replay.apply(tool, arguments)
            except ToolError:
                return 0.0
        return 1.0 if replay.state == self.state else 0.0

    # -- persistence ---------------------------------------------------------------------------
    def export(self, *, copy_state: bool = True) -> dict[str, Any]:
        """The state as plain data. ``copy_state=False`` shares the live state: for a caller that
        encodes it at once, with no await in between (a snapshot of hundreds of sessions)."""
        return {
            "env": self.name,
            "seed": self.seed,
            "state": copy.deepcopy(self.state) if copy_state else self.state,
        }

    @classmethod
    def restore(cls, data: dict[str, Any]) -> Environment:
        """The inverse of ``export``. On the base class it picks, by ``data["env"]``, among the
        environment classes this process has imported."""
        name = data.get("env") if isinstance(data, dict) else None
        name = name if isinstance(name, str) else None
        target = (_subclass_named(name) if name is not None else None) if cls is Environment else cls
        if target is None or target.name != name:
            raise ValueError(f"cannot restore environment {name!r} as {cls.name}")
        seed = data.get("seed")
        if not _is_int(seed):
            raise ValueError(f"saved {name} seed must be an int, not {type(seed).__name__}")
        environment = target(seed)
        state = data.get("state")
        if not isinstance(state, dict) or state.keys() != environment.state.keys():
            raise ValueError(
                f"saved {name} state {state!r} does not have the keys {sorted(environment.state)}"
            )
        environment.state = copy.deepcopy(state)
        return environment

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Environment):
            return NotImplemented
        return self.export() == other.export()

    # Unhashable: equality is by state, which changes. None is how Python drops the inherited __hash__;
    # typeshed declares __hash__ a method, so the type checker needs telling.
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed}, state={self.state!r})"


# ---------------------------------------------------------------------------------------------
# Argument checking


def _own_overrides(cls: type[Environment]) -> set[str]:
    """Names the classes between ``cls`` and ``Environment`` define themselves."""
    return {
        name
        for k in cls.__mro__
        if k is not Environment and issubclass(k, Environment)
        for name in k.__dict__
    }


def _subclass_named(name: str) -> type[Environment] | None:
    """An environment class of this process named ``name`` (the base's ``restore`` picks by name)."""
    pending = list(Environment.__subclasses__())
    while pending:
        cls = pending.pop()
        if cls.name == name:
            return cls
        pending.extend(cls.__subclasses__())
    return None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_record(calls: object) -> Record:
    """The record ``verify`` takes: a list of (tool, arguments, output) with a str and two dicts."""
    if not isinstance(calls, list | tuple):
        raise ToolError(f"the record of calls must be a list, not {type(calls).__name__}")
    for position, entry in enumerate(calls):
        if not (
            isinstance(entry, list | tuple)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and isinstance(entry[1], dict)
            and isinstance(entry[2], dict)
        ):
            raise ToolError(f"record entry {position} is not (tool, arguments, output): {entry!r}")
    return cast(Record, list(calls))  # every entry was checked above


def _check_arguments(spec: ToolSpec, arguments: object) -> dict[str, Any]:
    """The arguments of one call, checked against the spec: exact names, and each value of its type."""
    if not isinstance(arguments, dict):
        raise ToolError(f"{spec.signature()}: arguments must be an object, not {type(arguments).__name__}")
    expected = [name for name, _ in spec.args]
    missing = [name for name in expected if name not in arguments]
    unexpected = sorted(str(name) for name in arguments if name not in expected)
    if missing or unexpected:
        parts = [
            f"missing {', '.join(missing)}" if missing else "",
            f"unexpected {', '.join(unexpected)}" if unexpected else "",
        ]
        raise ToolError(f"{spec.signature()}: {'; '.join(p for p in parts if p)}")
    return {name: _check_value(spec, name, kind, arguments[name]) for name, kind in spec.args}


def _check_value(spec: ToolSpec, name: str, kind: str, value: object) -> Any:
    if kind == "int":
        if not _is_int(value):
            raise ToolError(f"{spec.signature()}: {name!r} must be an integer, not {value!r}")
        return value
    if kind == "word":
        if (
            not isinstance(value, str)
            or not 0 < len(value) <= MAX_WORD_LENGTH
            or not value.isprintable()
            or any(c.isspace() for c in value)
        ):
            raise ToolError(
                f"{spec.signature()}: {name!r} must be one word (1..{MAX_WORD_LENGTH} printable characters, "
                f"no spaces), not {value!r}"
            )
        return value
    if kind == "text":
        if not isinstance(value, str) or len(value) > MAX_TEXT_LENGTH:
            raise ToolError(
                f"{spec.signature()}: {name!r} must be a string of at most {MAX_TEXT_LENGTH} characters"
            )
        return value
    if kind == "path":
        if not isinstance(value, str) or not 0 < len(value) <= MAX_PATH_LENGTH or not value.isprintable():
            raise ToolError(
                f"{spec.signature()}: {name!r} must be a path (1..{MAX_PATH_LENGTH} printable characters), "
                f"not {value!r:.200}"
            )
        return value
    if kind.startswith("choice:"):
        options = kind.removeprefix("choice:").split("|")
        if not isinstance(value, str) or value not in options:
            raise ToolError(
                f"{spec.signature()}: {name!r} must be one of {', '.join(options)}, not {value!r}"
            )
        return value
    raise AssertionError(f"{spec.signature()}: unknown argument type {kind!r}")  # a bug in a ToolSpec
