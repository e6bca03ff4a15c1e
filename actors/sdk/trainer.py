"""The trainer hook: the controller hands it complete prompt groups in batches.

A trainer sees only groups whose every sibling settled; a sibling that failed for good is reported as
a typed failure (``failed`` lists it), never as a fake zero-reward sample.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from parkway.protocol.messages import CanonicalRow


@dataclass(frozen=True)
class GroupResult:
    group_id: str
    task_index: int
    rows: tuple[CanonicalRow, ...]  # sealed siblings, in sibling order
    failed: tuple[str, ...]  # rollout ids given up on


@dataclass(frozen=True)
class TrainStep:
    step: int
    policy_version: int
    groups: int
    samples: int
    failed: int
    mean_reward: float
    tokens: int
    # Where the step saved the new policy's weights (a real trainer); the controller has the policy load
    # them before the next generation. None: nothing to load (the example trainer).
    weights_dir: str | None = None
    loss: float | None = None  # the step's training loss (a real trainer); None: no gradient step


class Trainer(ABC):
    @abstractmethod
    def train(self, batch: list[GroupResult]) -> TrainStep:
        """Consume one batch; return what the step did. The policy version it returns is the new one."""

    @abstractmethod
    def state(self) -> dict[str, object]:
        """What a trainer checkpoint keeps (a real trainer: a path to its weights and optimizer)."""

    @abstractmethod
    def load_state(self, state: dict[str, object]) -> None: ...
