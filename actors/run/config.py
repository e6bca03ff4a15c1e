"""One typed configuration for a run (docs/configuration.md): YAML file plus environment overrides.

Unknown keys are refused with their dotted path; cross-field rules are checked before anything starts.
Keys mirror NeMo RL's where they exist (``snapshot_interval_s``, ``prepare_timeout_s``,
``max_consecutive_failures``, ``keep_latest_k``, ``restore_mode``, ``recovery.target_level``,
``recovery.default_granularity``); what failed snapshots may do to a run is ``snapshots.*``
(``max_consecutive_failures`` is ``snapshots.end_after_failures``, null by default).

Environment overrides: ``PARKWAY_CFG__ROLLOUT__GROUP_SIZE=4`` sets ``rollout.group_size`` (the value is
read as a YAML scalar, so ``4`` is an int and ``true`` a bool).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml
from parkway.protocol import ranges

ENV_PREFIX = "PARKWAY_CFG__"
# The engines that continue a model call from the tokens a snapshot kept (``Engine.continues``):
# ``recovery.target_level: prefix`` is refused with any other.
PREFIX_ENGINES = ("deterministic", "vllm")


class ConfigError(Exception):
    """The configuration is invalid; the message names the key (dotted path) and what is wrong."""


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class RolloutConfig(_Section, frozen=True):
    group_size: int = 3  # G siblings per prompt
    max_turns: int = 5
    max_attempts: int = 3  # per rollout (sibling) or per group redo (prompt_group)
    max_in_flight: int = 64  # rollouts dispatched and not finished, across all agents
    max_tokens: int = 160  # per model call (byte tokens: a tool call is about 100)
    stall_timeout_s: float = 1800.0  # an attempt with no result after this long (not counting parked time)


class TasksConfig(_Section, frozen=True):
    path: str | None = None  # JSONL: {"env": ..., "prompt": ..., "max_turns"?: int} per line
    builtin: Literal["mixed", "counter", "workplace", "bank", "letters"] = "mixed"
    limit: int | None = None  # use the first N tasks


class PolicyConfig(_Section, frozen=True):
    engine: Literal["deterministic", "vllm"] = "deterministic"
    host: Literal["ray", "inline"] = "ray"
    engines: int = 1
    per_token_delay_s: float = 0.0  # deterministic engine: simulated time per token
    cpu_per_token_s: float = 0.0  # deterministic engine: CPU spent per token (a busy loop; same tokens)
    filler_words: int = 6  # deterministic engine: words said before each tool call or answer (long replies)
    # vLLM: a model directory (``parkway model build DIR`` makes a tiny one), and its engine settings.
    model: str | None = None
    max_model_len: int = 2048
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None  # GPU machines; None on CPU
    kv_cache_memory_bytes: int | None = 64 << 20  # CPU machines need an explicit KV cache size
    # recovery.target_level prefix, engines in Ray actors: how often the policy asks them for the tokens
    # of the calls in flight (a snapshot keeps what was known at its last poll; an engine in the
    # policy's own process is read at the snapshot itself).
    progress_interval_s: float = 0.5
    # A file the engine appends one JSON line to per generation (tokens kept from a snapshot, tokens
    # generated, finish reason): its own account of its work, for crash tests and audits. None: off.
    engine_record: str | None = None
    # host ray: an existing Ray cluster to run the engines on ("auto", "host:port", "ray://host:port");
    # None starts a Ray of the policy's own. What each engine replica asks Ray for (engines/ray_placement.py).
    ray_address: str | None = None
    gpus_per_engine: float = 0.0
    cpus_per_engine: float = 0.0
    engine_resources: dict[str, float] = {}


class ResourcesConfig(_Section, frozen=True):
    mode: Literal["exported", "stateless", "restart_only"] = "exported"
    tool_delay_s: float = 0.0  # simulated time each tool call takes (the built-in environments are instant)


class RecoveryConfig(_Section, frozen=True):
    target_level: Literal["prompt_group", "sibling", "turn", "prefix"] = "turn"
    default_granularity: Literal["prompt_group", "sibling"] = "sibling"
    allow_restart_only: bool = False


class TrainerConfig(_Section, frozen=True):
    # A trainer plugin: an entry-point name under ``parkway.trainers`` or ``package.module:Name``.
    kind: str = "example"
    options: dict[str, Any] = {}  # keywords its constructor takes
    batch_groups: int = 2
    checkpoint_every: int = 0  # train steps between trainer checkpoints (0: never)
    # A trainer checkpoint whose files cannot be written is tried again this often, the pause doubling
    # from checkpoint_retry_s (capped at 30 s); then that step goes without one and the run goes on.
    checkpoint_retries: int = 5
    checkpoint_retry_s: float = 1.0
    # Where the trainer actor runs: "inline" in the controller's process (an embedded run, or a
    # controller of its own), "service": a ``parkway actor trainer`` process the controller waits for.
    host: Literal["inline", "service"] = "inline"
    resend_s: float = 5.0  # a Train unanswered this long is sent again (the same step, the same id)
    # Admit groups in whole batches of batch_groups, the next only once the last is trained and its
    # weights loaded: every generation's weights follow from its batch index (a deterministic run).
    on_policy: bool = False
    # Groups sealed and not yet trained (waiting, or in the step being trained) at which admission
    # stops until the trainer catches up: a trainer slower than generation would otherwise leave an
    # ever longer backlog in the ledger, in TQ and in every snapshot. None: max(16, 2 x batch_groups).
    max_untrained_groups: int | None = None

    def untrained_bound(self) -> int:
        return self.max_untrained_groups or max(16, 2 * self.batch_groups)


class FaultsConfig(_Section, frozen=True):
    # "ROLLOUT@ATTEMPT:TURN", e.g. "t0_g1@0:2": that attempt fails at that turn (a live failure).
    fail_attempts: tuple[str, ...] = ()
    failure_rate: float = 0.0  # every attempt fails with this probability (seeded, reproducible)


class SnapshotsConfig(_Section, frozen=True):
    """What failed snapshots do to the run (``protocol/snapshot_failures.py``): by default nothing but
    back off and retry; ending the run is the operator's choice."""

    end_after_failures: int | None = None  # transient failures in a row that end the run; None: never
    end_after_failing_s: float | None = None  # seconds of failures in a row that end the run; None: never
    backoff_max_s: float = (
        300.0  # the longest wait between attempts after failures (doubling from the interval)
    )


