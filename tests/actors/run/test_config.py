"""The run configuration: typed, strict, overridable from the environment, checked across fields."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from parkway.actors.run.config import ConfigError, RunConfig, from_dict, load
from parkway.actors.run.tasks import TasksConfig, load_tasks

from tests.support.paths import ROOT


def test_defaults_mirror_nemo_keys() -> None:
    config = from_dict({})
    assert (config.keep_latest_k, config.restore_mode) == (2, "latest")
    assert config.recovery.default_granularity == "sibling"
    # Failed snapshots back off and retry; they end the run only if the operator says so.
    assert (config.snapshots.end_after_failures, config.snapshots.end_after_failing_s) == (None, None)


def test_nemos_failure_limit_key_is_the_snapshots_end_after_failures() -> None:
    assert from_dict({"max_consecutive_failures": 3}).snapshots.end_after_failures == 3
    assert from_dict({"max_consecutive_failures": None}).snapshots.end_after_failures is None
    with pytest.raises(ConfigError, match=r"^max_consecutive_failures: the same as snapshots.end_after"):
        from_dict({"max_consecutive_failures": 3, "snapshots": {"end_after_failures": 4}})
    with pytest.raises(ConfigError, match=r"snapshots.end_after_failures: must be >= 1 or null"):
        from_dict({"max_consecutive_failures": 0})


@pytest.mark.parametrize(
    ("snapshots", "message"),
    [
        ({"end_after_failures": 0}, "snapshots.end_after_failures: must be >= 1 or null (never), got 0"),
        ({"end_after_failing_s": -1}, "snapshots.end_after_failing_s: must be > 0 or null (never), got -1"),
        ({"backoff_max_s": 0}, "snapshots.backoff_max_s: must be > 0, got 0"),
    ],
)
def test_the_snapshot_failure_policy_is_checked(snapshots: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict({"snapshots": snapshots})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"rollout": {"gruop_size": 3}}, "rollout.gruop_size: unknown key"),
        ({"bogus": 1}, "bogus: unknown key"),
        ({"policy": {"engine": "gpt"}}, "policy.engine"),
        ({"rollout": {"group_size": "three"}}, "rollout.group_size: Expected `int`, got `str`"),
        ({"rollout": {"group_size": 0}}, "rollout.group_size: must be >= 1"),
        ({"rollout": {"max_turns": 20_000}}, "rollout.max_turns and rollout.max_tokens: at most 10000"),
        ({"rollout": {"max_tokens": 2**21}}, "got 5 and 2097152"),  # what a Run and a call may carry
        ({"policy": {"progress_interval_s": 0}}, "policy.progress_interval_s: must be > 0"),
        ({"policy": {"filler_words": -1}}, "policy.filler_words: must be >= 0"),
        (
            {"recovery": {"target_level": "sibling", "allow_restart_only": True}},
            "recovery.allow_restart_only",
        ),
        ({"faults": {"fail_attempts": ["nonsense"]}}, "is not ROLLOUT@ATTEMPT:TURN"),
        ({"faults": {"failure_rate": 1.5}}, "faults.failure_rate"),
        ({"resources": {"tool_delay_s": -1}}, "resources.tool_delay_s: must be >= 0"),
        ({"policy": {"cpu_per_token_s": -0.001}}, "policy.cpu_per_token_s: must be >= 0"),
        ({"run": "Bad Name"}, "run: 'Bad Name'"),
    ],
)
def test_bad_configs_name_the_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_dict(data)
    assert message in str(info.value)


def test_environment_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  group_size: 2\nrecovery:\n  default_granularity: sibling\n")
    config = load(
        path,
        environ={
            "PARKWAY_CFG__ROLLOUT__GROUP_SIZE": "5",
            "PARKWAY_CFG__RECOVERY__DEFAULT_GRANULARITY": "prompt_group",
            "OTHER": "x",
        },
    )
    assert config.rollout.group_size == 5 and config.recovery.default_granularity == "prompt_group"
    with pytest.raises(ConfigError, match=r"rollout\.nope: unknown key"):
        load(path, environ={"PARKWAY_CFG__ROLLOUT__NOPE": "1"})


def test_file_errors_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="No such file"):
        load(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load(bad, environ={})


@pytest.mark.parametrize("name", ["quickstart", "live-failures", "from-file"])
def test_shipped_examples_load(name: str) -> None:
    path = ROOT / "examples" / f"{name}.yaml"
    config = load(path, environ={})
    assert isinstance(config, RunConfig)
    assert load_tasks(config.tasks, base=path.parent)


def test_tasks_from_jsonl_and_bad_lines(tmp_path: Path) -> None:
    good = tmp_path / "t.jsonl"
    good.write_text(
        '{"env": "bank", "prompt": "pay"}\n\n{"env": "counter", "prompt": "count", "max_turns": 2}\n'
    )
    tasks = load_tasks(TasksConfig(path=str(good)))
    assert [(t.env, t.max_turns) for t in tasks] == [("bank", None), ("counter", 2)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"env": "bank", "prompt": "pay"}\n{"env": "bank"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        load_tasks(TasksConfig(path=str(bad)))
    assert len(load_tasks(TasksConfig(builtin="mixed", limit=4))) == 4


@pytest.mark.parametrize("engine", [{}, {"engine": "vllm", "model": "/m"}])
def test_prefix_recovery_is_taken_with_an_engine_that_continues(engine: dict) -> None:
    config = from_dict({"recovery": {"target_level": "prefix"}, "policy": engine})
    assert config.recovery.target_level == "prefix"


def test_prefix_recovery_is_refused_with_an_engine_that_cannot_continue(monkeypatch) -> None:
    from parkway.actors.run import config as config_module

    monkeypatch.setattr(config_module, "PREFIX_ENGINES", ("vllm",))
    with pytest.raises(ConfigError, match="prefix needs an engine that continues a generation"):
        from_dict({"recovery": {"target_level": "prefix"}})
