"""Unit tests of the prefix cache manager, with a fake model whose state is a pure function of the prefix.

The fake "state after tokens t[0:p]" is derived from a hash of t[0:p], so a restored checkpoint is
correct exactly when it equals the fake state of the prefix it claims to summarise.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch

from optimum_qwen36.prefix_caching import (
    BlockPool,
    BlocksRemoved,
    BlocksStored,
    CachedSequence,
    GDNCheckpoint,
    GDNStateSpec,
    PrefixCache,
    PrefixCacheConfig,
    block_key,
    chain_keys,
    layer_checksums,
    root_key,
)

SPEC = GDNStateSpec(num_layers=3, conv_shape=(6, 3), conv_dtype=torch.bfloat16, recurrent_shape=(2, 4, 4))
BS = 64
KV_BYTES = 1000  # per block, arbitrary


def fake_state(prefix: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    seed = int.from_bytes(hashlib.sha256(str(prefix).encode()).digest()[:7], "little")
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn((SPEC.num_layers, *SPEC.conv_shape), generator=gen).to(SPEC.conv_dtype)
    rec = torch.randn((SPEC.num_layers, *SPEC.recurrent_shape), generator=gen)
    return conv, rec


def make_cache(budget: int = 10**9, num_blocks: int = 256, **kw) -> PrefixCache:
    cfg = PrefixCacheConfig(budget_bytes=budget, identity="test-model", **kw)
    return PrefixCache(cfg, num_blocks=num_blocks, kv_bytes_per_block=KV_BYTES, state_spec=SPEC)


def run(
    cache: PrefixCache, tokens: list[int], generated: list[int] = (), chunk: int = 128, check: bool = True
) -> CachedSequence:
    """Emulate generate() for one row: lookup, restore, chunked prefill with snapshots, decode, finish."""
    seq = cache.begin(tokens)
    hit, n = seq.cached_tokens, len(tokens)
    assert 0 <= hit < n and len(seq.block_ids) == -(-hit // BS)
    if hit:
        conv = torch.empty((SPEC.num_layers, *SPEC.conv_shape), dtype=SPEC.conv_dtype)
        rec = torch.empty((SPEC.num_layers, *SPEC.recurrent_shape))
        cache.restore(seq, conv, rec)
        want = fake_state(tokens[:hit])
        assert torch.equal(conv, want[0]) and torch.equal(rec, want[1]), "restored a wrong state"
    else:
        assert seq.checkpoint is None
    cache.ensure_blocks(seq, n)
    # Chunk ends: every snapshot position, and at most `chunk` tokens apart (as the engine's scheduler).
    ends, position = [], hit
    for stop in [*sorted(p for p in seq.snapshot_positions if hit < p < n), n]:
        while position < stop:
            position = min(position + chunk, stop)
            ends.append(position)
    for end in ends:
        cache.commit(seq, end)
        if end in seq.snapshot_positions:
            cache.store_checkpoint(seq, end, *fake_state(tokens[:end]))
    computed = n
    if cache.decode_snapshot_due(seq, computed):
        cache.stage_checkpoint(seq, computed, *fake_state(seq.token_ids[:computed]))
    for i, tok in enumerate(generated):
        seq.append_tokens([tok])
        if i == len(generated) - 1:
            break  # the last generated token is never fed to the model
        cache.ensure_blocks(seq, computed + 1)
        computed += 1
        cache.commit(seq, computed)
        if cache.decode_snapshot_due(seq, computed):
            cache.stage_checkpoint(seq, computed, *fake_state(seq.token_ids[:computed]))
    cache.finish(seq, computed, fake_state(seq.token_ids[:computed]))
    if check:
        check_invariants(cache)
    return seq


def check_invariants(cache: PrefixCache, idle: bool = False) -> None:
    nodes = cache._nodes
    children: dict[bytes, int] = dict.fromkeys(nodes, 0)
    ckpt_bytes = 0
    for key, node in nodes.items():
        assert node.key == key and cache._node_of_block[node.block] is node
        if node.parent is not None:
            assert nodes.get(node.parent.key) is node.parent, "orphan block: its prefix was evicted"
            children[node.parent.key] += 1
        else:
            assert node.depth == 1
        if node.checkpoint is not None:
            assert node.checkpoint.position == node.depth * BS and node.checkpoint.key == key
            ckpt_bytes += node.checkpoint.nbytes
    assert all(nodes[k].children == c for k, c in children.items())
    tail_bytes = 0
    assert sum(len(below) for below in cache._tails_below.values()) == len(cache._tails)
    for key, tail in cache._tails.items():
        assert tail.key == key and tail in cache._tails_below[tail.parent]
        assert tail.parent == cache._root or tail.parent in nodes, "orphan tail"
        assert cache.pool.ref_count(tail.block) == 0 and tail.block not in cache._node_of_block
        assert 0 < len(tail.tokens) < BS and tail.checkpoint.position % BS == len(tail.tokens)
        tail_bytes += tail.nbytes
    stats = cache.stats()
    assert stats["kv_bytes"] == len(nodes) * KV_BYTES
    assert stats["checkpoint_bytes"] == ckpt_bytes
    assert stats["tail_bytes"] == tail_bytes
    assert stats["bytes_used"] <= cache.config.budget_bytes
    held = {b for b in range(1, cache.pool.num_blocks) if not cache.pool._is_free[b]}
    cached = set(cache._node_of_block) | {t.block for t in cache._tails.values()}
    assert cached == held if idle else cached <= held  # idle: no sequence holds a block of its own
    assert len(held) + cache.pool.num_free == cache.pool.num_blocks - 1


def toks(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


# ---------------------------------------------------------------- building blocks
def test_hashes_are_stable_chained_and_salted():
    a = toks(200)
    root = root_key("m")
    keys = chain_keys(root, a, BS)
    assert len(keys) == 3  # the partial block has no key
    assert keys == chain_keys(root_key("m"), a, BS)
    assert keys[1] == block_key(keys[0], a[64:128])
    assert chain_keys(root_key("other model"), a, BS)[0] != keys[0]
    b = [a[0] + 1, *a[1:]]  # a change in block 0 changes every later key
    assert all(x != y for x, y in zip(chain_keys(root, b, BS), keys, strict=True))
    # Fixed value: the hash must not depend on the process (Python's hash() would).
    assert root_key("").hex() == root_key("").hex() and len(root_key("")) == 16


def test_block_pool_refcounts_and_errors():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {1, 2} and pool.allocate() is None
    pool.incref(a)
    assert pool.decref(a) == 1 and pool.decref(a) == 0
    with pytest.raises(RuntimeError, match="released more times"):
        pool.decref(a)
    with pytest.raises(RuntimeError, match="still use it"):
        pool.free(b)
    pool.free(a)
    with pytest.raises(RuntimeError, match="is free"):
        pool.free(a)
    with pytest.raises(ValueError, match="outside the pool"):
        pool.incref(0)
    with pytest.raises(ValueError, match="null block"):
        BlockPool(1)


def test_config_validation():
    with pytest.raises(ValueError, match="granularity"):
        PrefixCacheConfig(budget_bytes=1, granularity=96)
    with pytest.raises(ValueError, match="checkpoint_interval"):
        PrefixCacheConfig(budget_bytes=1, granularity=128, checkpoint_interval=192)
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCacheConfig(budget_bytes=-1)
    PrefixCacheConfig(budget_bytes=1, granularity=128, checkpoint_interval=0)


def test_checkpoint_validation_catches_corruption():
    conv, rec = fake_state([1, 2, 3])
    ck = GDNCheckpoint.capture(b"k", 64, conv, rec)
    assert ck.validate(SPEC, b"k", 64) is None
    assert ck.nbytes == SPEC.nbytes
    assert "key" in ck.validate(SPEC, b"x", 64)
    assert "position" in ck.validate(SPEC, b"k", 128)
    ck.recurrent[1].zero_()
    assert "layer(s) [1]" in ck.validate(SPEC, b"k", 64)
    ck = GDNCheckpoint.capture(b"k", 64, conv, rec)
    ck.conv[2, 0, 0] += 1
    assert "layer(s) [2]" in ck.validate(SPEC, b"k", 64)
    ck = GDNCheckpoint.capture(b"k", 64, conv[:2], rec[:2])  # a layer missing
    assert "shape" in ck.validate(SPEC, b"k", 64)
    ck = GDNCheckpoint.capture(b"k", 64, conv, rec.to(torch.bfloat16))  # fp32 state is required
    assert "dtype" in ck.validate(SPEC, b"k", 64)
    # Checksums are exact integer sums: independent of the reduction order.
    assert torch.equal(layer_checksums(rec), layer_checksums(rec.clone()))


@pytest.mark.parametrize(
    ("shape", "dtype", "word_bytes"),
    [((3, 4, 8, 8), torch.float32, 8), ((3, 6, 3), torch.bfloat16, 4), ((3, 5, 3), torch.bfloat16, 2)],
)
def test_layer_checksums_are_wrapping_sums_of_each_layers_widest_words(shape, dtype, word_bytes):
    state = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 1e4).to(dtype)
    words = state.reshape(shape[0], -1).view(torch.uint8).numpy().view(f"<u{word_bytes}")
    modulus = 2 ** (8 * word_bytes)
    expected = [int(layer) % modulus for layer in words.astype(np.uint64).sum(axis=1)]  # numpy: independent
    assert [int(checksum) % modulus for checksum in layer_checksums(state)] == expected
    for layer in range(shape[0]):  # any one changed element shows in its layer's sum only
        changed = state.clone()
        changed[layer].view(-1)[-1] = changed[layer].view(-1)[-1] * 2 + 1
        assert (layer_checksums(changed) != layer_checksums(state)).nonzero().flatten().tolist() == [layer]


# ---------------------------------------------------------------- lookup policy
def test_repeat_hits_and_prompts_shorter_than_a_block():
    cache = make_cache()
    assert run(cache, toks(40)).cached_tokens == 0
    assert run(cache, toks(40)).cached_tokens == 0  # nothing aligned below 40 tokens
    p = toks(300, seed=1)
    assert run(cache, p).cached_tokens == 0
    seq = run(cache, p)
    assert seq.cached_tokens == 256 and seq.snapshot_positions == []
    s = cache.stats()
    assert s["lookups"] == 4 and s["hit_tokens"] == 256 and s["prompt_tokens"] == 680 and s["hits"] == 1


@pytest.mark.parametrize("n", [64, 128, 256])
def test_exact_multiples_of_the_block_hit(n):
    cache = make_cache()
    p = toks(n, seed=n)
    run(cache, p)
    assert run(cache, p).cached_tokens == n - 64  # the last token is always recomputed


def test_partial_prefix_ending_inside_a_block_and_siblings():
    cache = make_cache(checkpoint_interval=0)
    base = toks(150, seed=2)
    a = [*base, *toks(60, seed=3)]
    assert run(cache, a).cached_tokens == 0
    b = [*base, *toks(70, seed=4)]  # diverges inside block 2 (tokens 128..191)
    seq_b = run(cache, b)
    assert seq_b.cached_tokens == 0 and 128 in seq_b.snapshot_positions  # the branch point
    c = [*base, *toks(80, seed=5)]
    assert run(cache, c).cached_tokens == 128  # later siblings hit the branch point
    # A shorter prompt ending inside block 1: no checkpoint at 64 yet, so it is cold and takes one.
    assert run(cache, base[:100]).cached_tokens == 0
    assert run(cache, base[:100]).cached_tokens == 64


def test_prefix_shorter_than_cached_prompt_uses_interval_checkpoints():
    cache = make_cache(checkpoint_interval=256)
    long = toks(1000, seed=6)
    seq = run(cache, long)
    assert seq.snapshot_positions == [256, 512, 768, 960]
    assert run(cache, [*long[:600], 7, 7, 7]).cached_tokens == 512


def test_multi_turn_reuses_the_generated_answer():
    cache = make_cache(checkpoint_interval=0)
    prompt = toks(100, seed=7)
    answer = toks(90, seed=8)
    run(cache, prompt, generated=answer)
    # Tokens fed: 100 prompt + 89 answer = 189. The finished sequence leaves its tail (tokens 128..188 in
    # their block, the state at 189), and the state staged at 128 is stored at finish.
    assert cache.stats()["tails"] == 1
    nxt = [*prompt, *answer, *toks(30, seed=9)]
    seq = run(cache, nxt)  # checks that the state restored is the one after 189 tokens
    assert seq.cached_tokens == 189 and cache.stats()["tail_hits"] == 1
    # The tail went to that sequence (it wrote its next tokens into the block): a retry of the same turn
    # resumes from the checkpoint at its prompt's end, a branch inside the answer from the staged state.
    assert cache.stats()["tails"] == 0
    assert run(cache, nxt).cached_tokens == 192
    assert run(cache, [*prompt, *answer[:50], *toks(30, seed=11)]).cached_tokens == 128
    # An exact-multiple prompt: the state right after its prefill (position 128) is staged too.
    cache2 = make_cache(checkpoint_interval=0)
    prompt2 = toks(128, seed=10)
    run(cache2, prompt2, generated=[5, 6])
    assert run(cache2, [*prompt2, 4, 6, 1]).cached_tokens == 128
    run(cache2, prompt2, generated=[5, 6])
    assert run(cache2, [*prompt2, 5, 6, 1]).cached_tokens == 129


def test_tails_only_of_decoded_sequences_ending_inside_a_block():
    cache = make_cache(checkpoint_interval=0)
    prompt = toks(100, seed=12)
    run(cache, prompt, generated=[1])  # nothing fed past the prompt: its checkpoints are the chunked ones
    run(cache, toks(100, seed=13), generated=toks(29, seed=14))  # 128 fed: ends on a block boundary
    assert cache.stats()["tails"] == 0
    seq = cache.begin(toks(70, seed=15))
    cache.ensure_blocks(seq, 71)
    seq.append_tokens([3, 4])
    cache.commit(seq, 71)
    cache.finish(seq, None, fake_state(seq.token_ids[:71]))  # nothing is cached after an error
    assert cache.stats()["tails"] == 0
    check_invariants(cache)
    off = PrefixCache(
        PrefixCacheConfig(budget_bytes=0, identity="test-model"),
        num_blocks=16,
        kv_bytes_per_block=KV_BYTES,
        state_spec=SPEC,
    )
    run(off, prompt, generated=toks(10, seed=16))
    assert off.stats()["tails"] == 0 and off.pool.num_free == 15


def test_tails_are_evicted_lru_before_their_prefix_and_give_their_blocks_under_pressure():
    # Each conversation caches a block, a checkpoint at 64 and a tail: the budget misses one state for two.
    cache = make_cache(budget=4 * KV_BYTES + 4 * SPEC.nbytes - 1, checkpoint_interval=0)
    a, b, answer = toks(100, seed=20), toks(100, seed=21), toks(20, seed=22)
    run(cache, a, generated=answer)
    run(cache, b, generated=toks(20, seed=23))
    # b's tail made room by evicting the least recently used: a's checkpoint at 64 (stored by a's prefill,
    # before a's tail); a's block stays below its tail.
    stats = cache.stats()
    assert stats["checkpoints_evicted"] == 1 and stats["tails"] == 2 and stats["blocks_evicted"] == 0
    assert run(cache, [*a, *answer, 5]).cached_tokens == 119
    # A pool short of free blocks takes the tails' blocks (the least recently used first).
    small = make_cache(num_blocks=6, checkpoint_interval=0)
    run(small, toks(100, seed=24), generated=toks(20, seed=25))  # 2 blocks: one node, one tail
    assert small.stats()["tails"] == 1 and small.pool.num_free == 3
    assert small.available_blocks() == 5
    seq = small.begin(toks(300, seed=26))
    small.ensure_blocks(seq, 300)  # 5 blocks: every free one, the node's and the tail's
    assert small.stats()["tails"] == 0 and small.stats()["tails_evicted"] == 1
    small.finish(seq, 300)
    check_invariants(small)


def test_a_tail_taken_by_a_sequence_that_never_starts_goes_back():
    """The scheduler looks a prompt up, then finds the pool short and finishes the sequence without computing
    anything: the tail it took is the cache's again (its block and state), for the retry."""
    cache = make_cache(checkpoint_interval=0)
    prompt, answer = toks(100, seed=40), toks(20, seed=41)
    run(cache, prompt, generated=answer)
    turn = [*prompt, *answer, *toks(10, seed=42)]
    seq = cache.begin(turn)
    assert seq.cached_tokens == 119 and cache.stats()["tails"] == 0
    cache.finish(seq, None)
    assert cache.stats()["tails"] == 1
    check_invariants(cache, idle=True)
    assert run(cache, turn).cached_tokens == 119


