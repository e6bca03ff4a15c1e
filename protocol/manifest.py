"""A snapshot's manifest: what it holds, who wrote each file, and the digests that prove it is whole.

Written by the controller's publish step as JSON (``manifest.json``, indented, keys sorted: the same
text the dict-based writer produced, so snapshots written before this type read the same) and read
through the same types by everything that reads it: the restore, the inventory and the CLI.
"""

from __future__ import annotations

import json
from typing import Annotated

import msgspec

SCHEMA = 1

Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
Count = Annotated[int, msgspec.Meta(ge=0)]
Episode = tuple[str, Count]  # (rollout id, attempt)


class ManifestFile(msgspec.Struct, frozen=True, omit_defaults=True):
    """One file of the snapshot, relative to its directory, and the checkpoint it was written under."""

    path: str
    sha256: Sha256
    size: Count
    records: Count
    checkpoint_id: str
    # A pack of records hard-linked from the snapshot before (the same file: not written again).
    linked: bool = False


class TrainerMark(msgspec.Struct, frozen=True):
    """The trainer step and policy version the snapshot is anchored at."""

    step: Count
    policy_version: Count


class ManifestHead(msgspec.Struct, frozen=True, kw_only=True):
    """Everything in a manifest but its file list (the inventory reads the list entry by entry, to
    name each broken entry on its own)."""

    schema: int
    checkpoint_id: str
    seq: Annotated[int, msgspec.Meta(ge=1)]
    run: str
    created_at: float
    trainer: TrainerMark
    config_fingerprint: Sha256
    topology_fingerprint: Sha256
    episodes: list[Episode]  # the attempts the agents saved, sorted
    # The attempts a restore starts from their prompts, sorted: those restart-only participants could
    # not save, and those dispatched after the snapshot's instant that no agent's cut holds.
    restarts: list[Episode]
    # The snapshot's trace id (derived from its checkpoint id: protocol/tracecontext.py); older
    # manifests have none.
    trace_id: Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{32})?$")] = ""
    # Replicas per participant role when it was taken ({"agent": 2, "resources": 2, ...}): a restore
    # onto other numbers of agents and tool servers places their rollouts from it. Older manifests
    # have none and restore only onto their own topology (``topology_fingerprint``).
    replicas: dict[str, Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]] = {}

    def saved_episodes(self) -> set[tuple[str, int]]:
        return {(r, a) for r, a in self.episodes}

    def restart_episodes(self) -> set[tuple[str, int]]:
        return {(r, a) for r, a in self.restarts}


class Manifest(ManifestHead, frozen=True, kw_only=True):
    files: list[ManifestFile]


def encode_manifest(manifest: Manifest) -> str:
    """The manifest as its file's text."""
    return msgspec.json.format(msgspec.json.encode(manifest, order="sorted"), indent=1).decode()


def parse_manifest(obj: object) -> Manifest:
    """A manifest from its JSON value (as ``json.loads`` reads it). Raises ``msgspec.ValidationError``."""
    return msgspec.convert(obj, Manifest)


def decode_manifest(text: str | bytes) -> Manifest:
    """A manifest from its file's text. Raises ``ValueError`` (``json.JSONDecodeError`` and
    ``msgspec.ValidationError`` are both)."""
    return parse_manifest(json.loads(text))
