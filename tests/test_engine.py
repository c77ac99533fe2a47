"""The engine: continuous batching gives every request the tokens it gets alone (batch invariance), against
transformers too; the scheduler's budget, preemption, aborts and stop conditions; per-request sampling.

fp32, eager backend, a tiny model. A request's solo run is a fresh engine over a model without prefix
caching, holding only that request: the reference its run in company must equal."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from typing import Any

import pytest
import torch
from conftest import save_tiny_checkpoint
from helpers import CountingBackend, export_eager
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from optimum_qwen36 import Qwen36HybridCache
from optimum_qwen36.engine import (
    AsyncEngine,
    ChosenToken,
    EngineDeadError,
    EngineLoop,
    EngineRequest,
    FinishReason,
    IncrementalDetokenizer,
    SamplingParams,
)
from optimum_qwen36.engine.sampling import SamplingRow, apply_penalties, filter_logits, request_generator
from optimum_qwen36.tokenizer import load_qwen36_tokenizer

SETTINGS = dict(batch_size=8, sequence_length=3072 + 64, prefill_chunk_size=64)
VOCAB = 512


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("engine") / "ckpt", "causal", seed=9)


@pytest.fixture(scope="module")
def cold(checkpoint):
    return export_eager(checkpoint[0], **SETTINGS)


@pytest.fixture(scope="module")
def cached(checkpoint):
    return export_eager(checkpoint[0], prefix_caching=True, **SETTINGS)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def solo(model, prompt: list[int], params: SamplingParams) -> Any:
    engine = model.create_engine()
    request_id = engine.add_request(EngineRequest(prompt, params))
    return engine.run()[request_id]


@pytest.fixture
def sampled_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request records the logits its tokens were sampled from, step by step (`request.logits`)."""
    from optimum_qwen36.engine import engine as engine_module

    step: dict[str, Any] = {}
    real_sample, real_append = engine_module.sample, engine_module.Engine._append

    def sample(logits: torch.Tensor, rows: list) -> Any:
        step["logits"], step["row"] = logits, 0
        return real_sample(logits, rows)

    def append(self, request, tokens) -> Any:
        # The engine appends the sampled rows' tokens in the order it sampled them.
        request.__dict__.setdefault("logits", []).append(step["logits"][step["row"]].clone())
        step["row"] += 1
        return real_append(self, request, tokens)

    monkeypatch.setattr(engine_module, "sample", sample)
    monkeypatch.setattr(engine_module.Engine, "_append", append)


def assert_same_run(ours: Any, alone: Any) -> float:
    """Same tokens and finish reason; logits within 1e-4 of the solo run's largest at every step. Returns
    the largest |difference| relative to that."""
    assert ours.output_ids == alone.output_ids, (ours.request_id, ours.output_ids, alone.output_ids)
    assert ours.finish_reason == alone.finish_reason
    theirs, mine = torch.stack(alone.logits), torch.stack(ours.logits)
    relative = float((mine - theirs).abs().max() / theirs.abs().max())
    assert relative <= 1e-4, (ours.request_id, relative)
    return relative


def test_greedy_tokens_equal_transformers(checkpoint, cold) -> None:
    _, reference = checkpoint
    prompt = tokens(150, 1)  # three prefill chunks
    run = solo(cold, prompt, SamplingParams(temperature=0, max_tokens=24))
    theirs = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert run.output_ids == theirs[0, len(prompt) :].tolist()
    assert run.finish_reason is FinishReason.LENGTH


def run_outputs(engine: Any, prompts: list[list[int]], params: SamplingParams) -> list[list[Any]]:
    """Each prompt's RequestOutputs, the requests run one after the other on one engine."""
    runs = []
    for prompt in prompts:
        request_id = engine.add_request(EngineRequest(prompt, params))
        outputs = []
        while engine.has_unfinished():
            outputs += [o for o in engine.step() if o.request_id == request_id]
        runs.append(outputs)
    return runs


def test_prompt_logprobs_equal_transformers_and_ignore_the_prefix_cache(checkpoint, cached) -> None:
    """Every prompt token's log-probability (and top 3) over three prefill chunks, in the first output only;
    the same prompt again, now cached, is computed again: a cached prefix has no logits to give."""
    _, reference = checkpoint
    prompt = tokens(150, 3)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    chosen = expected.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    engine = cached.create_engine()
    first, again = run_outputs(engine, [prompt, prompt], params)
    plain = run_outputs(engine, [prompt], SamplingParams(temperature=0, max_tokens=3))[0]
    assert plain[0].cached_prompt_tokens > 0 and plain[0].prompt_logprobs is None  # the cache is warm
    for outputs in (first, again):
        assert outputs[0].cached_prompt_tokens == 0
        assert all(o.prompt_logprobs is None for o in outputs[1:])
        values, tops = outputs[0].prompt_logprobs, outputs[0].prompt_top_logprobs
        assert values[0] is None and tops[0] is None and len(values) == len(prompt)
        torch.testing.assert_close(torch.tensor(values[1:]), chosen, atol=1e-4, rtol=0)
        top_values, top_ids = expected.topk(3, dim=-1)
        assert [list(t) for t in tops[1:]] == top_ids.tolist()
        torch.testing.assert_close(
            torch.tensor([list(t.values()) for t in tops[1:]]), top_values, atol=1e-4, rtol=0
        )
        assert [t for o in outputs for t in o.new_token_ids] == [t for o in plain for t in o.new_token_ids]