def test_conversations_branching_inside_one_block_keep_their_own_tails():
    """Chats after a shared 90-token system prompt (their turns all inside its second block) and chats shorter
    than a block (tails on the root) each continue from their own tail."""
    cache = make_cache(checkpoint_interval=0)
    system = toks(90, seed=50)
    chats = [[*system, *toks(5, seed=51 + i)] for i in range(3)] + [toks(8, seed=60 + i) for i in range(2)]
    answers = [toks(8, seed=70 + i) for i in range(len(chats))]
    for chat, answer in zip(chats, answers, strict=True):
        run(cache, chat, generated=answer)
    assert cache.stats()["tails"] == len(chats)
    for chat, answer in zip(chats, answers, strict=True):
        assert run(cache, [*chat, *answer, 1, 2]).cached_tokens == len(chat) + len(answer) - 1


def test_a_corrupted_tail_is_never_used():
    cache = make_cache(checkpoint_interval=0)
    prompt, answer = toks(100, seed=30), toks(40, seed=31)
    run(cache, prompt, generated=answer)
    (tail,) = cache._tails.values()
    tail.checkpoint.recurrent[1].zero_()
    seq = run(cache, [*prompt, *answer, 9])
    assert seq.cached_tokens == 128 and cache.stats()["checkpoints_invalid"] == 1  # the staged state
    assert cache.stats()["tails"] == 0


