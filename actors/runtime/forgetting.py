"""What a participant keeps of the attempts it was told to forget: a bounded fence, nothing else.

Once a rollout is sealed and its receipt acknowledged, the controller sends ``Forget`` naming every
attempt it dispatched for it (docs/memory.md). A participant drops all it holds for them and keeps
only their ids, the most recent ``PARKWAY_FORGET_FENCE`` of them (4096 by default), so that a very late
duplicate (a redelivered ``Run``, ``ToolCall`` or ``Generate``) is refused with ``stale_attempt``
instead of starting the attempt again. Older ids fall off the fence: memory stays bounded whatever
the number of rollouts served.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping

from parkway.actors.runtime.settings import SettingsError

FORGET_FENCE_ENV = "PARKWAY_FORGET_FENCE"
DEFAULT_FORGET_FENCE = 4096

AttemptKey = tuple[str, int]


def forget_fence_size(environ: Mapping[str, str] | None = None) -> int:
    """``PARKWAY_FORGET_FENCE``: how many forgotten attempts a participant still refuses by id."""
    text = (os.environ if environ is None else environ).get(FORGET_FENCE_ENV, "").strip()
    if not text:
        return DEFAULT_FORGET_FENCE
    try:
        size = int(text)
    except ValueError:
        size = -1
    if size < 1:
        raise SettingsError(f"{FORGET_FENCE_ENV}={text!r}: give a whole number of attempts, at least 1")
    return size


class Fence:
    """An insertion-ordered set of attempt keys holding at most ``capacity``: the oldest goes first."""

    def __init__(self, capacity: int = DEFAULT_FORGET_FENCE) -> None:
        if capacity < 1:
            raise ValueError(f"a fence holds at least one attempt, not {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[AttemptKey, None] = OrderedDict()

    def add(self, key: AttemptKey) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def update(self, keys: Iterable[AttemptKey]) -> None:
        for key in keys:
            self.add(key)

    def discard(self, key: AttemptKey) -> None:
        self._keys.pop(key, None)

    def clear(self) -> None:
        self._keys.clear()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[AttemptKey]:
        return iter(self._keys)