def test_prompt_logprobs_survive_preemption(cold, cached) -> None:
    """Requests scoring their prompts while the block pool preempts: each delivers its prompt's
    log-probabilities once, equal to its solo run's (a preempted request computes its prompt again)."""
    prompts = [tokens(n, 20 + i) for i, n in enumerate((300, 260, 200))]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, prompt_logprobs=1)
    engine = cached.create_engine(num_kv_blocks=13, max_num_batched_tokens=2 * 64 + 8)  # 12 usable blocks
    ids = [engine.add_request(EngineRequest(prompt, params)) for prompt in prompts]
    held = [engine.request(request_id) for request_id in ids]
    delivered: dict[str, list[Any]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for output in engine.step():
            if output.prompt_logprobs is not None:
                delivered[output.request_id].append(output.prompt_logprobs)
    assert max(request.num_preemptions for request in held) > 0
    for request_id, prompt in zip(ids, prompts, strict=True):
        (values,) = delivered[request_id]
        alone = run_outputs(cold.create_engine(), [prompt], params)[0][0].prompt_logprobs
        assert values[0] is None and alone[0] is None
        torch.testing.assert_close(torch.tensor(values[1:]), torch.tensor(alone[1:]), atol=1e-5, rtol=0)


@pytest.mark.usefixtures("sampled_logits")
def test_requests_get_their_solo_tokens_in_company(cold, cached) -> None:
    """Up to 8 running at once out of 12, arriving at random steps: prompts of 1 to 3000 tokens (long prompts
    prefilled while others decode), greedy and seeded sampling, prefix-cache hits and misses mixed (two
    groups share prefixes), one request aborted midway, and a block pool small enough to force preemptions.
    Each request's tokens equal its solo run's, its logits within 1e-4 of the largest (not bitwise: a row's
    matrix products round differently with other row counts: up to ~5e-6 of the largest logit here)."""
    rng = random.Random(0)
    shared, system = tokens(200, 50), tokens(700, 51)
    prompts = [
        tokens(1, 10),
        tokens(3000, 11),
        shared + tokens(30, 12),
        tokens(70, 13),
        shared + tokens(5, 14),
        tokens(129, 15),
        system + tokens(800, 16),
        tokens(33, 17),
        system + tokens(90, 18),
        tokens(1500, 19),
        tokens(64, 20),
        system + tokens(3, 21),
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(8, 40)) if i % 3 else
        SamplingParams(temperature=0.8, top_k=40, seed=100 + i, max_tokens=rng.randint(8, 40))
        for i in range(len(prompts))
    ]  # fmt: skip
    arrivals = sorted(rng.randint(0, 60) for _ in prompts)
    # The running requests need up to ~110 blocks of 64 tokens; 64 make the pool the bottleneck (the
    # longest request needs 48 alone). Two prefill chunks per step: short prompts progress beside long ones.
    engine = cached.create_engine(num_kv_blocks=65, max_num_batched_tokens=2 * 64 + 8)
    held: dict[int, Any] = {}
    aborted = 7
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                held[i] = engine.request(engine.add_request(EngineRequest(prompts[i], params[i])))
        if step == arrivals[aborted] + 6:
            engine.abort(held[aborted].request_id)
        engine.step()
        step += 1
        assert step < 2000, "the engine did not finish"
    stats = engine.stats()
    assert stats["preemptions"] > 0, stats
    assert stats["prefix_cache"]["hit_tokens"] > 0, stats
    assert max(r.num_preemptions for r in held.values()) > 0
    assert held[aborted].finish_reason is FinishReason.ABORT
    for i, request in held.items():
        if i != aborted:
            assert_same_run(request, solo(cold, prompts[i], params[i]))
    assert not any(
        engine.prefix_cache.pool.ref_count(b) for b in range(1, engine.prefix_cache.pool.num_blocks)
    )