class TopologyConfig(_Section, frozen=True):
    agents: int = 2
    resources: int = 2
    policies: int = 1  # policy replicas; a rollout's calls all go to one (protocol/placement.py)
    tq_shards: int = 1  # TQ processes, each holding the rows of the rollouts that hash to it


class CommandConfig(_Section, frozen=True):
    """``agent: command``: a black-box program run per attempt, talking to the run over HTTP (the OpenAI
    API and the tools; docs/blackbox.md)."""

    argv: tuple[str, ...] = ()  # the program and its arguments (no shell)
    timeout_s: float = 3600.0  # one attempt's program running longer than this fails as agent_timeout
    env: dict[str, str] = {}  # added to its environment


class RunConfig(_Section, frozen=True):
    run: str = "default"
    seed: int = 0
    # Plugins (docs/plugins.md): an entry-point name or ``package.module:Name``.
    agent: str = "tool"  # the agent program
    environments: tuple[str, ...] = ("counter", "workplace", "bank")  # the tool environments tasks name
    command: CommandConfig = CommandConfig()  # agent: command
    rollout: RolloutConfig = RolloutConfig()
    tasks: TasksConfig = TasksConfig()
    policy: PolicyConfig = PolicyConfig()
    resources: ResourcesConfig = ResourcesConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    trainer: TrainerConfig = TrainerConfig()
    faults: FaultsConfig = FaultsConfig()
    topology: TopologyConfig = TopologyConfig()
    snapshot_interval_s: float = 120.0
    prepare_timeout_s: float = 30.0
    snapshots: SnapshotsConfig = SnapshotsConfig()
    keep_latest_k: int = 2
    restore_mode: Literal["latest"] = "latest"
    snapshot_root: str = ".parkway/snapshots"


_FAULT = re.compile(r"^(?P<rollout>[^@\s]+)@(?P<attempt>\d+):(?P<turn>\d+)$")


