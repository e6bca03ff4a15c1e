"""Hosting engines: N replicas in Ray actors (host "ray"), or one in this process (host "inline").

``EngineActor`` is a plain class here; it becomes a Ray actor class (``ray.remote``) only when a pool
starts, so importing this module needs neither a running Ray nor, for host "inline", Ray at all.
Ray ObjectRefs are awaited directly from asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from parkway.actors.engines.base import Engine, GenerationRequest, GenerationResult, Progress
from parkway.actors.engines.ray_placement import RayPlacement
from parkway.actors.engines.ray_placement import remove as remove_placement_group

log = structlog.get_logger("parkway.engines")

HOSTS = ("ray", "inline")

# Ray pools running in this process, and whether one of them started Ray (then the last to stop shuts
# it down; a Ray that someone else started is left alone).
_ray_users = 0
_ray_started_here = False


@dataclass(frozen=True)
class EngineSpec:
    """Which engine to build and with what arguments: ``kind`` "deterministic" (later "vllm")."""

    kind: str = "deterministic"
    kwargs: dict[str, Any] = field(default_factory=dict)


def engine_class(kind: str) -> type[Engine]:
    if kind == "deterministic":
        from parkway.actors.engines.deterministic import DeterministicEngine

        return DeterministicEngine
    if kind == "vllm":
        from parkway.actors.engines.vllm_engine import VllmEngine

        return VllmEngine
    raise ValueError(f"unknown engine kind {kind!r} (known: 'deterministic', 'vllm')")


def build_engine(spec: EngineSpec) -> Engine:
    return engine_class(spec.kind)(**spec.kwargs)


class EngineActor:
    """One engine replica; hosted as an async Ray actor via ``ray.remote(EngineActor)``."""

    def __init__(self, spec: EngineSpec) -> None:
        self.engine = build_engine(spec)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.engine.generate(request)

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def in_flight(self) -> int:
        return self.engine.in_flight()

    async def progress(self, known: dict[str, int]) -> dict[str, Progress]:
        return self.engine.progress(known)

    async def load_weights(self, directory: str) -> None:
        await self.engine.load_weights(directory)

    async def ready(self) -> bool:
        await self.engine.start()
        return True

    async def shutdown(self) -> None:
        await self.engine.stop()

    async def node(self) -> str:
        """The id of the Ray node this replica runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())


_remote_class: Any = None


def remote_engine_actor() -> Any:
    """The Ray actor class of ``EngineActor``, made on first use."""
    global _remote_class
    if _remote_class is None:
        import ray

        _remote_class = ray.remote(EngineActor)
    return _remote_class


