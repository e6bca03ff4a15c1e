"""The engine interface every generation backend implements (deterministic, vLLM)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str  # unique per model call: "<capture key>:<call index>"
    token_ids: tuple[int, ...]
    seed: int
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" (a stop token), "length" (max_tokens), "abort"


def require_directory(directory: str) -> None:
    """A weights directory must exist: a wrong path fails the update, it never half-applies."""
    try:
        found = Path(directory).is_dir()
    except OSError as exc:  # a name the file system refuses (ENAMETOOLONG, EACCES): not a directory
        raise FileNotFoundError(f"weights directory {directory!r} cannot be read: {exc.strerror}") from None
    if not found:
        raise FileNotFoundError(f"weights directory {directory} does not exist")


class Engine(ABC):
    """Generate from token ids. Same request and seed, same tokens."""

    async def start(self) -> None:  # noqa: B027 - most engines need no start-up
        """Load weights, start workers (vLLM); called once in the process that hosts the engine."""

    async def stop(self) -> None:  # noqa: B027
        """Release what ``start`` took."""

    @abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    @abstractmethod
    async def abort(self, request_id: str) -> bool:
        """Stop a request in flight; its ``generate`` returns with ``finish_reason == "abort"``."""

    @abstractmethod
    def in_flight(self) -> int: ...

    def tokens_accrued(self) -> int | None:
        """Tokens generated so far, those of generations still running included, as they come out;
        None where the engine cannot say (the policy's ``tokens_generated`` counts a generation's tokens
        when it returns)."""
        return None

    async def load_weights(self, directory: str) -> None:
        """Replace the weights with those in ``directory`` (a checkpoint in the model's own format).

        Called with nothing in flight. Engines without weights accept any existing directory.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot load weights")
