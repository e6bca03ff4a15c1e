"""The learning example on real vLLM, as ``parkway run`` OS processes: one run uncrashed, one SIGKILLed
after some GRPO steps and run again, which restores and finishes. On-policy, the two reach the same
weights bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from parkway.actors.launch.processes import parkway_command

from tests.support.processes import actor_env

pytest.importorskip("vllm")
pytest.importorskip("torch")

from parkway.actors.builtin.grpo import STEP_DIR, weights_digest
from parkway.actors.engines.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow  # parkway run processes, each with vLLM's engine processes

STEPS = 4  # 8 tasks in batches of 2 groups
CRASH_AFTER_STEP = 2


def config(model: Path, work: Path) -> str:
    return json.dumps(
        {
            "run": "grpo-crash",
            "seed": 3,
            "agent": "submit",
            "environments": ["letters"],
            "rollout": {"group_size": 4, "max_turns": 1, "max_tokens": 16},
            "tasks": {"builtin": "letters", "limit": 2 * STEPS},
            "policy": {"engine": "vllm", "model": str(model), "host": "inline", "max_model_len": 512},
            "trainer": {
                "kind": "grpo",
                "batch_groups": 2,
                "on_policy": True,
                "checkpoint_every": 1,
                "options": {"model": str(model), "work_dir": str(work), "lr": 0.03, "seed": 1},
            },
            "snapshot_interval_s": 3600,  # the snapshots are the ones each trainer checkpoint takes
        }
    )


def start(tmp_path: Path, name: str, model: Path) -> subprocess.Popen[str]:
    """``parkway run`` of the configuration in its own session (a SIGKILL of its process group takes
    vLLM's engine processes with it), log lines on stderr."""
    config_path = tmp_path / f"{name}.yaml"  # JSON is YAML
    config_path.write_text(config(model, tmp_path / f"{name}-steps"))
    return subprocess.Popen(
        parkway_command("run", "--config", str(config_path), "--json", "--log-level", "info"),
        env=actor_env("grpo-crash", tmp_path / f"{name}-state"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def events(lines: list[str]) -> list[dict[str, Any]]:
    parsed = []
    for line in lines:
        if line.startswith("{"):
            try:
                parsed.append(json.loads(line))
            except ValueError:
                continue  # a line vLLM's processes wrote into the middle of one
    return parsed


def finish(process: subprocess.Popen[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-4000:]
    # vLLM's processes print on stdout too: the summary is the last line that is a JSON object.
    summary = [line for line in out.splitlines() if line.startswith("{")][-1]
    return json.loads(summary), events(err.splitlines())


def test_a_run_killed_mid_training_restores_to_the_same_weights(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    reference, reference_events = finish(start(tmp_path, "straight", model))
    assert reference["train_steps"] == STEPS and reference["policy_version"] == STEPS
    straight = weights_digest(tmp_path / "straight-steps" / STEP_DIR.format(STEPS))
    gaps = [e["sampler_gap"] for e in reference_events if e.get("event") == "grpo_step"]
    assert gaps == [0.0] * STEPS  # vLLM sampled on exactly the weights the trainer had

    crashy = start(tmp_path, "crashy", model)
    assert crashy.stderr is not None
    seen: list[str] = []
    for line in crashy.stderr:  # watch its progress: killed once a step past the first is trained
        seen.append(line)
        if '"event":"trained"' in line and json.loads(line)["step"] == CRASH_AFTER_STEP:
            os.killpg(crashy.pid, signal.SIGKILL)
            break
    crashy.wait(timeout=60)
    assert crashy.returncode == -signal.SIGKILL, "".join(seen)[-4000:]
    trained_before = [e["step"] for e in events(seen) if e.get("event") == "trained"]
    assert trained_before == list(range(1, CRASH_AFTER_STEP + 1))  # the crash came after training began

    resumed, resumed_events = finish(start_again(tmp_path, model))
    started = next(e for e in resumed_events if e.get("event") == "run_started")
    assert started["restored"] is True  # from its snapshot (or a trainer checkpoint's marker)
    restored_by = {e["event"] for e in resumed_events} & {"restore_done", "restore_from_fallback_marker"}
    assert restored_by, "the run started again without restoring"
    trained_after = [e["step"] for e in resumed_events if e.get("event") == "trained"]
    assert trained_after and trained_after[0] > 1 and trained_after[-1] == STEPS
    assert resumed["policy_version"] == STEPS and resumed["restores"] == 1
    crashed = weights_digest(tmp_path / "crashy-steps" / STEP_DIR.format(STEPS))
    assert crashed == straight
    assert crashed != weights_digest(model)


def start_again(tmp_path: Path, model: Path) -> subprocess.Popen[str]:
    """The killed run started again in the same state directory (and the same trainer work dir)."""
    return start(tmp_path, "crashy", model)