def parse_fault(text: str) -> tuple[str, int, int]:
    match = _FAULT.fullmatch(text)
    if match is None:
        raise ConfigError(f"faults.fail_attempts: {text!r} is not ROLLOUT@ATTEMPT:TURN")
    return match["rollout"], int(match["attempt"]), int(match["turn"])


def load(path: str | Path | None = None, *, environ: dict[str, str] | None = None) -> RunConfig:
    """Read, override, convert and check a configuration. Raises ``ConfigError``."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded or {}
    apply_overrides(data, os.environ if environ is None else environ)
    return from_dict(data)


def from_dict(data: dict[str, Any]) -> RunConfig:
    data = _nemo_failure_limit(data)
    try:
        config = msgspec.convert(data, RunConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(_dotted(str(exc))) from None
    check(config)
    return config


def apply_overrides(data: dict[str, Any], environ: dict[str, str] | os._Environ[str]) -> None:
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        path = [part.lower() for part in key[len(ENV_PREFIX) :].split("__") if part]
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{key}: {'.'.join(path[:-1])} is not a section")
            node = child
        node[path[-1]] = yaml.safe_load(raw) if raw else raw


def _dotted(message: str) -> str:
    """msgspec says '... - at `$.a.b`'; we say 'a.b: ...', with the unknown key itself in the path."""
    text, _, where = message.rpartition(" - at `$")
    if not text:
        text, where = message, ""
    path = where.rstrip("`").lstrip(".")
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", text)
    if unknown:
        path = f"{path}.{unknown[1]}" if path else unknown[1]
        text = "unknown key"
    return f"{path or '(top level)'}: {text}"


def _nemo_failure_limit(data: dict[str, Any]) -> dict[str, Any]:
    """``max_consecutive_failures``, NeMo RL's name, is ``snapshots.end_after_failures`` when set
    (not by default: failed snapshots never end a run unless the operator says so)."""
    if "max_consecutive_failures" not in data:
        return data
    data = dict(data)
    limit = data.pop("max_consecutive_failures")
    section = data.get("snapshots")
    if isinstance(section, dict) and "end_after_failures" in section:
        raise ConfigError(
            "max_consecutive_failures: the same as snapshots.end_after_failures, which is set too: keep one"
        )
    data["snapshots"] = {**(section if isinstance(section, dict) else {}), "end_after_failures": limit}
    return data


def check(config: RunConfig) -> None:
    """Cross-field rules, each naming its keys."""
    problems = []
    r = config.rollout
    for key, value in (
        ("rollout.group_size", r.group_size),
        ("rollout.max_turns", r.max_turns),
        ("rollout.max_attempts", r.max_attempts),
        ("rollout.max_in_flight", r.max_in_flight),
        ("rollout.max_tokens", r.max_tokens),
        ("policy.engines", config.policy.engines),
        ("topology.agents", config.topology.agents),
        ("topology.resources", config.topology.resources),
        ("topology.policies", config.topology.policies),
        ("topology.tq_shards", config.topology.tq_shards),
        ("trainer.batch_groups", config.trainer.batch_groups),
        ("keep_latest_k", config.keep_latest_k),
    ):
        if value < 1:
            problems.append(f"{key}: must be >= 1, got {value}")
    # What a Run or a model call may carry (``protocol.ranges``): beyond it, every message is refused.
    if r.max_turns > ranges.MAX_TURNS or r.max_tokens > ranges.MAX_TOKENS:
        problems.append(
            f"rollout.max_turns and rollout.max_tokens: at most {ranges.MAX_TURNS} and {ranges.MAX_TOKENS}, "
            f"got {r.max_turns} and {r.max_tokens}"
        )
    if not 0.0 <= config.faults.failure_rate <= 1.0:
        problems.append(f"faults.failure_rate: must be within [0, 1], got {config.faults.failure_rate}")
    if config.trainer.checkpoint_every < 0 or config.trainer.checkpoint_retries < 0:
        problems.append("trainer.checkpoint_every and trainer.checkpoint_retries: must be >= 0")
    if not 0 < config.trainer.checkpoint_retry_s <= 3600:
        problems.append("trainer.checkpoint_retry_s: must be within (0, 3600]")
    if config.rollout.stall_timeout_s <= 0:
        problems.append("rollout.stall_timeout_s: must be > 0")
    if config.trainer.resend_s <= 0:
        problems.append("trainer.resend_s: must be > 0")
    policy = config.policy
    if policy.host == "inline" and (
        policy.ray_address or policy.gpus_per_engine or policy.cpus_per_engine or policy.engine_resources
    ):
        problems.append(
            "policy.ray_address, policy.gpus_per_engine, policy.cpus_per_engine and policy.engine_resources: "
            "only with policy.host: ray (an inline engine runs in the policy's own process)"
        )
    if (
        policy.gpus_per_engine < 0
        or policy.cpus_per_engine < 0
        or any(amount <= 0 for amount in policy.engine_resources.values())
    ):
        problems.append(
            "policy.gpus_per_engine and policy.cpus_per_engine: must be >= 0; policy.engine_resources: "
            "every amount > 0"
        )
    if config.policy.per_token_delay_s < 0:
        problems.append("policy.per_token_delay_s: must be >= 0")
    if config.policy.filler_words < 0:
        problems.append(f"policy.filler_words: must be >= 0, got {config.policy.filler_words}")
    if config.policy.cpu_per_token_s < 0:
        problems.append("policy.cpu_per_token_s: must be >= 0")
    if config.resources.tool_delay_s < 0:
        problems.append("resources.tool_delay_s: must be >= 0")
    if config.snapshot_interval_s <= 0 or config.prepare_timeout_s <= 0:
        problems.append("snapshot_interval_s and prepare_timeout_s: must be > 0")
    failures = config.snapshots
    if failures.end_after_failures is not None and failures.end_after_failures < 1:
        problems.append(
            f"snapshots.end_after_failures: must be >= 1 or null (never), got {failures.end_after_failures}"
        )
    if failures.end_after_failing_s is not None and failures.end_after_failing_s <= 0:
        problems.append(
            f"snapshots.end_after_failing_s: must be > 0 or null (never), got {failures.end_after_failing_s}"
        )
    if failures.backoff_max_s <= 0:
        problems.append(f"snapshots.backoff_max_s: must be > 0, got {failures.backoff_max_s}")
    if config.policy.engine == "vllm" and not config.policy.model:
        problems.append(
            "policy.model: the vllm engine needs a model directory (parkway model build DIR makes one)"
        )
    untrained = config.trainer.max_untrained_groups
    if untrained is not None and untrained < config.trainer.batch_groups:
        problems.append(
            f"trainer.max_untrained_groups: {untrained} is fewer than trainer.batch_groups "
            f"({config.trainer.batch_groups}): no batch could ever fill"
        )
    if config.agent == "command" and not config.command.argv:
        problems.append(
            "command.argv: agent command needs the program to run (a list: program and arguments)"
        )
    if config.command.timeout_s <= 0:
        problems.append(f"command.timeout_s: must be > 0, got {config.command.timeout_s}")
    if config.policy.progress_interval_s <= 0:
        problems.append(f"policy.progress_interval_s: must be > 0, got {config.policy.progress_interval_s}")
    if config.recovery.target_level == "prefix" and config.policy.engine not in PREFIX_ENGINES:
        problems.append(
            f"recovery.target_level: prefix needs an engine that continues a generation from its "
            f"prefix ({', '.join(PREFIX_ENGINES)}), not {config.policy.engine}"
        )
    if config.recovery.allow_restart_only and config.recovery.target_level not in ("turn", "prefix"):
        problems.append(
            "recovery.allow_restart_only: only means something with recovery.target_level turn or "
            f"prefix, not {config.recovery.target_level}"
        )
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,63}", config.run):
        problems.append(f"run: {config.run!r} must match [a-z0-9][a-z0-9_-]{{0,63}}")
    for key, names in (
        ("agent", (config.agent,)),
        ("environments", config.environments),
        ("trainer.kind", (config.trainer.kind,)),
    ):
        for name in names:
            if not re.fullmatch(r"[A-Za-z_][\w.-]*(:[A-Za-z_][\w.]*)?", name):
                problems.append(f"{key}: {name!r} is neither an entry-point name nor package.module:Name")
    if not config.environments:
        problems.append("environments: a run needs at least one environment")
    for fault in config.faults.fail_attempts:
        try:
            parse_fault(fault)
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("; ".join(problems))
