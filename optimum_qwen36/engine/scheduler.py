"""The scheduler: each step is a plan under a token budget. It plans; `Engine.step` executes.

- Every decoding request advances one token per step (with MTP speculative decoding, its drafts are
  verified in the same step: it is planned 1 + drafts positions); prefill chunks of prefilling requests,
  then of newly admitted ones (first come, first served), fill the rest of `max_num_batched_tokens`. A
  chunk is at most the compiled prefill chunk, so a long prompt delays running decodes by at most one
  chunk per step.
- A request is admitted when a GDN state slot is free (there are `max_num_seqs`, the compiled batch) and the
  KV blocks of its first chunk can be had. KV blocks come from the prefix cache's one pool: a finished
  request's blocks become reusable prefix blocks (with `prefix_caching` off the cache keeps none).
- When a decode step needs a block and none can be had, the most recently admitted request is preempted:
  its slot and blocks are released (its computed blocks stay in the prefix cache), and it goes back to the
  front of the queue; on resume it restores its longest prefix-cache checkpoint and recomputes the rest. A
  request that finishes or is aborted after decoding also leaves the prefix cache its tail (its partial last
  block and the slot's state); a preempted one does not (that block is what frees without evicting).
- A request that brings a computed sequence (`EngineRequest.computed`) is admitted with blocks for those
  tokens, into which the engine copies them; nothing is looked up for it.
- A request waiting for its chooser's pick (`EngineRequest.chooser`) is not planned, and not preempted: its
  chooser holds the logits of its next token.
- The engine stores the GDN state at the prefix cache's checkpoint positions. Where the backend snapshots
  states inside a packed prefill call (`prefill_snapshots` per step), a chunk runs past up to that many of
  them; otherwise a chunk ends at each. A chunk cut short by the budget ends on a multiple of the GDN
  kernel chunk (64 tokens), where chunked prefill resumes exactly, or waits for the next step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..prefix_caching import KERNEL_CHUNK, CachedSequence, KVBlocksExhausted, PrefixCache
from .request import FinishReason, Request, RequestState


@dataclass
class PrefillChunk:
    """Tokens [start, start + num_tokens) of a request's token_ids, computed in one prefill call."""

    request: Request
    start: int
    num_tokens: int
    # Prefix cache checkpoint positions strictly inside the chunk: the call snapshots the state there.
    snapshots: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def completes(self) -> bool:
        """Whether the request's last known token is in this chunk: then its logits give the next token."""
        return self.end == self.request.num_tokens