def test_a_long_prefill_delays_running_decodes_by_one_chunk_per_step(cold) -> None:
    engine = cold.create_engine()
    short = engine.add_request(EngineRequest(tokens(10, 20), SamplingParams(temperature=0, max_tokens=30)))
    engine.step()  # prefill of the short prompt and its first token
    long = engine.add_request(EngineRequest(tokens(600, 21), SamplingParams(temperature=0, max_tokens=2)))
    held = {short: engine.request(short), long: engine.request(long)}
    steps_while_prefilling = 0
    while held[long].state.value != "decoding":
        before = len(held[short].output_ids)
        outputs = {o.request_id: o for o in engine.step()}
        assert len(held[short].output_ids) == before + 1, "the decoding request missed a step"
        assert short in outputs
        steps_while_prefilling += 1
    assert steps_while_prefilling == -(-600 // 64)  # one 64-token chunk per step, 10 steps


def test_stop_conditions(cold) -> None:
    prompt = tokens(40, 30)
    greedy = solo(cold, prompt, SamplingParams(temperature=0, max_tokens=20)).output_ids
    stop = greedy[5]
    first = greedy.index(stop)
    run = solo(cold, prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(stop,)))
    assert run.output_ids == greedy[: first + 1] and run.finish_reason is FinishReason.STOP
    later = solo(
        cold, prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(stop,), min_tokens=8)
    )
    assert len(later.output_ids) > first + 1 or later.finish_reason is FinishReason.LENGTH
    assert stop not in later.output_ids[:7]
    engine = cold.create_engine()
    engine.eos_token_ids = (stop,)
    request_id = engine.add_request(EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=20)))
    assert engine.run()[request_id].output_ids == greedy[: first + 1]
    ignored = engine.add_request(
        EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    )
    assert engine.run()[ignored].output_ids == greedy


def test_abort_frees_the_slot_and_blocks_at_once(cached) -> None:
    engine = cached.create_engine()
    pool = engine.prefix_cache.pool
    request_id = engine.add_request(
        EngineRequest(tokens(300, 40), SamplingParams(temperature=0, max_tokens=50))
    )
    engine.step()
    assert any(pool.ref_count(b) for b in range(1, pool.num_blocks))
    final = engine.abort(request_id)
    assert final.finished and final.finish_reason is FinishReason.ABORT
    assert not any(pool.ref_count(b) for b in range(1, pool.num_blocks))
    assert not engine.has_unfinished() and engine.abort(request_id) is None


def test_a_reusable_prefix_is_checkpointed_where_the_next_turn_branches_off(cold, cached) -> None:
    """A chat's next turn shares its history, not its generation prompt: a 196-token prompt whose history
    is its first 190 tokens has its end checkpoint at 192, past the branch point, so a follow-up hits
    nothing unless the history was declared reusable (then the checkpoint at 128 serves it); warm tokens
    equal cold ones."""
    params = SamplingParams(temperature=0, max_tokens=4)
    engine = cached.create_engine()
    for seed, reusable_prefix, hit in ((21, None, 0), (31, 190, 128)):
        history = tokens(190, seed)
        first = engine.add_request(
            EngineRequest(history + tokens(6, seed + 1), params, reusable_prefix=reusable_prefix)
        )
        engine.run()
        follow_up = history + tokens(40, seed + 2)
        request_id = engine.add_request(EngineRequest(follow_up, params))
        done = engine.run()[request_id]
        assert done.cached_prompt_tokens == hit, (first, reusable_prefix)
        assert done.output_ids == solo(cold, follow_up, params).output_ids


@pytest.mark.parametrize("snapshots", [2, 1, 0])
def test_a_chunk_runs_past_the_checkpoints_its_call_snapshots(checkpoint, cold, snapshots: int) -> None:
    """A 200-token prompt whose history is its first 190 tokens wants checkpoints at 128 (the history) and
    192 (its end), inside one 256-token chunk: with the packed call snapshotting 2, 1 or 0 states it runs in
    1, 2 or 3 prefill calls, and stores both checkpoints. A follow-up of the history hits 128 and a repeat
    hits 192, with the cold run's greedy tokens and log-probabilities (within 1e-5)."""
    model = export_eager(
        checkpoint[0], prefix_caching=True, batch_size=2, sequence_length=512, prefill_chunk_size=256
    )
    engine = model.create_engine()
    assert engine.scheduler.prefill_snapshots == 2
    engine.scheduler.prefill_snapshots = snapshots
    backend = engine.runner.backend = CountingBackend(engine.runner.backend)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=0)
    history = tokens(190, 61)
    prompt = history + tokens(10, 62)
    engine.add_request(
        EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=1), reusable_prefix=190)
    )
    engine.run()
    assert backend.prefill_calls == 3 - snapshots
    assert engine.prefix_cache.stats()["checkpoints_stored"] == 2
    for again, hit in ((history + tokens(40, 63), 128), (prompt, 192)):
        request_id = engine.add_request(EngineRequest(again, params))
        warm = engine.run()[request_id]
        assert warm.cached_prompt_tokens == hit
        expected = solo(cold, again, params)
        assert warm.output_ids == expected.output_ids
        torch.testing.assert_close(
            torch.tensor(warm.output_logprobs), torch.tensor(expected.output_logprobs), atol=1e-5, rtol=0
        )


