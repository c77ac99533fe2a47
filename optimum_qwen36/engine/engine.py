"""The engine: continuous batching over a model's step backend, the only caller of that backend.

`add_request` queues a prompt; `step` asks the scheduler for a plan (one token for every decoding request,
prefill chunks for the rest of the token budget), runs it (one decode call over the decoding requests' slots,
one prefill call per chunk), samples every request that has new logits in one vectorised pass, and returns
what each request produced. `abort` frees a request's slot and blocks at once.

The GDN state of a request lives in its slot of the cache from admission to finish; its KV blocks come from
the prefix cache's pool. Prefix caching is a policy the scheduler consults: lookup at admission (the engine
restores the hit's GDN checkpoint into the slot), checkpoints stored where prefill chunks end, blocks
registered as they are computed and released at finish.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..exporters.base import StepBackend
from ..modeling.cache import Qwen36HybridCache
from ..prefix_caching import PrefixCache
from .detokenizer import IncrementalDetokenizer
from .request import FinishReason, Request, RequestOutput, RequestState
from .runner import ModelRunner
from .sampling import SampledTokens, SamplingParams, SamplingRow, TokenConstraint, sample
from .scheduler import PrefillChunk, Scheduler


class Engine:
    def __init__(
        self,
        backend: StepBackend,
        cache: Qwen36HybridCache,
        prefix_cache: PrefixCache,
        *,
        prefill_chunk_size: int,
        max_num_batched_tokens: int | None = None,
        eos_token_ids: Sequence[int] = (),
        vocab_size: int,
        tokenizer: Any = None,
    ) -> None:
        self.runner = ModelRunner(backend, cache, prefill_chunk_size)
        self.cache = cache
        self.prefix_cache = prefix_cache
        self.prefill_chunk_size = prefill_chunk_size
        self.max_num_seqs = cache.batch_size
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        # Every running request decodes one token per step; one prefill chunk fills the rest by default.
        self.scheduler = Scheduler(
            prefix_cache,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or prefill_chunk_size + self.max_num_seqs,
            prefill_chunk_size=prefill_chunk_size,
            max_model_len=cache.sequence_length,
        )
        self._requests: dict[str, Request] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        constraint: TokenConstraint | None = None,
    ) -> str:
        """Queue a prompt (token ids); returns its request id. `constraint` restricts which tokens it may
        produce (structured output). Bad input raises ValueError, and nothing is queued."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(
                f"n={params.n}: the engine generates one sequence per request; submit n requests."
            )
        ids = [int(t) for t in prompt_ids]
        for what, values in (("prompt token ids", ids), ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in values if not 0 <= t < self.vocab_size]
            if outside:
                raise ValueError(
                    f"{what} {outside[:8]} are not tokens of this model's vocabulary "
                    f"(0..{self.vocab_size - 1})."
                )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer: create the engine with one, or use stop_token_ids."
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use.")
        request = Request(request_id, ids, params, eos_token_ids=self.eos_token_ids, constraint=constraint)
        self.scheduler.add(request)
        self._requests[request_id] = request
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        return request_id

    def abort(self, request_id: str, after_error: bool = False) -> RequestOutput | None:
        """Stop a request now: its slot and blocks are freed. Returns its final output (None if unknown).
        `after_error`: a step failed, so nothing of the request is cached."""
        request = self.scheduler.abort(request_id, cache=not after_error)
        if request is None:
            return None
        return self._output(request, [], None, finished=True)

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
            "blocks": self.prefix_cache.pool.num_blocks - 1,
            **self.scheduler.stats,
            "prefix_cache": self.prefix_cache.stats(),
        }

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one plan; returns an output for every request that produced tokens or finished."""
        plan = self.scheduler.schedule()
        for request in plan.admitted:
            self._start(request)
        rows: list[Request] = []
        logits: list[torch.Tensor] = []
        if plan.decodes:
            logits.append(self._decode(plan.decodes))
            rows += plan.decodes
        for chunk in plan.prefills:
            chunk_logits = self._prefill(chunk)
            if chunk.completes:
                logits.append(chunk_logits)
                rows.append(chunk.request)
        if not rows:
            return []
        sampled = sample(torch.cat(logits), [self._sampling_row(r) for r in rows])
        return [self._append(request, i, sampled) for i, request in enumerate(rows)]

    def run(self) -> dict[str, Request]:
        """Step until every queued request is finished; returns them by id (tests, offline use)."""
        requests = dict(self._requests)
        while self.has_unfinished():
            self.step()
        return requests

    # ------------------------------------------------------------------ execution
    def _start(self, request: Request) -> None:
        """A request enters its slot: the prefix hit's GDN checkpoint, or a zero state."""
        slot = self.scheduler.slot_of(request)
        seq = self.scheduler.sequence_of(request)
        if seq.checkpoint is not None:
            self.prefix_cache.restore(seq, *self.runner.slot_state(slot))
        else:
            self.runner.reset_slot(slot)

    def _table(self, request: Request) -> torch.Tensor:
        blocks = self.scheduler.block_table(request)
        table = torch.zeros(self.cache.max_blocks_per_row, dtype=torch.long)
        table[: len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        return table

    def _decode(self, requests: list[Request]) -> torch.Tensor:
        logits = self.runner.decode(
            torch.tensor([request.output_ids[-1] for request in requests]),
            torch.tensor([request.num_computed for request in requests]),
            torch.tensor([self.scheduler.slot_of(request) for request in requests]),
            torch.stack([self._table(request) for request in requests]),
        )
        for request in requests:
            self._computed(request, request.num_computed + 1)
        return logits

    def _prefill(self, chunk: PrefillChunk) -> torch.Tensor:
        request = chunk.request
        logits = self.runner.prefill(
            request.token_ids[chunk.start : chunk.end],
            chunk.start,
            self.scheduler.slot_of(request),
            self._table(request),
        )
        self._computed(request, chunk.end)
        return logits

    def _computed(self, request: Request, num_computed: int) -> None:
        """Record that the request's first `num_computed` tokens are in the cache, and keep its GDN state
        where the prefix cache wants a checkpoint."""
        self.scheduler.computed(request, num_computed)
        seq = self.scheduler.sequence_of(request)
        conv, recurrent = self.runner.slot_state(self.scheduler.slot_of(request))
        if num_computed in seq.snapshot_positions:
            self.prefix_cache.store_checkpoint(seq, num_computed, conv, recurrent)
        elif self.prefix_cache.decode_snapshot_due(seq, num_computed):
            self.prefix_cache.stage_checkpoint(seq, num_computed, conv, recurrent)

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
    def _append(self, request: Request, row: int, sampled: SampledTokens) -> RequestOutput:
        token = int(sampled.tokens[row])
        now = time.monotonic()
        request.output_ids.append(token)
        if request.constraint is not None:
            request.constraint.accept(token)
        self.scheduler.sequence_of(request).append_tokens([token])
        request.output_logprobs.append(float(sampled.logprobs[row]))
        request.token_times.append(now)
        if request.first_token_time is None:
            request.first_token_time = now
        request.state = RequestState.DECODING
        detokenizer = self._detokenizers.get(request.request_id)
        # Like stop tokens, stop strings count only once min_tokens tokens exist (vLLM's rule).
        stops_allowed = len(request.output_ids) >= request.params.min_tokens
        text = detokenizer.add([token], stops_allowed) if detokenizer is not None else ""
        reason = self._finish_reason(request, token, detokenizer)
        if reason is not None:
            self.scheduler.finish(request, reason)
            if detokenizer is not None:
                text += detokenizer.flush()
        top = sampled.top_logprobs[row]
        output = self._output(request, [token], top, finished=reason is not None, text=text)
        output.logprobs = [request.output_logprobs[-1]]
        return output

    def _finish_reason(
        self, request: Request, token: int, detokenizer: IncrementalDetokenizer | None
    ) -> FinishReason | None:
        params = request.params
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
        top: tuple[torch.Tensor, torch.Tensor] | None,
        finished: bool,
        text: str = "",
    ) -> RequestOutput:
        top_logprobs = [] if top is None else [dict(zip(top[0].tolist(), top[1].tolist(), strict=True))]
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
            finish_reason=request.finish_reason,
            cached_prompt_tokens=request.cached_prompt_tokens,
        )
