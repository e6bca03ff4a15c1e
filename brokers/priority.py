"""Control work ahead of data work in one event loop.

An asyncio loop runs what is ready in the order it became ready. In a busy actor (an agent with
hundreds of rollouts, the controller while receipts pour in) a control command that arrives behind a
burst of model replies waits for every one of them: the reply wakes its rollout, which builds and
signs its next call, and each hop of the command's own path (the connection's reader, the channel's
reader, the consumer, the handler, the reply's publish) queues behind the whole batch again. Measured
at 1024 rollouts in flight, an agent's ``Prepare`` waited up to 184 ms that way while its handler
took 2 ms.

``PriorityEventLoop`` runs the callbacks of urgent work first: those whose context has ``URGENT``
set. What sets it:

- the broker's connection's reader and writer (every message passes them, and a frame costs little)
  and each consumer's channel, all of whose calls run urgent too (``RabbitBroker.consume``): made
  in an urgent context, their tasks inherit it. The channels that publish with confirms (requests,
  replies) stay in plain order: no window waits for their confirms, and an AMQP channel's close
  must keep the order of that channel's reader (one whose reader ran ahead of the task closing it
  waited out a 60 s heartbeat timeout);
- a control-lane delivery's handler (``Consumer`` starts it in ``context(True)``); a data-lane
  delivery's in ``context(False)``, whatever the reader that received it was;
- the controller's admission-closed window (``Urgency``): its round trips to the participants.

Everything a task does inherits its context, so a control command's whole path is urgent and a
rollout's is not. Urgent callbacks keep their order among themselves, and those an urgent callback
makes run ahead of the ordinary work too, up to ``PASSES_PER_TURN`` times in one turn of the loop:
an urgent task that yields in a loop cannot starve the rest. Timers stay in order of expiry. Code on
another loop (a user's own, uvloop) runs the same in plain arrival order: the mark is only a hint.
What it cannot help: a process that waits for a core runs no callback at all.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# Urgent work made by urgent work (each hop of a command's path) runs on ahead of the ordinary work
# already ready, this many times in one turn of the loop; then the ordinary work's turn comes, so an
# urgent task that yields in a loop cannot starve the rest.
PASSES_PER_TURN = 64

URGENT: contextvars.ContextVar[bool] = contextvars.ContextVar("parkway_urgent", default=False)


def context(urgent: bool) -> contextvars.Context:
    """A copy of the current context, urgent or not."""
    copy = contextvars.copy_context()
    copy.run(URGENT.set, urgent)
    return copy


async def urgently(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` as a task of its own in an urgent context (what it starts inherits it)."""
    return await asyncio.get_running_loop().create_task(coro, context=context(True))


class Urgency:
    """Urgent from ``with`` until ``end()`` or the block's end, in the running task's context."""

    def __init__(self) -> None:
        self._token: contextvars.Token[bool] | None = None

    def __enter__(self) -> Urgency:
        self._token = URGENT.set(True)
        return self

    def end_if(self, condition: bool) -> None:
        if condition:
            self.end()

    def end(self) -> None:
        if self._token is not None:
            URGENT.reset(self._token)
            self._token = None

    def __exit__(self, *_: object) -> None:
        self.end()


class PriorityEventLoop(asyncio.SelectorEventLoop):
    """A selector loop that runs urgent callbacks (``URGENT`` in their context) before the rest."""

    def __init__(self) -> None:
        super().__init__()
        self._urgent: collections.deque[asyncio.Handle] = collections.deque()
        # asyncio's own ready queue (the same deque for the loop's life), which its stubs do not name
        self._queue: collections.deque[asyncio.Handle] = self._ready  # type: ignore[attr-defined]
        self._pump = asyncio.Handle(self._run_urgent, (), self, contextvars.Context())
        self._nudge = asyncio.Handle(_nothing, (), self, contextvars.Context())
        self._armed = False  # the pump is in the ready queue
        self._pumping = False

    # The loop's two ways into its ready queue: call_soon (and what uses it: task steps, future
    # callbacks) and the I/O callbacks of the selector. Timers are left in order of expiry.
    def _call_soon(
        self, callback: Callable[..., object], args: tuple[Any, ...], context: contextvars.Context | None
    ) -> asyncio.Handle:
        handle = asyncio.Handle(callback, args, self, context)
        self._enqueue(handle)
        return handle

    def _add_callback(self, handle: asyncio.Handle) -> None:
        if not handle._cancelled:
            self._enqueue(handle)

    def _enqueue(self, handle: asyncio.Handle) -> None:
        # (asyncio's loop thread and a handle's context: private attributes its stubs do not name)
        on_loop = self._thread_id == threading.get_ident()  # type: ignore[attr-defined]
        if on_loop and handle._context.get(URGENT, False):  # type: ignore[attr-defined]  # (the same)
            self._urgent.append(handle)
            if not self._armed and not self._pumping:
                self._arm()
        else:
            self._queue.append(handle)

    def _process_events(self, event_list: list[Any]) -> None:
        # Once per turn of the loop, after its I/O poll: what the last pump left runs first.
        super()._process_events(event_list)  # type: ignore[misc]  # a private hook the stubs leave out
        if self._urgent and not self._armed:
            self._arm()

    def _arm(self) -> None:
        self._armed = True
        self._queue.appendleft(self._pump)

    def _run_urgent(self) -> None:
        self._armed, self._pumping = False, True
        try:
            # What urgent handles make (a command's next hop) runs on, still ahead of the ready work.
            for _ in range(PASSES_PER_TURN):
                if not self._urgent:
                    return
                for _ in range(len(self._urgent)):
                    handle = self._urgent.popleft()
                    if not handle._cancelled:
                        handle._run()
            if self._urgent:  # the ready work's turn; the next poll must not block meanwhile
                self._queue.append(self._nudge)
        finally:
            self._pumping = False

    def close(self) -> None:
        self._urgent.clear()
        super().close()


def _nothing() -> None:
    pass


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a ``PriorityEventLoop``: how an actor process runs."""
    with asyncio.Runner(loop_factory=PriorityEventLoop) as runner:
        return runner.run(main)