def test_restore_is_exact_over_random_workload():
    cache = make_cache(budget=40 * KV_BYTES + 3 * SPEC.nbytes, num_blocks=80, checkpoint_interval=128)
    rng = random.Random(0)
    stems = [toks(rng.randrange(50, 400), seed=100 + i) for i in range(4)]
    for _ in range(60):
        stem = rng.choice(stems)
        p = [
            *stem[: rng.randrange(1, len(stem) + 1)],
            *toks(rng.randrange(1, 100), seed=rng.randrange(10**6)),
        ]
        seq = run(
            cache,
            p,
            generated=toks(rng.randrange(0, 80), seed=rng.randrange(10**6)),
            chunk=rng.choice([64, 128, 512]),
        )
        if rng.random() < 0.5:  # the conversation goes on: its prompt and answer, then a new message
            stems.append([*seq.token_ids, *toks(rng.randrange(1, 40), seed=rng.randrange(10**6))])
    s = cache.stats()
    assert s["hits"] > 0 and s["blocks_evicted"] > 0 and s["checkpoints_evicted"] > 0
    assert s["tail_hits"] > 0 and s["tails_evicted"] > 0
    check_invariants(cache, idle=True)


# ---------------------------------------------------------------- sharing, memory, eviction
def test_blocks_are_shared_and_refcounted():
    cache = make_cache()
    p = toks(300, seed=11)
    first = run(cache, p)
    seq = cache.begin(p)
    assert seq.cached_tokens == 256
    assert seq.block_ids == first.block_ids[:4]  # the shared prefix blocks, not copies
    assert all(cache.pool.ref_count(b) == 1 for b in seq.block_ids)
    cache.finish(seq)
    assert all(cache.pool.ref_count(b) == 0 for b in first.block_ids[:4])
    assert cache.pool.num_free == cache.pool.num_blocks - 1 - cache.stats()["cached_blocks"]