@dataclass
class StepPlan:
    decodes: list[Request] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # start this step: restore or zero their slots
    preempted: list[Request] = field(default_factory=list)
    # Speculative decoding: how many of its drafts each decoding request verifies (by request id).
    num_drafts: dict[str, int] = field(default_factory=dict)
    # Checkpoint positions inside the step's prefill chunks (their states are snapshotted by the call).
    num_snapshots: int = 0

    @property
    def num_tokens(self) -> int:
        drafts = sum(self.num_drafts.get(r.request_id, 0) for r in self.decodes)
        return len(self.decodes) + drafts + sum(c.num_tokens for c in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


@dataclass
class _Running:
    request: Request
    slot: int
    seq: CachedSequence


class Scheduler:
    def __init__(
        self,
        prefix_cache: PrefixCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk_size: int,
        max_model_len: int,
        num_speculative_tokens: int = 0,
        prefill_snapshots: int = 0,
        slot_state: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        if max_num_batched_tokens < max_num_seqs + 1:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must exceed max_num_seqs "
                f"({max_num_seqs}): every running request decodes one token per step and prefills need room."
            )
        self.prefix_cache = prefix_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_size = prefill_chunk_size
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.prefill_snapshots = prefill_snapshots
        # A slot's GDN state (conv, recurrent), kept by the prefix cache when a request ends after decoding.
        self.slot_state = slot_state
        self.waiting: deque[Request] = deque()
        self._running: dict[str, _Running] = {}  # in admission order
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.stats = {"preemptions": 0, "admitted": 0, "finished": 0, "aborted": 0}

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} prompt tokens; the model was "
                f"exported with sequence_length={self.max_model_len}, leaving no room for a new token."
            )
        max_tokens = request.params.max_tokens or self.max_model_len
        longest = min(request.num_tokens + max_tokens, self.max_model_len)
        block_size = self.prefix_cache.config.block_size
        usable = self.prefix_cache.pool.num_blocks - 1  # block 0 is the null block
        if -(-longest // block_size) > usable:
            raise ValueError(
                f"request {request.request_id!r} can reach {longest} tokens ({request.num_tokens} prompt + "
                f"max_tokens), {-(-longest // block_size)} KV blocks of {block_size}, but the engine's pool "
                f"has {usable}: lower max_tokens, or create the engine with more num_kv_blocks."
            )
        self.waiting.append(request)

    @property
    def running(self) -> list[Request]:
        return [r.request for r in self._running.values()]

    def slot_of(self, request: Request) -> int:
        return self._running[request.request_id].slot

    def sequence_of(self, request: Request) -> CachedSequence:
        return self._running[request.request_id].seq

    def block_table(self, request: Request) -> list[int]:
        return self._running[request.request_id].seq.block_ids

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self._running)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        for entry in list(self._running.values()):
            request = entry.request
            if request.request_id not in self._running or request.state is not RequestState.DECODING:
                continue
            if not request.has_new_token:
                continue  # its chooser has not picked its next token yet
            drafts = self._num_drafts(request)
            if self._reserve(entry, request.num_computed + 1 + drafts, plan, decode=True):
                plan.decodes.append(request)
                if drafts:
                    plan.num_drafts[request.request_id] = drafts
        for entry in list(self._running.values()):
            budget = self.max_num_batched_tokens - plan.num_tokens
            prefilling = entry.request.state is RequestState.PREFILLING
            if prefilling and entry.request.request_id in self._running and budget > 0:
                self._plan_prefill(entry, budget, plan)
        # No admission in a step that had to preempt: the blocks just freed are the preempted requests'.
        while self.waiting and self._free_slots and not plan.preempted:
            budget = self.max_num_batched_tokens - plan.num_tokens
            entry = self._admit(self.waiting[0], budget) if budget > 0 else None
            if entry is None:
                break  # no budget left, or its first chunk's blocks are not available: it waits (FCFS)
            self.waiting.popleft()
            plan.admitted.append(entry.request)
            self._plan_prefill(entry, budget, plan)
        return plan

    def _num_drafts(self, request: Request) -> int:
        """Drafts the request verifies this step: all that its MTP layer makes (it drafts only when it has a
        first draft), within the model length (the last draft's position must exist)."""
        if not request.draft_ids:
            return 0
        return max(0, min(self.num_speculative_tokens, self.max_model_len - request.num_tokens))

    def _plan_prefill(self, entry: _Running, budget: int, plan: StepPlan) -> None:
        request = entry.request
        start = request.num_computed
        stops = [p for p in entry.seq.snapshot_positions if p > start]
        # Chunks that need their prompt's log-probabilities run alone, where no state is snapshotted.
        crossable = 0 if request.needs_prompt_logprobs else self.prefill_snapshots - plan.num_snapshots
        end = min(request.num_tokens, start + self.prefill_chunk_size, *stops[crossable : crossable + 1])
        if start + budget < end:
            end = (start + budget) // KERNEL_CHUNK * KERNEL_CHUNK
            if end <= start:
                return  # too little budget left for an exact chunk: next step
        if self._reserve(entry, end, plan, decode=False):
            inside = [p for p in stops if p < end]
            plan.prefills.append(PrefillChunk(request, start, end - start, inside))
            plan.num_snapshots += len(inside)

    def _admit(self, request: Request, budget: int) -> _Running | None:
        """Admit the request if its first chunk's blocks can be had without preempting anyone."""
        block_size = self.prefix_cache.config.block_size
        brought = request.computed.num_computed if request.computed is not None else 0
        first = min(request.num_tokens - brought, budget, self.prefill_chunk_size)
        if self.prefix_cache.available_blocks() < -(-(brought + first) // block_size):
            return None  # cheap check before the lookup: a miss needs at least this much
        if request.computed is not None:
            seq = self.prefix_cache.begin_computed(request.cache_key_ids, brought)
        else:
            reuse = not request.needs_prompt_logprobs
            seq = self.prefix_cache.begin(request.cache_key_ids, reuse, request.reusable_prefix)
        first_end = min(request.num_tokens, seq.cached_tokens + first)
        needed = -(-first_end // block_size) - len(seq.block_ids)
        if self.prefix_cache.available_blocks() < needed:
            # The hit's blocks are now referenced: without them the pool is short. Nothing was evicted.
            self.prefix_cache.finish(seq, None)
            return None
        self.prefix_cache.ensure_blocks(seq, first_end)
        entry = _Running(request, self._free_slots.pop(), seq)
        self._running[request.request_id] = entry
        request.state = RequestState.PREFILLING
        request.num_computed = seq.cached_tokens
        if request.num_preemptions == 0:  # a resumed request also finds its own outputs cached
            request.cached_prompt_tokens = seq.cached_tokens
        self.stats["admitted"] += 1
        return entry

    def _reserve(self, entry: _Running, num_tokens: int, plan: StepPlan, decode: bool) -> bool:
        """Blocks for `num_tokens` positions of the entry's request, preempting the most recently admitted
        requests when the pool is out (first come, first served: the earliest request always progresses).
        A decode may preempt its own request (it is then requeued); a prefill chunk waits instead. False if
        the entry did not get the blocks."""
        while True:
            try:
                self.prefix_cache.ensure_blocks(entry.seq, num_tokens)
                return True
            except KVBlocksExhausted:
                pass
            order = list(self._running.values())
            # A request waiting for its chooser's pick is not preempted: its chooser holds its logits.
            later = [e for e in order[order.index(entry) + 1 :] if e.request.has_new_token]
            victim = later[-1] if later else entry if decode else None
            if victim is None and len(order) > 1:
                return False  # an earlier request holds the blocks: this chunk waits for it
            if victim is None or (victim is entry and len(order) == 1):
                raise RuntimeError(
                    f"The KV block pool ({self.prefix_cache.pool.num_blocks - 1} blocks) cannot hold request "
                    f"{entry.request.request_id!r} ({num_tokens} tokens) even alone: export with a larger "
                    "sequence_length or batch_size (the pool grows with both)."
                )
            self._preempt(victim, plan)
            if victim is entry:
                return False

    def _preempt(self, entry: _Running, plan: StepPlan) -> None:
        request = entry.request
        # Its computed blocks stay cached, but no tail: the pool is short of blocks, and its partial last
        # block is the one that frees without evicting anything.
        self._release(entry, cache=True, keep_tail=False)
        request.state = RequestState.WAITING
        request.num_computed = 0
        request.num_preemptions += 1
        request.draft_ids.clear()  # drafted again once its prompt and outputs are recomputed
        self.waiting.appendleft(request)
        plan.decodes = [r for r in plan.decodes if r is not request]
        plan.prefills = [c for c in plan.prefills if c.request is not request]
        plan.admitted = [r for r in plan.admitted if r is not request]
        plan.num_drafts.pop(request.request_id, None)
        plan.preempted.append(request)
        self.stats["preemptions"] += 1

    # ------------------------------------------------------------------ results
    def computed(self, request: Request, num_computed: int) -> None:
        """The engine ran a step for `request`: its first `num_computed` tokens are in the cache."""
        request.num_computed = num_computed
        self.prefix_cache.commit(self._running[request.request_id].seq, request.cacheable_computed)

    def finish(self, request: Request, reason: FinishReason, cache: bool = True) -> None:
        """End a request and release its slot and blocks; its computed tokens are cached unless `cache`
        is False (after a failed step, when they may be half-written). An aborted request's computed
        tokens are sound: they are cached like a finished one's."""
        request.finish_reason = reason
        request.state = RequestState.FINISHED
        entry = self._running.get(request.request_id)
        if entry is not None:
            self._release(entry, cache=cache)
        self.stats["aborted" if reason is FinishReason.ABORT else "finished"] += 1

    def abort(self, request_id: str, cache: bool = True) -> Request | None:
        """Remove a request wherever it is; returns it (None if unknown or already finished)."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self.finish(request, FinishReason.ABORT)
                return request
        entry = self._running.get(request_id)
        if entry is None:
            return None
        self.finish(entry.request, FinishReason.ABORT, cache=cache)
        return entry.request

    def _release(self, entry: _Running, cache: bool, keep_tail: bool = True) -> None:
        request = entry.request
        end_state = None
        # The slot holds the state after the computed tokens, unless they run past what may be cached.
        all_cacheable = request.cacheable_computed == request.num_computed
        if cache and keep_tail and self.slot_state is not None and all_cacheable:
            end_state = self.slot_state(entry.slot)
        self.prefix_cache.finish(entry.seq, request.cacheable_computed if cache else None, end_state)
        del self._running[request.request_id]
        self._free_slots.append(entry.slot)
