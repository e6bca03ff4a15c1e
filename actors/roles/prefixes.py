"""Prefix recovery at the policy (``recovery.target_level: prefix``, docs/recovery.md#prefix).

``Prefixes`` keeps, for the policy, what a snapshot needs of the model calls in flight and what a
restore hands back: ``started``/``finished`` follow each call, ``cut`` copies the tokens each call has
brought out so far (read from an engine in this process, or as the last poll of the Ray replicas
learned them), ``install`` takes a restored snapshot's prefixes for the rollouts the restore continues,
``take`` gives a re-sent call its prefix when it is the same call (prompt, seed, budget) and the engine
continues, and ``segments`` counts what a continued call kept and says, for its staging row, which
tokens came from which attempt. Every count is the policy's (``Status``): ``calls_continued``,
``prefix_tokens_kept``, ``prefix_tokens_regenerated``, ``prefix_fallbacks``, ``prefixes_cut``,
``prefix_tokens_cut``, ``progress_polls``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Any

import msgspec
import structlog
from parkway.actors.engines.ray_host import EnginePool
from parkway.protocol import ranges
from parkway.protocol.messages import Generate, Restore, TokenSegment
from parkway.protocol.transcript import prompt_digest

log = structlog.get_logger("parkway.policy")

DEFAULT_PROGRESS_INTERVAL_S = 0.5


class KeptPrefix(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The tokens a snapshot kept of a model call in flight, where each run of them came from, and what
    the call must be to continue it. The policy's cut file holds it as a record (validated when read
    back: ``from_record``)."""

    rollout_id: str
    call_index: ranges.Count
    prompt_sha256: str
    seed: ranges.Int64
    max_tokens: ranges.TokenBudget
    token_ids: tuple[ranges.TokenId, ...]
    logprobs: tuple[ranges.LogProb, ...]
    segments: tuple[TokenSegment, ...]  # cover token_ids, in order

    @property
    def attempt(self) -> int:
        """The newest attempt that sampled some of these tokens."""
        return max(s.attempt for s in self.segments)

    def fits(self, call: Generate) -> bool:
        """The same call: same prompt, seed and budget (a transcript that diverged is not continued)."""
        return (
            (self.seed, self.max_tokens) == (call.seed, call.max_tokens)
            and self.prompt_sha256 == prompt_digest(call.token_ids)
            and len(self.logprobs) == len(self.token_ids)
            and sum(s.tokens for s in self.segments) == len(self.token_ids)
        )

    def first(self, count: int) -> tuple[TokenSegment, ...]:
        """The segments of the first ``count`` tokens."""
        out, left = [], count
        for segment in self.segments:
            if left <= 0:
                break
            out.append(msgspec.structs.replace(segment, tokens=min(left, segment.tokens)))
            left -= segment.tokens
        return tuple(out)

    def record(self) -> dict[str, Any]:
        record: dict[str, Any] = msgspec.to_builtins(self)
        return record

    @classmethod
    def from_record(cls, item: Any) -> KeptPrefix:
        return msgspec.convert(item, cls)