def test_eviction_never_touches_in_flight_sequences():
    cache = make_cache(budget=8 * KV_BYTES + SPEC.nbytes, checkpoint_interval=0)
    p = toks(300, seed=12)
    run(cache, p)
    seq = cache.begin(p)  # holds 4 blocks and pins the checkpoint at 256
    assert seq.cached_tokens == 256
    for i in range(10):  # pressure: other prompts want the budget
        run(cache, toks(200, seed=200 + i))
    assert all(cache._node_of_block[b].key in cache._nodes for b in seq.block_ids)
    assert seq.checkpoint is not None and seq.checkpoint.pins == 1
    conv = torch.empty((SPEC.num_layers, *SPEC.conv_shape), dtype=SPEC.conv_dtype)
    rec = torch.empty((SPEC.num_layers, *SPEC.recurrent_shape))
    cache.restore(seq, conv, rec)
    assert torch.equal(rec, fake_state(p[:256])[1])
    cache.finish(seq)
    check_invariants(cache)
    run(cache, toks(200, seed=999))  # now the old prefix can go
    check_invariants(cache)


def test_budget_is_never_exceeded_and_checkpoints_die_with_their_prefix():
    budget = 12 * KV_BYTES + 2 * SPEC.nbytes
    cache = make_cache(budget=budget, checkpoint_interval=64)
    for i in range(30):
        run(cache, toks(320, seed=300 + i))
        assert cache.stats()["bytes_used"] <= budget
    s = cache.stats()
    assert s["blocks_evicted"] > 0 and s["checkpoints_evicted"] > 0 and s["checkpoints_skipped"] == 0
    # Every surviving checkpoint still has its whole KV prefix (check_invariants walks the parents).
    assert s["checkpoints"] > 0


