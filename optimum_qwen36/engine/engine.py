"""The engine: continuous batching over a model's step backend, the only caller of that backend.

`add_request` queues a prompt; `step` asks the scheduler for a plan (one token for every decoding request,
prefill chunks for the rest of the token budget), runs it, samples every request that has new logits in one
vectorised pass, and returns what each request produced. `abort` frees a request's slot and blocks at once.
Where the backend packs sequences, a step's prefill chunks are packed into as few calls as the compiled
chunk allows (one pass over the weights for several requests' chunks), and where it takes
`decodes_in_prefill` the decode rows ride in the first of them as one-token sequences: a step with a
prefill chunk is one call. A step without one is a decode call over the decoding requests' slots. Other
backends run a decode call, then one call per chunk. (docs/ARCHITECTURE.md: what riding costs in rounding.)

With MTP speculative decoding (a model exported with `num_speculative_tokens` k), each decoding request
verifies its drafts in the step: one verify call feeds every decoding request its last token and up to k
drafts; `sampling.verify_drafts` keeps the accepted ones and one more token; the request's slot continues
from the GDN state after its last kept token (the verify step leaves the slots alone and writes the state
after each position apart), and KV written past it is overwritten before it is ever read. The MTP layer
(speculative.py) then drafts again.

A request that names a `TokenChooser` has its tokens picked there instead of by the sampler: the engine hands
the chooser the request's next-token logits and computes nothing more for it until the pick comes
(generate() runs transformers' processors, stopping criteria and streamer over all of its rows that way).
A request may also bring a `ComputedSequence`: the state of its first tokens, computed elsewhere, copied
into its slot and blocks when it is admitted.

A request with images (an engine with an `ImageEncoder`, the vision tower): images.py places them on the
prompt at admission and encodes each when the first chunk holding its tokens runs.

The GDN state of a request lives in its slot of the cache from admission to finish; its KV blocks come from
the prefix cache's pool. Prefix caching is a policy the scheduler consults: lookup at admission (the engine
restores the hit's GDN checkpoint into the slot), checkpoints stored where prefill chunks end or, where the
backend snapshots states inside a packed call (`prefill_snapshots`), at positions inside its chunks, blocks
registered as they are computed and released at finish.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.base import ImageEncoder, StepBackend
from ..network.cache import CacheStorage
from ..prefix_caching import PrefixCache
from .detokenizer import IncrementalDetokenizer
from .images import EngineImages
from .request import (
    ComputedSequence,
    EngineRequest,
    FinishReason,
    Request,
    RequestOutput,
    RequestState,
    TokenChooser,
)
from .runner import ModelRunner, PackedChunk
from .sampling import SamplingParams, SamplingRow, VerifiedToken, sample, verify_drafts
from .scheduler import PrefillChunk, Scheduler, StepPlan
from .speculative import CatchUp, MTPDrafter


@dataclass
class VerifyStep:
    """A verify call: its requests, the position each started at, and the hidden states [B, k + 1, hidden]."""

    requests: list[Request]
    starts: list[int]
    hidden: torch.Tensor


class Engine:
    def __init__(
        self,
        backend: StepBackend,
        cache: CacheStorage,
        prefix_cache: PrefixCache,
        *,
        prefill_chunk_size: int,
        max_num_batched_tokens: int | None = None,
        eos_token_ids: Sequence[int] = (),
        vocab_size: int,
        tokenizer: Any = None,
        image_encoder: ImageEncoder | None = None,
    ) -> None:
        self.runner = ModelRunner(backend, cache, prefill_chunk_size)
        self.cache = cache
        self.prefix_cache = prefix_cache
        self.max_num_seqs = cache.batch_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.num_speculative_tokens = cache.num_speculative_tokens
        decode_tokens = self.max_num_seqs * (1 + self.num_speculative_tokens)
        # Every running request decodes (and verifies its drafts) each step; one prefill chunk fills the rest
        # by default.
        self.scheduler = Scheduler(
            prefix_cache,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or prefill_chunk_size + decode_tokens,
            prefill_chunk_size=prefill_chunk_size,
            max_model_len=cache.sequence_length,
            num_speculative_tokens=self.num_speculative_tokens,
            prefill_snapshots=self._prefill_snapshots(backend, cache),
            slot_state=self.runner.slot_state,
        )
        self.drafter: MTPDrafter | None = None
        if self.num_speculative_tokens:
            self.drafter = MTPDrafter(self.runner, self.num_speculative_tokens, self._table)
        # Per draft position: drafts verified, and drafts accepted.
        self.images = EngineImages(image_encoder, backend, speculative=self.drafter is not None)
        self._drafted = [0] * self.num_speculative_tokens
        self._accepted = [0] * self.num_speculative_tokens
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        self.num_steps = 0  # steps that computed tokens

    def _prefill_snapshots(self, backend: StepBackend, cache: CacheStorage) -> int:
        """The checkpoint states a step's prefill can snapshot inside its chunks: the backend's, where its
        chunks share packed calls (not with MTP: `_packable`) and the cache has the slots."""
        if not backend.packs_prefill or self.num_speculative_tokens:
            return 0
        return min(backend.prefill_snapshots, cache.snapshot_slots)

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineRequest) -> str:
        """Queue a request; returns its id. Bad input raises ValueError, and nothing is queued."""
        params = request.params
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: the engine generates one sequence per request; submit n requests."
            )
        ids = list(request.prompt_ids)
        checked = (
            ("prompt token ids", ids),
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias token ids", list(params.logit_bias or ())),
        )
        for what, values in checked:
            outside = [t for t in values if not 0 <= t < self.vocab_size]
            if outside:
                raise ValueError(
                    f"{what} {outside[:8]} are not tokens of this model's vocabulary "
                    f"(0..{self.vocab_size - 1})."
                )
        if params.prompt_logprobs is not None and not hasattr(self.runner.backend, "position_logits"):
            raise ValueError(
                f"prompt_logprobs needs every prompt position's logits, which the {self.runner.backend.name} "
                "backend does not return: use the eager, cpu or cuda backend, or leave prompt_logprobs unset."
            )
        reusable_prefix = request.reusable_prefix
        if reusable_prefix is not None and not 0 <= reusable_prefix <= len(ids):
            raise ValueError(
                f"reusable_prefix={reusable_prefix} must be between 0 and the prompt's {len(ids)} tokens."
            )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer: create the engine with one, or use stop_token_ids."
            )
        if request.computed is not None:
            self._check_computed(request.computed, len(ids), params)
        images = self.images.place(request)
        request_id = request.request_id if request.request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use.")
        running = Request(
            request_id,
            ids,
            params,
            eos_token_ids=self.eos_token_ids,
            constraint=request.constraint,
            reusable_prefix=reusable_prefix,
            chooser=request.chooser,
            computed=request.computed,
            images=images,
        )
        self.scheduler.add(running)
        self._requests[request_id] = running
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        return request_id

    def _check_computed(self, computed: ComputedSequence, num_tokens: int, params: SamplingParams) -> None:
        """What can be checked of a computed sequence a request brings: it fits the request's tokens, its
        storage has the shapes of this engine's, and nothing its state lacks is needed (prompt
        log-probabilities)."""
        source, storage = computed.storage, self.cache
        problems = []
        if params.prompt_logprobs is not None:
            problems.append("prompt_logprobs asks for the computed tokens' log-probabilities")
        if not 0 < computed.num_computed < num_tokens:
            problems.append(f"{computed.num_computed} computed tokens of a {num_tokens}-token prompt")
        if len(computed.block_ids) != -(-computed.num_computed // storage.block_size):
            problems.append(f"{len(computed.block_ids)} blocks for {computed.num_computed} tokens")
        shapes = [
            (t.shape[2:], t.dtype) for t in (storage.key_cache, storage.conv_state, storage.recurrent_state)
        ]
        theirs = [
            (t.shape[2:], t.dtype) for t in (source.key_cache, source.conv_state, source.recurrent_state)
        ]
        if shapes != theirs or source.block_size != storage.block_size:
            problems.append("its storage holds KV blocks or GDN states of other shapes than this engine's")
        if problems:
            raise ValueError("cannot continue a computed sequence: " + "; ".join(problems) + ".")

    def abort(self, request_id: str, after_error: bool = False) -> RequestOutput | None:
        """Stop a request now: its slot and blocks are freed. Returns its final output (None if unknown).
        `after_error`: a step failed, so nothing of the request is cached."""
        request = self.scheduler.abort(request_id, cache=not after_error)
        if request is None:
            return None
        if self.drafter is not None:
            self.drafter.forget(request)
        return self._output(request, [], [], FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def request(self, request_id: str) -> Request:
        """A queued or running request (finished ones are dropped after their last output)."""
        return self._requests[request_id]

    def stats(self) -> dict[str, Any]:
        running = self.scheduler.running
        return {
            "running": len(running),
            "waiting": len(self.scheduler.waiting),
            "slots_used": len(running),
            "slots": self.max_num_seqs,
            "free_blocks": self.prefix_cache.pool.num_free,
            # Blocks holding cached prefixes that no request uses: evicted on demand, so as good as free.
            "evictable_blocks": self.prefix_cache.available_blocks() - self.prefix_cache.pool.num_free,
            "blocks": self.prefix_cache.pool.num_blocks - 1,
            "block_size": self.cache.block_size,
            **self.scheduler.stats,
            "prefix_cache": self.prefix_cache.stats(),
            **({"speculative": self.speculative_stats()} if self.drafter else {}),
        }

    def computed_sequence(self, request_id: str) -> ComputedSequence:
        """Where a running request's computed tokens are in this engine's storage (its slot and blocks, valid
        until the request ends or the engine runs another step)."""
        request = self._requests[request_id]
        blocks = self.scheduler.block_table(request)[: -(-request.num_computed // self.cache.block_size)]
        return ComputedSequence(
            self.cache, self.scheduler.slot_of(request), tuple(blocks), request.num_computed
        )

    def speculative_stats(self) -> dict[str, Any]:
        """MTP acceptance: drafts verified and accepted at each draft position, and their ratio."""
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "drafted_per_position": list(self._drafted),
            "accepted_per_position": list(self._accepted),
            "acceptance_rate_per_position": [
                a / d if d else 0.0 for a, d in zip(self._accepted, self._drafted, strict=True)
            ],
        }

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one plan; returns an output for every request that produced tokens or finished."""
        plan = self.scheduler.schedule()
        self.num_steps += bool(plan)
        for request in plan.admitted:
            self._start(request)
        kept: list[tuple[Request, list[VerifiedToken]]] = []
        verified: VerifyStep | None = None
        rows: list[Request] = []
        logits: list[torch.Tensor] = []
        packable = [c for c in plan.prefills if self._packable(c)]
        riding = self._riding_decodes(plan) if packable else []
        if plan.decodes and self.drafter is not None:
            verified, verified_kept, verified_rows = self._verify(plan)
            kept += verified_kept
            rows += [request for request, _ in verified_rows]
            logits += [row_logits[None] for _, row_logits in verified_rows]
        elif plan.decodes and not riding:
            logits.append(self._decode(plan.decodes))
            rows += plan.decodes
        chunk_hidden: list[tuple[PrefillChunk, torch.Tensor]] = []
        for chunk in (c for c in plan.prefills if not self._packable(c)):
            chunk_logits, hidden = self._prefill(chunk)
            if hidden is not None:
                chunk_hidden.append((chunk, hidden))
            if chunk.completes:
                logits.append(chunk_logits)
                rows.append(chunk.request)
        for pack in self._packs(riding + packable):
            pack_logits = self._prefill_packed(pack)
            for i, chunk in enumerate(pack):
                if chunk.completes:
                    logits.append(pack_logits[i : i + 1])
                    rows.append(chunk.request)
        every_logits = torch.cat(logits) if rows else None
        if any(request.chooser is not None for request in rows):
            kept += self._chosen(rows, every_logits)
            engine_rows = [i for i, request in enumerate(rows) if request.chooser is None]
            every_logits, rows = every_logits[engine_rows], [rows[i] for i in engine_rows]
        if rows:
            sampled = sample(every_logits, [self._sampling_row(r) for r in rows])
            for i, request in enumerate(rows):
                token = VerifiedToken(
                    int(sampled.tokens[i]), float(sampled.logprobs[i]), sampled.top_logprobs[i]
                )
                kept.append((request, [token]))
        outputs = []
        finished = []
        for request, tokens in kept:
            output = self._append(request, tokens)
            outputs.append(output)
            if output.finish_reason is not None:
                finished.append((request, output.finish_reason))
        if verified is not None:
            # A request its chooser picks for keeps the one token it fed, whenever the pick comes.
            fed = {r.request_id: 1 for r in verified.requests if r.chooser is not None}
            self._keep_verified(verified, fed | {o.request_id: len(o.new_token_ids) for o in outputs})
        if self.drafter is not None:
            self._draft(verified, chunk_hidden, {request.request_id for request, _ in finished})
        # Last: finishing releases the request's blocks, which the steps above still wrote.
        for request, reason in finished:
            self.scheduler.finish(request, reason)
            if self.drafter is not None:
                self.drafter.forget(request)
        return outputs

    def run(self) -> dict[str, Request]:
        """Step until every queued request is finished; returns them by id (tests, offline use)."""
        requests = dict(self._requests)
        while self.has_unfinished():
            self.step()
        return requests

    def _chosen(self, rows: list[Request], logits: torch.Tensor) -> list[tuple[Request, list[VerifiedToken]]]:
        """Hand each chooser the next-token logits of its rows among `rows`; returns the tokens the choosers
        pick (for these rows or rows offered earlier)."""
        offers: dict[int, tuple[TokenChooser, dict[str, torch.Tensor]]] = {}
        for request, row_logits in zip(rows, logits, strict=True):
            if request.chooser is not None:
                request.state = RequestState.DECODING
                offers.setdefault(id(request.chooser), (request.chooser, {}))[1][request.request_id] = (
                    row_logits
                )
        kept = []
        for chooser, offered in offers.values():
            for request_id, choice in chooser.choose(offered).items():
                request = self._requests.get(request_id)
                if request is None or request.chooser is not chooser:
                    raise RuntimeError(
                        f"a token chooser picked a token for request {request_id!r}, which is not one of "
                        "its requests"
                    )
                if choice.filler and request.filler_from is None:
                    request.filler_from = request.num_tokens
                kept.append((request, [VerifiedToken(int(choice.token), math.nan, None)]))
        return kept

    # ------------------------------------------------------------------ execution
    def _start(self, request: Request) -> None:
        """A request enters its slot: the computed sequence it brings, the prefix hit's GDN checkpoint, or a
        zero state."""
        slot = self.scheduler.slot_of(request)
        seq = self.scheduler.sequence_of(request)
        computed = request.computed
        if computed is not None:
            blocks = seq.block_ids[: len(computed.block_ids)]
            self.cache.copy_sequence(computed.storage, computed.slot, computed.block_ids, slot, blocks)
        elif seq.checkpoint is not None:
            self.prefix_cache.restore(seq, *self.runner.slot_state(slot))
        else:
            self.runner.reset_slot(slot)

    def _table(self, request: Request) -> torch.Tensor:
        blocks = self.scheduler.block_table(request)
        table = torch.zeros(self.cache.max_blocks_per_row, dtype=torch.long)
        table[: len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        return table

    def _decode(self, requests: list[Request]) -> torch.Tensor:
        with_images = any(request.images is not None for request in requests)
        logits = self.runner.decode(
            torch.tensor([request.output_ids[-1] for request in requests]),
            torch.tensor([request.num_computed for request in requests]),
            torch.tensor([self.scheduler.slot_of(request) for request in requests]),
            torch.stack([self._table(request) for request in requests]),
            torch.tensor([request.rope_delta for request in requests]) if with_images else None,
        )
        for request in requests:
            self._computed(request, request.num_computed + 1)
        return logits

    def _packable(self, chunk: PrefillChunk) -> bool:
        """Whether the chunk can share a prefill call: it needs only its last logits."""
        return (
            self.runner.backend.packs_prefill
            and self.drafter is None
            and not chunk.request.needs_prompt_logprobs
        )

    def _riding_decodes(self, plan: StepPlan) -> list[PrefillChunk]:
        """The plan's decode rows as one-token chunks of the step's packed prefill call, where the backend
        takes them there (`decodes_in_prefill`): one pass over the weights for the whole step instead of a
        decode call and a prefill call. (A step packs chunks only without MTP drafts: `_packable`.)"""
        if not self.runner.backend.decodes_in_prefill:
            return []
        return [PrefillChunk(request, request.num_computed, 1) for request in plan.decodes]

    def _packs(self, chunks: list[PrefillChunk]) -> list[list[PrefillChunk]]:
        """The chunks in calls of at most `max_packed_tokens` each, in plan order."""
        packs: list[list[PrefillChunk]] = []
        size = 0
        for chunk in chunks:
            if not packs or size + chunk.num_tokens > self.runner.max_packed_tokens:
                packs.append([])
                size = 0
            packs[-1].append(chunk)
            size += chunk.num_tokens
        return packs

    def _prefill_packed(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """One call over the chunks; the logits after each one's last token."""
        sequences = []
        for chunk in chunks:
            request = chunk.request
            tokens = request.token_ids[chunk.start : chunk.end]
            table = self._table(request)
            slot = self.scheduler.slot_of(request)
            images = self.images.chunk(request, chunk.start, chunk.end)
            sequences.append(PackedChunk(tokens, chunk.start, slot, table, chunk.snapshots, images))
        logits = self.runner.prefill_packed(sequences)
        taken = itertools.count()
        for chunk, sequence in zip(chunks, sequences, strict=True):
            states = {p: self.runner.snapshot_state(next(taken)) for p in sorted(sequence.snapshots)}
            self._computed(chunk.request, chunk.end, snapshots=states)
        return logits

    def _prefill(self, chunk: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunk's logits after its last token, and (speculative decoding) its hidden states."""
        request = chunk.request
        run = PackedChunk(
            request.token_ids[chunk.start : chunk.end],
            chunk.start,
            self.scheduler.slot_of(request),
            self._table(request),
            images=self.images.chunk(request, chunk.start, chunk.end),
        )
        if request.needs_prompt_logprobs:  # chunks run in order: this one holds prompt positions
            logits, hidden, positions = self.runner.prefill_positions(run)
            self._note_prompt_logprobs(request, chunk.start, positions)
            hidden = hidden if self.drafter is not None else None
        elif self.drafter is not None:
            logits, hidden = self.runner.prefill_hidden(run)
        else:
            logits, hidden = self.runner.prefill(run), None
        self._computed(request, chunk.end)
        return logits, hidden

    @staticmethod
    def _note_prompt_logprobs(request: Request, start: int, logits: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens that `logits` (after each token from position `start`)
        predict: position start + 1 onwards, up to the prompt's end."""
        targets = torch.tensor(request.prompt_ids[start + 1 : start + 1 + len(logits)], dtype=torch.long)
        logprobs = logits[: len(targets)]
        logprobs -= logprobs.logsumexp(dim=-1, keepdim=True)  # in place: chunk x vocab float32 is large
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
        top = request.params.prompt_logprobs or 0
        values, ids = logprobs.topk(top, dim=-1) if top else (None, None)
        for j, value in enumerate(chosen):
            request.prompt_logprobs[start + 1 + j] = value
            if values is not None:
                entry = dict(zip(ids[j].tolist(), values[j].tolist(), strict=True))
                request.prompt_top_logprobs[start + 1 + j] = entry

    def _verify(
        self, plan: StepPlan
    ) -> tuple[VerifyStep, list[tuple[Request, list[VerifiedToken]]], list[tuple[Request, torch.Tensor]]]:
        """One verify call over the decoding requests: each feeds its last token and its drafts. Returns the
        step, the tokens each request the engine samples for keeps, and the next-token logits of the
        requests whose chooser picks their tokens."""
        requests = plan.decodes
        assert self.drafter is not None
        self.drafter.extend(requests, plan.num_drafts)
        tokens = torch.zeros((len(requests), 1 + self.num_speculative_tokens), dtype=torch.long)
        for i, request in enumerate(requests):
            fed = [request.output_ids[-1], *request.draft_ids]
            tokens[i, : len(fed)] = torch.tensor(fed)
        starts = [request.num_computed for request in requests]
        logits, hidden = self.runner.verify(
            tokens,
            torch.tensor(starts),
            torch.tensor([1 + len(request.draft_ids) for request in requests]),
            torch.tensor([self.scheduler.slot_of(request) for request in requests]),
            torch.stack([self._table(request) for request in requests]),
        )
        kept, chosen = [], []
        for i, request in enumerate(requests):
            if request.chooser is not None:
                chosen.append((request, logits[i, 0]))
                continue
            drafts = request.draft_ids
            verified = verify_drafts(logits[i, : 1 + len(drafts)], self._sampling_row(request), drafts)
            for position in range(len(drafts)):
                self._drafted[position] += 1
                self._accepted[position] += position < len(verified) - 1
            kept.append((request, verified))
        return VerifyStep(requests, starts, hidden), kept, chosen

    def _keep_verified(self, step: VerifyStep, kept: dict[str, int]) -> None:
        """Each verified request keeps its first `kept[id]` fed tokens (its last token and the accepted drafts
        its output kept): its slot continues from the GDN state after them, and checkpoints the prefix cache
        wants inside them are taken from the states after each position."""
        for request, start in zip(step.requests, step.starts, strict=True):
            slot = self.scheduler.slot_of(request)

            def state_after(
                position: int, slot: int = slot, start: int = start
            ) -> tuple[torch.Tensor, torch.Tensor]:
                return self.runner.verified_state(slot, position - start - 1)

            self._computed(request, start + kept[request.request_id], state_after)
            self.runner.keep_verified_state(slot, kept[request.request_id] - 1)

    def _draft(
        self,
        verified: VerifyStep | None,
        chunk_hidden: list[tuple[PrefillChunk, torch.Tensor]],
        finished: set[str],
    ) -> None:
        """The MTP layer over every position the trunk computed this step; a decoding request that goes on
        gets its first draft from it."""
        assert self.drafter is not None

        def drafts(request: Request) -> bool:
            decoding = request.state is RequestState.DECODING and request.request_id not in finished
            return decoding and request.constraint is None  # a grammar's state cannot follow drafts

        if verified is not None:
            rows = []
            for i, (request, start) in enumerate(zip(verified.requests, verified.starts, strict=True)):
                if request.chooser is not None:
                    continue  # its chooser picks one token at a time: it never drafts
                # The token after each kept position: the step's new tokens.
                new_tokens = request.output_ids[start - request.num_computed :]
                rows.append(CatchUp(request, start, new_tokens, verified.hidden[i], drafts(request)))
            self.drafter.catch_up(rows)
        for chunk, hidden in chunk_hidden:
            request = chunk.request
            if request.chooser is not None:
                continue
            next_tokens = request.token_ids[chunk.start + 1 : chunk.end + 1]
            self.drafter.catch_up([CatchUp(request, chunk.start, next_tokens, hidden[0], drafts(request))])

    def _computed(
        self,
        request: Request,
        num_computed: int,
        state_after: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
        snapshots: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        """Record that the request's first `num_computed` tokens are in the cache, and keep its GDN state
        where the prefix cache wants a checkpoint: the slot's, with `snapshots` the states a packed prefill
        kept inside its chunk, or with `state_after` (a verify step) the state after each newly computed
        position."""
        before = request.num_computed
        self.scheduler.computed(request, num_computed)
        seq = self.scheduler.sequence_of(request)
        snapshots = snapshots or {}
        positions = range(before + 1, num_computed + 1) if state_after else [*snapshots, num_computed]
        for position in positions:
            if position > request.cacheable_computed:
                break  # filler
            store = position in seq.snapshot_positions
            if not store and not self.prefix_cache.decode_snapshot_due(seq, position):
                continue
            if state_after is not None:
                conv, recurrent = state_after(position)
            elif position in snapshots:
                conv, recurrent = snapshots[position]
            else:
                conv, recurrent = self.runner.slot_state(self.scheduler.slot_of(request))
            if store:
                self.prefix_cache.store_checkpoint(seq, position, conv, recurrent)
            else:
                self.prefix_cache.stage_checkpoint(seq, position, conv, recurrent)

    def _sampling_row(self, request: Request) -> SamplingRow:
        return SamplingRow(
            request.params,
            request.prompt_ids,
            request.output_ids,
            request.stop_ids,
            request.generator,
            request.constraint,
        )

    # ------------------------------------------------------------------ results
    def _append(self, request: Request, tokens: list[VerifiedToken]) -> RequestOutput:
        """Add the step's new tokens to the request, up to the first that ends it (the engine finishes it at
        the end of the step). Exactly where one-token-at-a-time decoding would stop."""
        detokenizer = self._detokenizers.get(request.request_id)
        first_output = not request.output_ids
        new_tokens: list[int] = []
        tops = []
        text = ""
        reason = None
        for verified in tokens:
            token = verified.token
            now = time.monotonic()
            request.output_ids.append(token)
            if request.constraint is not None:
                request.constraint.accept(token)
            self.scheduler.sequence_of(request).append_tokens([token])
            request.output_logprobs.append(verified.logprob)
            request.token_times.append(now)
            if request.first_token_time is None:
                request.first_token_time = now
            new_tokens.append(token)
            tops.append(verified.top_logprobs)
            # Like stop tokens, stop strings count only once min_tokens tokens exist (vLLM's rule).
            stops_allowed = len(request.output_ids) >= request.params.min_tokens
            text += detokenizer.add([token], stops_allowed) if detokenizer is not None else ""
            reason = self._finish_reason(request, token, detokenizer)
            if reason is not None:
                break
        request.state = RequestState.DECODING
        if reason is not None and detokenizer is not None:
            text += detokenizer.flush()
        output = self._output(request, new_tokens, tops, reason, text=text)
        output.logprobs = request.output_logprobs[-len(new_tokens) :]
        if first_output and request.params.prompt_logprobs is not None:
            output.prompt_logprobs = list(request.prompt_logprobs)
            output.prompt_top_logprobs = list(request.prompt_top_logprobs)
        return output

    def _finish_reason(
        self, request: Request, token: int, detokenizer: IncrementalDetokenizer | None
    ) -> FinishReason | None:
        params = request.params
        if request.chooser is not None:
            return None  # its caller ends it
        if len(request.output_ids) >= params.min_tokens and token in request.stop_ids:
            return FinishReason.STOP
        if detokenizer is not None and detokenizer.stopped_on is not None:
            return FinishReason.STOP
        if params.max_tokens is not None and len(request.output_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.cache.sequence_length:
            return FinishReason.LENGTH
        return None

    def _output(
        self,
        request: Request,
        new_tokens: list[int],
        tops: list[tuple[torch.Tensor, torch.Tensor] | None],
        reason: FinishReason | None,
        text: str = "",
    ) -> RequestOutput:
        top_logprobs = [dict(zip(t[0].tolist(), t[1].tolist(), strict=True)) for t in tops if t is not None]
        finished = reason is not None
        if finished:
            # Its last output: the engine keeps nothing of a finished request.
            self._requests.pop(request.request_id, None)
            self._detokenizers.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            text_delta=text,
            top_logprobs=top_logprobs,
            finished=finished,
            finish_reason=reason,
            cached_prompt_tokens=request.cached_prompt_tokens,
        )
