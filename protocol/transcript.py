"""What an agent saves of a rollout at a boundary, and replays to continue it as a new attempt.

A rollout's program is ordinary code, so it cannot be frozen mid-way. Instead the agent keeps its
transcript: every model reply and tool result so far. Continuing attempt N+1 runs the program again
from the start and answers its first calls from the transcript (no model or tool call is repeated:
same program, same inputs, same path), then carries on live. A program that asks for something else
than the transcript holds has diverged, which is a typed failure, not a silent restart.
"""

from __future__ import annotations

import hashlib

import msgspec
from parkway.protocol.messages import Run


class ModelStep(msgspec.Struct, frozen=True, kw_only=True):
    prompt_sha256: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    staging_key: str  # "<capture key>:<turn>" of the attempt that generated it


class ToolStep(msgspec.Struct, frozen=True, kw_only=True):
    tool: str
    arguments: dict[str, object]
    ok: bool
    output: dict[str, object]


class SavedRollout(msgspec.Struct, frozen=True, kw_only=True):
    """A rollout parked at a boundary: its Run and the transcript up to that boundary."""

    run: Run
    model: tuple[ModelStep, ...]
    tools: tuple[ToolStep, ...]
    boundaries: int


def prompt_digest(token_ids: tuple[int, ...]) -> str:
    return hashlib.sha256(bytes(str(token_ids), "ascii")).hexdigest()


class Diverged(Exception):
    """The program asked for a call that differs from the one saved at that position."""