def test_checkpoint_larger_than_budget_is_skipped():
    cache = make_cache(budget=3 * KV_BYTES + SPEC.nbytes - 1)
    p = toks(200, seed=13)
    run(cache, p)
    s = cache.stats()
    assert s["checkpoints"] == 0 and s["checkpoints_skipped"] >= 1 and s["cached_blocks"] == 3
    assert run(cache, p).cached_tokens == 0


def test_pool_pressure_evicts_cached_blocks_then_fails_clearly():
    cache = make_cache(num_blocks=6)  # 5 usable blocks
    run(cache, toks(300, seed=14))  # 5 blocks, 4 full ones cached
    run(cache, toks(300, seed=15))  # reuses them by evicting the old prefix
    assert cache.stats()["blocks_evicted"] == 4
    a = cache.begin(toks(300, seed=16))
    cache.ensure_blocks(a, 300)
    b = cache.begin(toks(10, seed=17))
    with pytest.raises(RuntimeError, match="pool exhausted"):
        cache.ensure_blocks(b, 10)
    cache.finish(a)
    cache.finish(b)
    check_invariants(cache)


def test_concurrent_duplicates_keep_their_own_blocks():
    cache = make_cache(checkpoint_interval=0)
    p = toks(260, seed=18)
    s1, s2 = cache.begin(p), cache.begin(p)  # both cold: nothing cached yet
    for s in (s1, s2):
        cache.ensure_blocks(s, 260)
    cache.commit(s1, 260)
    cache.commit(s2, 260)  # same keys: s2 keeps its private blocks and holds s1's
    assert set(s1.block_ids).isdisjoint(s2.block_ids)
    cache.finish(s1, 260)
    cache.clear()  # s1's blocks are still held by s2's chain
    assert cache.stats()["cached_blocks"] == 4
    assert cache.store_checkpoint(s2, 256, *fake_state(p[:256]))
    cache.finish(s2, 260)
    check_invariants(cache)
    assert run(cache, p).cached_tokens == 256
    cache.clear()
    assert cache.stats()["bytes_used"] == 0 and cache.pool.num_free == cache.pool.num_blocks - 1