def test_a_next_turn_resumes_where_the_answer_ended(cold, cached) -> None:
    """A finished request leaves its last partial block and its state after its last fed token: a prompt
    continuing its tokens (a chat's next turn) computes only what is new, from a position inside a block,
    and gets its solo run's tokens and log-probabilities. The tail is used once: a retry of the turn
    resumes from the state staged at 128 while the first answer decoded."""
    engine = cached.create_engine()
    backend = engine.runner.backend = CountingBackend(engine.runner.backend)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0)
    prompt = tokens(100, 64)
    request_id = engine.add_request(EngineRequest(prompt, params))
    first = engine.run()[request_id]  # fed: 100 prompt + 29 output tokens
    turn = prompt + first.output_ids + tokens(20, 65)
    expected = solo(cold, turn, params)
    for hit in (129, 128):
        computed = backend.prefill_tokens
        request_id = engine.add_request(EngineRequest(turn, params))
        warm = engine.run()[request_id]
        assert warm.cached_prompt_tokens == hit
        assert backend.prefill_tokens - computed == len(turn) - hit
        assert warm.output_ids == expected.output_ids
        torch.testing.assert_close(
            torch.tensor(warm.output_logprobs), torch.tensor(expected.output_logprobs), atol=1e-5, rtol=0
        )
    stats = engine.prefix_cache.stats()
    assert stats["tail_hits"] == 1 and stats["tails_stored"] == 3


def test_a_preempted_request_leaves_no_tail(cold, cached) -> None:
    """A decode preempts a later request only when no block can be had: the victim's partial last block goes
    straight back to the pool (a tail would hold it and be evicted at once), so only the two requests that
    finish leave tails; the victim, resumed, gets its solo tokens."""
    engine = cached.create_engine(num_kv_blocks=3)  # two usable blocks of 64 positions
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [tokens(40, 90), tokens(30, 91)]
    ids = [engine.add_request(EngineRequest(prompt, params)) for prompt in prompts]
    outputs = engine.run()
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache"]["tails_stored"] == 2
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert outputs[request_id].output_ids == solo(cold, prompt, params).output_ids


class Lockstep:
    """A token chooser for a group of requests: it picks for all of them (the argmax) once each has the
    logits of its next token, as generate() does for its rows; `held` releases no pick until it is cleared."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.offers: dict[str, torch.Tensor] = {}
        self.held: set[str] = set()

    def choose(self, logits: dict[str, torch.Tensor]) -> dict[str, ChosenToken]:
        self.offers.update(logits)
        ready = [r for r in self.request_ids if r not in self.held]
        if not all(r in self.offers for r in ready):
            return {}
        return {r: ChosenToken(int(self.offers.pop(r).argmax())) for r in ready}


def test_a_request_whose_chooser_picks_its_tokens_waits_for_the_pick_while_the_others_go_on(cold) -> None:
    """generate()'s way through the engine: a chooser gets the logits of its requests' next tokens and picks
    for both once both have them; the engine computes nothing more for the one that waits, and the other
    requests keep decoding. Picking the argmax gives the engine's own greedy tokens, from the same logits."""
    params = SamplingParams(temperature=0, max_tokens=12)
    short, long = tokens(30, 50), tokens(150, 52)
    engine = cold.create_engine()
    other = engine.add_request(EngineRequest(tokens(30, 51), SamplingParams(temperature=0, max_tokens=40)))
    chooser = Lockstep()
    first = engine.add_request(EngineRequest(short, SamplingParams(max_tokens=12), chooser=chooser))
    second = engine.add_request(EngineRequest(long, SamplingParams(max_tokens=12), chooser=chooser))
    chooser.request_ids = [first, second]
    while first not in chooser.offers:
        engine.step()
    waiting, others = engine.request(first), len(engine.request(other).output_ids)
    assert waiting.num_computed == len(short) and not waiting.has_new_token
    while second not in chooser.offers and first in chooser.offers:
        engine.step()  # the second prompt is computed, the other request decodes, the first one waits
        assert waiting.num_computed == len(short) or second not in chooser.offers
    assert len(engine.request(other).output_ids) > others
    while len(engine.request(first).output_ids) < 12:
        engine.step()
    for request_id, prompt in ((first, short), (second, long)):
        request = engine.request(request_id)
        assert request.output_ids == solo(cold, prompt, params).output_ids
        assert request.finish_reason is None, "the caller, not the engine, ends its request"
        assert engine.abort(request_id).finish_reason is FinishReason.ABORT
    strays = Lockstep()
    stray = engine.add_request(EngineRequest(tokens(20, 53), SamplingParams(max_tokens=4), chooser=strays))
    strays.request_ids = [stray, other]  # not one of its requests
    strays.offers[other] = torch.zeros(VOCAB)
    with pytest.raises(RuntimeError, match=f"picked a token for request {other!r}"):
        engine.run()


