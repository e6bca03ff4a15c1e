"""Sizes of the structures a process holds per rollout or per snapshot, seen from outside.

``Actor.structure_sizes()`` names each structure and says how many entries it holds now ("name" ->
entries; names are lower_snake). The base reports the runtime's own (this module's
``runtime_structure_sizes``); a role adds its own::

    def structure_sizes(self) -> dict[str, int]:
        return {**super().structure_sizes(), "sessions": len(self.sessions)}

They are read in two places: ``Status`` (``StatusReport.structures``, so ``parkway status`` and the
heartbeat carry them) and the Prometheus gauge ``parkway_structure_entries{structure}``, computed when
scraped. A structure that keeps growing with the rollouts served, not with those in flight, is a leak.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import structlog
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from parkway.actors.runtime.actor import Actor

log = structlog.get_logger("parkway.structures")

GAUGE = "parkway_structure_entries"
# A scrape runs in the metrics server's thread while the event loop mutates the structures: a role's
# override that iterates a dict can meet "changed size during iteration". Tried again a few times.
_READ_TRIES = 3


class Sized(Protocol):
    @property
    def role(self) -> str: ...

    @property
    def replica(self) -> int: ...

    def structure_sizes(self) -> dict[str, int]: ...


def runtime_structure_sizes(actor: Actor) -> dict[str, int]:
    """The runtime's own structures of ``actor``: cached replies, their journal, requests in hand."""
    return {
        **actor.replies.sizes(),
        "answered_requests": len(actor._answered_requests),
        "requests_in_hand": len(actor._replying),
    }


def read_sizes(actor: Sized) -> dict[str, int]:
    """``actor.structure_sizes()``, safe to call from another thread; {} when it cannot be read."""
    for _ in range(_READ_TRIES):
        try:
            return {str(name): max(0, int(size)) for name, size in actor.structure_sizes().items()}
        except RuntimeError:  # a dict resized under an iteration: read again
            continue
        except Exception:  # a role's override failing must not fail the scrape or the Status reply
            log.exception("structure_sizes_failed")
            return {}
    return {}


class StructureCollector(Collector):
    """``parkway_structure_entries{role,replica,structure}`` of one actor, read when scraped."""

    def __init__(self, actor: Sized) -> None:
        self.actor = actor

    def describe(self) -> list[Metric]:
        return []  # nothing to describe ahead: the structures are known only when read

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            GAUGE,
            "Entries held now in each named per-rollout / per-snapshot structure of the actor",
            labels=("role", "replica", "structure"),
        )
        for name, size in sorted(read_sizes(self.actor).items()):
            family.add_metric((self.actor.role, str(self.actor.replica), name), size)
        yield family