def test_staged_state_beyond_the_computed_tokens_is_not_stored():
    cache = make_cache(checkpoint_interval=0)
    p = toks(64, seed=19)
    seq = cache.begin(p)
    cache.ensure_blocks(seq, 64)
    cache.stage_checkpoint(seq, 64, *fake_state(p))
    cache.finish(seq, 63)  # e.g. an error before the last chunk finished
    assert cache.stats()["checkpoints"] == 0


def test_bad_inputs_raise():
    cache = make_cache()
    with pytest.raises(ValueError, match="empty"):
        cache.begin([])
    seq = cache.begin(toks(100))
    cache.ensure_blocks(seq, 100)
    with pytest.raises(ValueError, match="multiple of 64"):
        cache.store_checkpoint(seq, 50, *fake_state([]))
    conv, rec = fake_state([])
    with pytest.raises(ValueError, match="state spec"):
        cache.store_checkpoint(seq, 64, conv, rec.to(torch.bfloat16))
    with pytest.raises(ValueError, match="exceeds"):
        cache.commit(seq, 101)
    with pytest.raises(RuntimeError, match="no checkpoint"):
        cache.restore(seq, conv, rec)
    cache.finish(seq)


# ---------------------------------------------------------------- fault injection
@pytest.mark.parametrize("fault", ["zero_layer", "wrong_position", "missing_layer", "flip_one_value"])
def test_corrupted_checkpoint_is_never_used(fault):
    cache = make_cache(checkpoint_interval=64)
    p = toks(300, seed=20)
    run(cache, p)
    node = cache._nodes[chain_keys(cache._root, p, BS)[3]]
    ck = node.checkpoint
    assert ck is not None and ck.position == 256
    if fault == "zero_layer":
        ck.recurrent[2].zero_()
    elif fault == "wrong_position":
        ck.position = 192
    elif fault == "missing_layer":
        ck.conv = ck.conv[:-1]
    else:
        ck.recurrent.view(-1)[7] = ck.recurrent.view(-1)[7].nextafter(torch.tensor(1e9))
    seq = run(cache, p)  # falls back to the next checkpoint down, which is sound
    assert seq.cached_tokens == 192
    s = cache.stats()
    assert s["checkpoints_invalid"] == 1
    assert run(cache, p).cached_tokens == 256  # the bad one was replaced by a fresh snapshot