def test_a_request_continues_a_computed_sequence(cold) -> None:
    """A continuation (generate() with past_key_values): a request brings the state of its first tokens,
    computed by an earlier request and kept in a transformers cache, computes only the new tokens, and gets
    the tokens of the whole sequence run from scratch."""
    params = SamplingParams(temperature=0, max_tokens=10)
    engine = cold.create_engine()
    chooser = Lockstep()
    first = engine.add_request(EngineRequest(tokens(100, 60), SamplingParams(max_tokens=6), chooser=chooser))
    chooser.request_ids = [first]
    while len(engine.request(first).output_ids) < 5:
        engine.step()
    chooser.held.add(first)
    engine.step()  # the fifth token is fed; no sixth is picked
    done = engine.request(first)
    sequence, computed = done.token_ids, done.num_computed
    assert computed == len(sequence) == 105
    nc = cold.neuron_config
    kept = Qwen36HybridCache(
        cold.model.config, nc.batch_size, nc.sequence_length, nc.kv_block_size, nc.torch_dtype
    )
    kept.record_row(3, sequence, engine.computed_sequence(first))
    engine.abort(first)
    follow_up = sequence + tokens(20, 61)
    brought = kept.computed_sequence(3)
    assert brought is not None and brought.num_computed == computed and brought.slot == 3
    short = dataclasses.replace(brought, block_ids=brought.block_ids[:-1])
    with pytest.raises(ValueError, match="cannot continue a computed sequence: 1 blocks for 105 tokens"):
        engine.add_request(EngineRequest(follow_up, params, computed=short))
    with pytest.raises(ValueError, match="prompt_logprobs asks for the computed tokens"):
        engine.add_request(EngineRequest(follow_up, SamplingParams(prompt_logprobs=1), computed=brought))
    with pytest.raises(ValueError, match="105 computed tokens of a 105-token prompt"):
        engine.add_request(EngineRequest(sequence, params, computed=brought))
    backend = engine.runner.backend = CountingBackend(engine.runner.backend)
    resumed = engine.add_request(EngineRequest(follow_up, params, computed=brought))
    run = engine.run()[resumed]
    assert backend.prefill_tokens == 20
    assert run.cached_prompt_tokens == computed
    assert run.output_ids == solo(cold, follow_up, params).output_ids


def test_a_request_waiting_for_its_chooser_is_not_preempted(cold) -> None:
    """Out of KV blocks, a decode preempts later requests, but not one whose chooser holds the logits of its
    next token: the decoding request yields instead, and the waiting one goes on once it gets its pick."""
    engine = cold.create_engine(num_kv_blocks=3)  # two usable blocks of 64 positions
    hog = engine.add_request(
        EngineRequest(tokens(40, 82), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    )
    chooser = Lockstep()
    picked = engine.add_request(EngineRequest(tokens(30, 83), SamplingParams(max_tokens=5), chooser=chooser))
    chooser.request_ids = [picked]
    chooser.held.add(picked)
    while picked not in chooser.offers:
        engine.step()
    hogging = engine.request(hog)
    while hogging.num_computed < 64:
        engine.step()  # the hog decodes until it needs a second block, which the pool does not have
    engine.step()
    request = engine.request(picked)
    assert not request.has_new_token and request.num_preemptions == 0 and picked in chooser.offers
    assert hogging.num_preemptions > 0
    engine.abort(hog)  # it would preempt itself forever: the waiting request holds the block it needs
    chooser.held.clear()
    trigger = engine.add_request(EngineRequest(tokens(5, 84), SamplingParams(max_tokens=1), chooser=chooser))
    chooser.request_ids.append(trigger)
    while len(request.output_ids) < 2:
        engine.step()  # the trigger's logits make the chooser pick for both
    assert request.output_ids[0] == int(
        solo(cold, tokens(30, 83), SamplingParams(temperature=0)).output_ids[0]
    )


def test_bad_requests_are_refused_and_nothing_is_queued(cold) -> None:
    engine = cold.create_engine()
    too_long = [1] * SETTINGS["sequence_length"]
    for prompt, message in (([], "empty prompt"), ([1, VOCAB], "not tokens"), (too_long, "sequence_length")):
        with pytest.raises(ValueError, match=message):
            engine.add_request(EngineRequest(prompt))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request(EngineRequest([1, 2], SamplingParams(stop=("x",))))
    with pytest.raises(ValueError, match="reusable_prefix=3 must be between 0 and the prompt's 2 tokens"):
        engine.add_request(EngineRequest([1, 2], reusable_prefix=3))
    assert not engine.has_unfinished()
    for bad, message in (
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(logprobs=21), "logprobs"),
    ):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)