class Prefixes:
    """The policy's prefix recovery: off (``enabled`` false) it keeps nothing and cuts nothing."""

    def __init__(
        self,
        pool: EnginePool,
        counts: collections.Counter[str],
        *,
        enabled: bool = False,
        progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
    ) -> None:
        if progress_interval_s <= 0:
            raise ValueError(f"progress_interval_s must be > 0, got {progress_interval_s}")
        self.pool = pool
        self.counts = counts
        self.enabled = enabled
        self.progress_interval_s = progress_interval_s
        # request id -> (the call, the version it runs under, the prefix it continues): the calls
        # generating, what a cut keeps of them
        self._calls: dict[str, tuple[Generate, int, KeptPrefix | None]] = {}
        # (rollout id, call index) -> the prefix a restore kept, until that call comes
        self.kept: dict[tuple[str, int], KeptPrefix] = {}
        self._poller: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Poll the Ray replicas while calls run (an inline engine is read at the cut itself)."""
        if self.enabled and self.pool.polls and self.pool.continues:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None

    # -- calls ---------------------------------------------------------------------------------
    def started(self, request_id: str, call: Generate, version: int, prefix: KeptPrefix | None) -> None:
        if self.enabled or prefix is not None:
            self._calls[request_id] = (call, version, prefix)

    def finished(self, request_id: str) -> None:
        self._calls.pop(request_id, None)

    def take(self, call: Generate) -> KeptPrefix | None:
        """The prefix a restore kept of this call, if the engine can continue it; a prefix that cannot
        be used is a fallback: the call is generated from its first token, as at ``turn``."""
        kept = self.kept.pop((call.rollout_id, call.call_index), None)
        if kept is None:
            return None
        if kept.attempt >= call.attempt or not kept.fits(call) or not self.pool.continues:
            self.counts["prefix_fallbacks"] += 1
            self.counts["prefix_tokens_regenerated"] += len(kept.token_ids)
            log.info(
                "prefix_not_continued",
                rollout_id=call.rollout_id,
                call_index=call.call_index,
                tokens=len(kept.token_ids),
                reason="engine" if not self.pool.continues else "call differs",
            )
            return None
        return kept

    def segments(
        self, prefix: KeptPrefix | None, used: int, call: Generate, version: int, total: int
    ) -> tuple[TokenSegment, ...]:
        """Count what a continued call kept, and the segments of its staging row."""
        if prefix is None:
            return ()
        self.counts["prefix_tokens_kept"] += used
        if used < len(prefix.token_ids):  # the engine took less of it (not its own tokens)
            self.counts["prefix_fallbacks"] += 1
            self.counts["prefix_tokens_regenerated"] += len(prefix.token_ids) - used
        if used == 0:
            return ()
        self.counts["calls_continued"] += 1
        tail = (TokenSegment(tokens=total - used, attempt=call.attempt, policy_version=version),)
        return prefix.first(used) + (tail if total > used else ())

    def cut(self, checkpoint_id: str) -> list[KeptPrefix]:
        """What the cut keeps of each call generating: its tokens known now (or the prefix it
        continues, when the engine has reported less than that so far). Nothing when not enabled."""
        if not self.enabled:
            return []
        known = self.pool.known_progress()
        found = []
        for request_id, (call, version, prefix) in self._calls.items():
            tokens, logprobs = known.get(request_id, ((), ()))
            if len(logprobs) != len(tokens):
                continue
            before = prefix.segments if prefix is not None else ()
            had = len(prefix.token_ids) if prefix is not None else 0
            if prefix is not None and had >= len(tokens):
                tokens, logprobs, segments = prefix.token_ids, prefix.logprobs, before
            else:
                new = TokenSegment(
                    tokens=len(tokens) - had,
                    attempt=call.attempt,
                    policy_version=version,
                    checkpoint_id=checkpoint_id,
                )
                segments = (*before, new)
            if not tokens:
                continue
            found.append(
                KeptPrefix(
                    rollout_id=call.rollout_id,
                    call_index=call.call_index,
                    prompt_sha256=prompt_digest(call.token_ids),
                    seed=call.seed,
                    max_tokens=call.max_tokens,
                    token_ids=tuple(tokens),
                    logprobs=tuple(logprobs),
                    segments=segments,
                )
            )
        return found

    async def _poll(self) -> None:
        """Learn the Ray replicas' tokens so far, every ``progress_interval_s`` while calls run: what a
        cut keeps is at most this old."""
        while True:
            await asyncio.sleep(self.progress_interval_s)
            if not self._calls:
                continue
            try:
                self.counts["progress_tokens_polled"] += await self.pool.poll_progress()
                self.counts["progress_polls"] += 1
            except Exception as exc:  # a replica restarting: the cut keeps what was known before
                log.warning("progress_poll_failed", error=str(exc))

    def install(self, prefixes: list[KeptPrefix], command: Restore) -> None:
        """The prefixes the restored rollouts' calls continue from (a restore that keeps them); the
        tokens of every other one are generated again, and counted so."""
        self.kept = {}
        if not prefixes:
            return
        continuing = {e.rollout_id for e in command.episodes}
        for prefix in prefixes:
            if command.keep_prefixes and prefix.rollout_id in continuing:
                self.kept[(prefix.rollout_id, prefix.call_index)] = prefix
            else:
                self.counts["prefix_tokens_regenerated"] += len(prefix.token_ids)
        log.info(
            "prefixes_restored",
            kept=len(self.kept),
            of=len(prefixes),
            tokens=sum(len(p.token_ids) for p in self.kept.values()),
        )

    def forget(self, rollout_ids: set[str]) -> None:
        """Sealed rollouts: a prefix whose call never came goes (nothing to count: nothing was redone)."""
        for key in [k for k in self.kept if k[0] in rollout_ids]:
            del self.kept[key]