# ---------------------------------------------------------------- events for routers
def announced_prefix(index: dict[int, tuple[int | None, tuple[int, ...]]], tokens: list[int]) -> int:
    """The longest prefix of `tokens` a router indexing the events sees stored: a chain of announced
    blocks from the start, each one's tokens matching (as vllm-router's index matches them)."""
    by_parent_and_tokens = {(parent, block): h for h, (parent, block) in index.items()}
    parent, length = None, 0
    while length + BS <= len(tokens):
        block = tuple(tokens[length : length + BS])
        h = by_parent_and_tokens.get((parent, block))
        if h is None:
            break
        parent, length = h, length + BS
    return length


def apply_events(cache: PrefixCache, index: dict[int, tuple[int | None, tuple[int, ...]]]) -> None:
    for event in cache.take_events():
        if isinstance(event, BlocksStored):
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                index[h] = (parent, event.token_ids[i * BS : (i + 1) * BS])
                parent = h
        else:
            assert isinstance(event, BlocksRemoved)
            for h in event.block_hashes:
                del index[h]


def test_events_announce_the_prefixes_a_checkpoint_makes_reusable():
    cache = make_cache(checkpoint_interval=0)
    assert cache.take_events() == []  # nothing recorded until asked
    cache.record_events()
    index: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    base = toks(150, seed=2)
    a = [*base, *toks(60, seed=3)]
    run(cache, a)
    (stored,) = cache._events
    assert isinstance(stored, BlocksStored) and stored.parent_block_hash is None
    assert stored.token_ids == tuple(a[:192]) and len(stored.block_hashes) == 3  # the checkpoint at 192
    apply_events(cache, index)
    # Prompts branching off: what a router reading the events sees stored is what the cache reuses.
    for seed in (4, 5, 6):
        prompt = [*base, *toks(70, seed=seed)]
        expected = announced_prefix(index, prompt)
        assert run(cache, prompt).cached_tokens in (expected, 0)  # the first sibling stores the branch point
        apply_events(cache, index)
    for seed in (7, 8):
        prompt = [*base, *toks(90, seed=seed)]
        assert announced_prefix(index, prompt) == 128 == run(cache, prompt).cached_tokens
        apply_events(cache, index)
    cache.clear()
    apply_events(cache, index)
    assert index == {}  # every announced block was announced removed