class EnginePool:
    """N engine replicas behind one ``generate``: round-robin dispatch, abort by request id."""

    def __init__(
        self,
        spec: EngineSpec | None = None,
        *,
        host: str = "ray",
        replicas: int = 1,
        ray_num_cpus: int | None = None,
        actor_options: dict[str, Any] | None = None,
        placement: RayPlacement | None = None,
    ) -> None:
        if host not in HOSTS:
            raise ValueError(f"engine host {host!r} is not one of {HOSTS}")
        if replicas < 1:
            raise ValueError(f"replicas {replicas} < 1")
        self.spec = spec or EngineSpec()
        self.host = host
        self.replicas = replicas
        self.ray_num_cpus = ray_num_cpus
        self.placement = placement or RayPlacement()
        self.actor_options = dict(actor_options or {})  # over what the placement asks for
        self._groups: list[Any] = []  # host "ray": each replica's placement group, if it needs one
        self._engine: Engine | None = None  # host "inline"
        self._actors: list[Any] = []  # host "ray"
        self._next = itertools.count()
        self._where: dict[str, int] = {}  # request id -> replica running it
        self._dispatched = 0  # host "ray": requests sent and not yet returned
        # host "ray": the tokens polled so far of each running request (``poll_progress``)
        self._polled: dict[str, tuple[list[int], list[float]]] = {}
        self._uses_ray = False
        self.started = False

    async def start(self) -> None:
        if self.started:
            return
        if self.host == "inline":
            self._engine = build_engine(self.spec)
            await self._engine.start()
        else:
            import ray

            global _ray_users, _ray_started_here
            if not ray.is_initialized():
                if self.placement.address:  # join that cluster; stopping only disconnects from it
                    ray.init(address=self.placement.address, log_to_driver=False, ignore_reinit_error=True)
                else:
                    ray.init(
                        num_cpus=self.ray_num_cpus,
                        include_dashboard=False,
                        log_to_driver=False,
                        ignore_reinit_error=True,
                    )
                _ray_started_here = True
            _ray_users += 1
            self._uses_ray = True
            tensor_parallel = int(self.spec.kwargs.get("tensor_parallel_size", 1))
            for _ in range(self.replicas):
                options, group = self.placement.place(tensor_parallel)
                self._groups.append(group)
                cls = remote_engine_actor().options(**{**options, **self.actor_options})
                self._actors.append(cls.remote(self.spec))
            try:
                for actor in self._actors:  # fail here, not on the first request, if a replica cannot start
                    await actor.ready.remote()
            except BaseException:
                await self.stop()
                raise
        self.started = True
        nodes = await self.nodes() if self._actors else []
        log.info("engines_started", host=self.host, replicas=self.replicas, kind=self.spec.kind, nodes=nodes)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if not self.started:
            raise RuntimeError("engine pool is not started")
        if self._engine is not None:
            return await self._engine.generate(request)
        index = next(self._next) % len(self._actors)
        self._where[request.request_id] = index
        self._dispatched += 1
        try:
            return await self._actors[index].generate.remote(request)
        finally:
            self._dispatched -= 1
            if self._where.get(request.request_id) == index:
                del self._where[request.request_id]
                self._polled.pop(request.request_id, None)

    async def abort(self, request_id: str) -> bool:
        if self._engine is not None:
            return await self._engine.abort(request_id)
        index = self._where.get(request_id)
        if index is None:
            return False
        return await self._actors[index].abort.remote(request_id)

    async def nodes(self) -> list[str]:
        """The Ray node of each replica (host "ray"); empty for an engine in this process."""
        return [str(node) for node in await asyncio.gather(*(a.node.remote() for a in self._actors))]

    def in_flight(self) -> int:
        if self._engine is not None:
            return self._engine.in_flight()
        return self._dispatched

    @property
    def continues(self) -> bool:
        """Whether this pool's engine continues a request from its ``prefix``."""
        return self._engine.continues if self._engine is not None else engine_class(self.spec.kind).continues

    @property
    def polls(self) -> bool:
        """Whether ``known_progress`` needs ``poll_progress`` to be called (remote replicas)."""
        return self._engine is None

    async def poll_progress(self) -> int:
        """Ask every replica for the tokens its running requests brought out since the last poll;
        returns how many new tokens were learned. Host "inline" needs no poll (``known_progress``
        reads the engine itself)."""
        if self._engine is not None or not self._actors:
            return 0
        known = {rid: len(tokens) for rid, (tokens, _) in self._polled.items()}
        replies = await asyncio.gather(
            *(actor.progress.remote(known) for actor in self._actors), return_exceptions=True
        )
        learned = 0
        for reply in replies:
            if isinstance(reply, BaseException):
                continue  # a replica that did not answer this time: polled again next time
            for request_id, found in reply.items():
                if request_id not in self._where:
                    continue  # returned meanwhile: its reply has every token
                tokens, logprobs = self._polled.setdefault(request_id, ([], []))
                if found.start != len(tokens):
                    continue  # a reply to an older poll
                tokens.extend(found.token_ids)
                logprobs.extend(found.logprobs)
                learned += len(found.token_ids)
        return learned

    def known_progress(self) -> dict[str, tuple[tuple[int, ...], tuple[float, ...]]]:
        """Every running request's tokens known now (all of them, host "inline"; as of the last poll,
        host "ray"): copies, safe to keep."""
        if self._engine is not None:
            return {rid: (p.token_ids, p.logprobs) for rid, p in self._engine.progress({}).items()}
        return {rid: (tuple(t), tuple(lp)) for rid, (t, lp) in self._polled.items() if t}

    def tokens_accrued(self) -> int | None:
        """The inline engine's ``tokens_accrued``; None for Ray replicas (a count would be a remote call)."""
        return self._engine.tokens_accrued() if self._engine is not None else None

    async def load_weights(self, directory: str) -> int:
        """Load ``directory`` into every replica (all of them, or the call fails); returns how many."""
        if not self.started:
            raise RuntimeError("engine pool is not started")
        if self._engine is not None:
            await self._engine.load_weights(directory)
            return 1
        async with anyio.create_task_group() as loading:  # the first failure cancels the rest
            for actor in self._actors:
                loading.start_soon(_await_ref, actor.load_weights.remote(directory))
        return len(self._actors)

    async def replica_in_flight(self) -> list[int]:
        """What each replica itself counts as running (host "ray"), or the inline engine's count."""
        if self._engine is not None:
            return [self._engine.in_flight()]
        return [await actor.in_flight.remote() for actor in self._actors]

    async def stop(self) -> None:
        global _ray_users, _ray_started_here
        if self._engine is not None:
            await self._engine.stop()
        self._engine = None
        if self._actors:
            import ray

            for actor in self._actors:
                with contextlib.suppress(Exception):  # let the engine release its workers first
                    await actor.shutdown.remote()
                ray.kill(actor)
            self._actors = []
        for group in self._groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        self._groups = []
        self._where.clear()
        self._polled.clear()
        if self._uses_ray:
            self._uses_ray = False
            _ray_users -= 1
            if _ray_users == 0 and _ray_started_here:
                import ray

                _ray_started_here = False
                ray.shutdown()
        self.started = False


async def _await_ref(ref: Any) -> None:
    """Await a Ray object reference (a task group starts coroutine functions, not awaitables)."""
    await ref