def test_text_deltas_and_stop_strings(checkpoint) -> None:
    tokenizer = load_qwen36_tokenizer()
    model = export_eager(checkpoint[0], **SETTINGS)
    engine = model.create_engine(tokenizer=tokenizer)
    prompt = tokens(20, 60)
    request_id = engine.add_request(EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=24)))
    request = engine.request(request_id)
    text = ""
    while engine.has_unfinished():
        text += "".join(o.text_delta for o in engine.step())
    full = tokenizer.decode(request.output_ids, skip_special_tokens=True)
    assert text == full
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    request_id = engine.add_request(
        EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=24, stop=(stop,)))
    )
    text = ""
    while engine.has_unfinished():
        for output in engine.step():
            text += output.text_delta
            if output.finished:
                assert output.finish_reason is FinishReason.STOP
    assert text == full[: full.index(stop)]


def test_incremental_detokenizer_never_splits_a_character() -> None:
    tokenizer = load_qwen36_tokenizer()
    text = "Gated DeltaNet 门控 🚀 naïve café — 日本語のテキスト"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([t]) for t in ids]
    assert "".join(deltas) + detokenizer.flush() == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    held = IncrementalDetokenizer(tokenizer, stop=("テキ",))
    out = "".join(held.add([t]) for t in ids)
    assert out == text[: text.index("テキ")] and held.stopped_on == "テキ"


def _rows(params: SamplingParams, batch: int, history: list[int]) -> list[SamplingRow]:
    return [SamplingRow(params, history, history[2:], (0,), request_generator(0)) for _ in range(batch)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=12),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.05),
        SamplingParams(temperature=0.5, top_k=30, top_p=0.9, min_p=0.02),
    ],
)
def test_filters_match_transformers_warpers(params: SamplingParams) -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    ours = filter_logits(logits, _rows(params, 3, [1]))
    theirs = TemperatureLogitsWarper(params.temperature)(None, logits)
    for warper in (
        TopKLogitsWarper(params.top_k) if params.top_k else None,
        TopPLogitsWarper(params.top_p) if params.top_p < 1 else None,
        MinPLogitsWarper(params.min_p) if params.min_p else None,
    ):
        if warper is not None:
            theirs = warper(None, theirs)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = ~torch.isinf(theirs)
    torch.testing.assert_close(ours[finite], theirs[finite])


def test_penalties_match_transformers_and_openai() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    history = [5, 9, 9, 17, 5, 5, 33]  # prompt 5, 9; output 9, 17, 5, 5, 33
    rows = [
        SamplingRow(
            SamplingParams(repetition_penalty=1.3), history[:2], history[2:], (), request_generator(0)
        )
    ]
    ours = apply_penalties(logits[:1], rows)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), logits[:1].clone())
    torch.testing.assert_close(ours, theirs)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    ours = apply_penalties(
        logits[1:], [SamplingRow(params, history[:2], history[2:], (), request_generator(0))]
    )
    expected = logits[1:].clone()
    for token in set(history[2:]):
        expected[0, token] -= 0.5 + 0.25 * history[2:].count(token)
    torch.testing.assert_close(ours, expected)


def test_logit_bias_adds_to_the_named_tokens_of_its_row_only() -> None:
    from optimum_qwen36.engine.sampling import sample

    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    bias = {3: 100.0, 7: -100.0, 11: 0.5}
    rows = [
        SamplingRow(SamplingParams(temperature=0, logit_bias=bias), [1], [], (), request_generator(0)),
        SamplingRow(SamplingParams(temperature=0), [1], [], (), request_generator(0)),
    ]
    before = logits.clone()
    ours = apply_penalties(logits, rows)
    expected = logits.clone()
    for token, value in bias.items():
        expected[0, token] += value
    torch.testing.assert_close(ours, expected)
    assert torch.equal(logits, before)  # the step's logits are never modified
    # rows with nothing to apply get the step's logits themselves back, not a copy
    assert apply_penalties(logits, [rows[1], rows[1]]) is logits
    # OpenAI's rule: +100 all but forces a token; the returned log-probability stays the model's own.
    picked = sample(logits, rows)
    assert picked.tokens.tolist() == [3, int(logits[1].argmax())]
    assert float(picked.logprobs[0]) == pytest.approx(float(logits[0].log_softmax(-1)[3]))


class OnlyTokens:
    """A constraint allowing a fixed set of tokens: the reference a +100 logit bias must agree with."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.allowed] = True
        return mask

    def accept(self, token_id: int) -> None:
        assert token_id in self.allowed


def test_logit_bias_in_the_engine_steers_greedy_decoding(cold) -> None:
    prompt, allowed = tokens(20, 90), [17, 250, 301, 444]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    biased = solo(cold, prompt, dataclasses.replace(params, logit_bias=dict.fromkeys(allowed, 100.0)))
    engine = cold.create_engine()
    request_id = engine.add_request(EngineRequest(prompt, params, constraint=OnlyTokens(allowed)))
    assert biased.output_ids == engine.run()[request_id].output_ids
    plain = solo(cold, prompt, params).output_ids
    banned = solo(cold, prompt, dataclasses.replace(params, logit_bias={plain[0]: -100.0})).output_ids
    assert banned[0] != plain[0]


@pytest.mark.parametrize("bias", [{3: 101.0}, {-1: 1.0}])
def test_logit_bias_out_of_range_is_refused(bias: dict[int, float]) -> None:
    with pytest.raises(ValueError, match="logit_bias maps token ids"):
        SamplingParams(logit_bias=bias)


def test_a_seeded_row_draws_the_same_tokens_whatever_shares_the_step() -> None:
    from optimum_qwen36.engine.sampling import sample

    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=7)

    def seeded() -> SamplingRow:
        return SamplingRow(params, [1], [], (), request_generator(7))

    def unseeded() -> SamplingRow:
        return SamplingRow(SamplingParams(temperature=1.0), [1], [], (), request_generator(None))

    alone = int(sample(logits[:1], [seeded()]).tokens[0])
    assert int(sample(logits, [seeded(), unseeded(), unseeded(), unseeded()]).tokens[0]) == alone
    # On another row of the step, with the same logits: the same token.
    assert int(sample(logits[[1, 0]], [unseeded(), seeded()]).tokens[1]) == alone


def test_the_loop_thread_serves_submissions_from_several_threads(cold) -> None:
    prompts = [tokens(n, 70 + n) for n in (5, 90, 33)]
    params = SamplingParams(temperature=0, max_tokens=12)
    streams: dict[int, Any] = {}
    with EngineLoop(cold.create_engine()) as loop:
        threads = [
            threading.Thread(
                target=lambda i=i: streams.__setitem__(i, loop.submit(EngineRequest(prompts[i], params)))
            )
            for i in range(len(prompts))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with pytest.raises(ValueError, match="not tokens"):
            loop.submit(EngineRequest([VOCAB], params))
        with pytest.raises(ValueError, match="logit_bias token ids"):
            loop.submit(EngineRequest([1], SamplingParams(logit_bias={VOCAB: 1.0})))
        outputs = {i: list(stream) for i, stream in streams.items()}
        for i, prompt in enumerate(prompts):
            tokens_streamed = [t for output in outputs[i] for t in output.new_token_ids]
            assert tokens_streamed == solo(cold, prompt, params).output_ids
            assert outputs[i][-1].finished and outputs[i][-1].finish_reason is FinishReason.LENGTH
        assert loop.call(lambda engine: engine.stats())["finished"] == 3


def test_a_failing_step_ends_the_requests_in_flight_and_the_loop_goes_on(cold) -> None:
    engine = cold.create_engine()
    backend = engine.runner.backend

    class Failing:
        def __getattr__(self, name: str) -> Any:
            return getattr(backend, name)

        def prefill_chunk(self, *args: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("device lost")

    engine.runner.backend = Failing()
    with EngineLoop(engine) as loop:
        stream = loop.submit(EngineRequest(tokens(10, 80), SamplingParams(temperature=0, max_tokens=4)))
        with pytest.raises(RuntimeError, match="device lost"):
            list(stream)
        engine.runner.backend = backend
        again = list(loop.submit(EngineRequest(tokens(10, 80), SamplingParams(temperature=0, max_tokens=4))))
        assert again[-1].finished and len(again) == 4
    with pytest.raises(EngineDeadError):
        loop.submit(EngineRequest([1], SamplingParams()))


def test_async_generate_streams_and_aborts_when_left_early(cached) -> None:
    engine = cached.create_engine()
    params = SamplingParams(temperature=0, max_tokens=20)
    prompt = tokens(100, 90)

    async def main() -> tuple[list[int], int]:
        async_engine = AsyncEngine(engine)
        try:

            async def whole() -> list[int]:
                return [
                    t
                    async for output in async_engine.generate(EngineRequest(prompt, params))
                    for t in output.new_token_ids
                ]

            async def three() -> int:
                received = 0
                async for _ in async_engine.generate(EngineRequest(tokens(300, 91), params)):
                    received += 1
                    if received == 3:
                        break  # leaving the iterator aborts the request
                return received

            full, left = await asyncio.gather(whole(), three())
            with pytest.raises(ValueError, match="empty prompt"):
                async for _ in async_engine.generate(EngineRequest([], params)):
                    pass
            stats = await async_engine.stats()
            assert stats["aborted"] == 1 and stats["running"] == 0, stats
            return full, left
        finally:
            async_engine.shutdown()

    full, left = asyncio.run(main())
    assert left == 3
    assert full == solo(cached, prompt, params).output_ids
    pool = engine.prefix_cache.pool
    assert not any(pool.ref_count(b) for b in range(1, pool.num_blocks))


def test_a_request_the_pool_cannot_hold_is_refused_not_left_waiting(cold) -> None:
    engine = cold.create_engine(num_kv_blocks=9)  # 8 usable blocks of 64 tokens
    with pytest.raises(ValueError, match="num_kv_blocks"):
        engine.add_request(EngineRequest(tokens(600, 100), SamplingParams(max_tokens=10)))
    with pytest.raises(ValueError, match="lower max_tokens"):
        engine.add_request(EngineRequest(tokens(10, 100), SamplingParams(max_tokens=None)))
    assert not engine.has_unfinished()


def test_a_failed_admission_evicts_nothing_from_the_prefix_cache(checkpoint) -> None:
    """A request whose first chunk's blocks cannot be had waits, and the cached prefixes stay: it must not
    evict them for an admission that fails anyway."""
    model = export_eager(
        checkpoint[0], prefix_caching=True, batch_size=2, sequence_length=1024, prefill_chunk_size=256
    )
    engine = model.create_engine(num_kv_blocks=13)  # 12 usable blocks of 64; a first chunk needs 4
    greedy = dict(temperature=0, max_tokens=2)
    engine.add_request(EngineRequest(tokens(394, 110), SamplingParams(**greedy)))
    engine.run()  # 6 blocks cached
    long = engine.request(
        engine.add_request(EngineRequest(tokens(520, 111), SamplingParams(temperature=0, max_tokens=100)))
    )
    while long.num_computed < 520:
        engine.step()
    # The long request holds 9 blocks: 3 cached ones are left, the new prompt's first chunk needs 4.
    assert engine.prefix_cache.available_blocks() == 3
    before = engine.prefix_cache.stats()
    waiting = engine.request(engine.add_request(EngineRequest(tokens(300, 112), SamplingParams(**greedy))))
    engine.step()
    after = engine.prefix_cache.stats()
    assert waiting.state.value == "waiting"
    assert (after["blocks_evicted"], after["cached_blocks"]) == (
        before["blocks_evicted"],
        before["cached_blocks"],
    )
    engine.run()
    assert waiting.finish_reason is FinishReason.LENGTH and len(waiting.output_ids) == 2


def test_stop_strings_wait_for_min_tokens(checkpoint) -> None:
    """A stop string completed before min_tokens tokens exist does not end the request (vLLM's rule)."""
    tokenizer = load_qwen36_tokenizer()
    model = export_eager(checkpoint[0], **SETTINGS)
    prompt = tokens(20, 60)
    full = solo(model, prompt, SamplingParams(temperature=0, max_tokens=24)).output_ids
    early = tokenizer.decode(full[:6], skip_special_tokens=True)
    stop = early[:2]
    assert len(stop) == 2, early
    engine = model.create_engine(tokenizer=tokenizer)
    params = SamplingParams(temperature=0, max_tokens=24, stop=(stop,), min_tokens=6)
    request = engine.request(engine.add_request(EngineRequest(prompt, params)))
    text = ""
    while engine.has_unfinished():
        text += "".join(o.text_delta for o in engine.step())
    assert len(request.output_ids) > 6 and text.startswith(early)
    request = engine.request(
        engine.add_request(EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=24, stop=(stop,))))
    )
    engine.run()
    assert len(request.output_ids) <= 2 and request.finish_reason is FinishReason.STOP


def test_the_loop_survives_a_reader_that_fails_and_a_submit_after_shutdown_raises(cold) -> None:
    params = SamplingParams(temperature=0, max_tokens=30)
    loop = EngineLoop(cold.create_engine())
    failures = []

    def broken(item: Any) -> None:
        failures.append(item)
        raise RuntimeError("reader gone")

    rid = loop.add(EngineRequest(tokens(10, 120), params), broken).result()
    survivor = list(loop.submit(EngineRequest(tokens(12, 121), SamplingParams(temperature=0, max_tokens=5))))
    assert survivor[-1].finished
    stats = loop.call(lambda engine: engine.stats())
    assert len(failures) == 1 and stats["aborted"] == 1 and stats["running"] == 0, (rid, stats)
    loop.shutdown()
    with pytest.raises(EngineDeadError):
        loop.submit(EngineRequest([1], params))
