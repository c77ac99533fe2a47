"""Hybrid prefix cache: shared attention KV blocks plus GDN state checkpoints, under one byte budget.

A reusable prefix of length p needs the attention KV of tokens 0..p *and* the conv + recurrent
state of every GDN layer at exactly p. Full KV blocks form a tree keyed by chained block hashes
(``hashing``); a checkpoint (``checkpoint``) hangs on the tree node whose block ends at p. Lookup
returns the longest p backed by both. Checkpoint positions are multiples of ``granularity``:

* the end of every prompt, rounded down so that a repeat of the same prompt still has a token
  to compute (``(L - 1) // g * g``: exact multiples of the block hit too);
* the point where a prompt branches off a cached path, so that its later siblings hit;
* every ``checkpoint_interval`` tokens inside long prompts;
* after generation (the last multiple reached while decoding), so that the next turn of a
  conversation reuses the answer;
* at the end of the prompt's ``reusable_prefix`` when its caller knows where later prompts will branch
  off (a chat's history without the generation prompt, which the next turn's template renders
  differently: the last multiple before the prompt's end may lie past that point).

A sequence that decoded also leaves a *tail* at finish: its partial last block (the KV of its tokens
past the last full block) and the GDN state after its last computed token, hung on the chain key of
the full blocks before it. A later prompt that continues those exact tokens (a chat's next turn)
takes the block over and restores the state, so it computes only what
is new. A tail is used once: the taker writes its next tokens into the block. Its state is the one
decoding reached, like the checkpoints staged while decoding (not a chunked prefill's rounding).

Eviction is LRU over unreferenced leaf blocks, unpinned checkpoints and tails: only leaves go (a tail
is a leaf below its block), so a checkpoint or tail never outlives its KV prefix, and blocks used by
in-flight sequences are never evicted. Nothing is registered or stored beyond the budget.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .block_pool import BlockPool
from .checkpoint import GDNCheckpoint, GDNStateSpec
from .config import KVBlocksExhausted, PrefixCacheConfig
from .events import BlocksRemoved, BlocksStored, PrefixCacheEvent, block_hash
from .hashing import block_key, chain_keys, root_key

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Node:
    """A full KV block registered in the cache; its tokens end at ``depth * block_size``."""

    key: bytes
    parent: _Node | None
    block: int
    depth: int
    tokens: tuple[int, ...]
    children: int = 0
    checkpoint: GDNCheckpoint | None = None
    last_used: int = 0
    announced: bool = False  # a BlocksStored event named it (recorded events only)


@dataclass(eq=False)
class _Tail:
    """A finished sequence's tokens past its last full block, the KV block holding them (held by the cache,
    referenced by no sequence) and the GDN state after them."""

    parent: bytes  # chain key of the full blocks before it (the root key when there are none)
    tokens: tuple[int, ...]
    block: int
    checkpoint: GDNCheckpoint  # keyed by block_key(parent, tokens), at the tail's end position
    nbytes: int  # the block's KV and the state, as the budget accounts for them
    last_used: int = 0

    @property
    def key(self) -> bytes:
        return self.checkpoint.key


@dataclass(eq=False)
class CachedSequence:
    """One sequence's view of the cache, from ``PrefixCache.begin`` to ``PrefixCache.finish``.

    ``block_ids`` is the row's block table (shared prefix blocks, then its own); every block in it
    holds one reference from this sequence. ``cached_tokens`` tokens are reused: restore
    ``checkpoint`` into the row's slot (``PrefixCache.restore``) and prefill from there, ending a
    chunk at every position of ``snapshot_positions`` to store the state there.
    """

    token_ids: list[int]
    prompt_len: int
    cached_tokens: int
    block_ids: list[int]
    checkpoint: GDNCheckpoint | None
    snapshot_positions: list[int]
    _keys: list[bytes] = field(default_factory=list)  # chain key of each full block of token_ids
    _committed: int = 0  # leading blocks present in the tree (shared, registered or duplicates)
    _extra_refs: list[int] = field(default_factory=list)  # cached twins of private blocks, kept alive
    _staged: GDNCheckpoint | None = None  # latest decode-time state, stored at finish
    _taken: _Tail | None = None  # the tail this sequence took over at lookup
    finished: bool = False

    def append_tokens(self, token_ids: Sequence[int]) -> None:
        """Record generated tokens (their KV/state become cacheable once computed)."""
        self.token_ids.extend(int(t) for t in token_ids)


class PrefixCache:
    """Prefix cache for one model: block pool, block tree, GDN checkpoints, LRU eviction, stats."""

    def __init__(
        self,
        config: PrefixCacheConfig,
        *,
        num_blocks: int,
        kv_bytes_per_block: int,
        state_spec: GDNStateSpec,
    ) -> None:
        self.config = config
        self.pool = BlockPool(num_blocks)
        # Without a byte budget nothing is cached: the pool only hands out blocks, and no state is copied.
        self.caching = config.budget_bytes > 0
        self.kv_bytes_per_block = kv_bytes_per_block
        self.state_spec = state_spec
        self._root = root_key(config.identity)
        self._nodes: dict[bytes, _Node] = {}
        self._node_of_block: dict[int, _Node] = {}
        # Lazy-deletion min-heaps of (last_used, key); an entry is live when the stamp still matches.
        self._node_heap: list[tuple[int, bytes]] = []
        self._ckpt_heap: list[tuple[int, bytes]] = []
        self._tails: dict[bytes, _Tail] = {}  # by their own key
        self._tails_below: dict[bytes, list[_Tail]] = {}  # by parent chain key
        self._tail_heap: list[tuple[int, bytes]] = []
        self._clock = itertools.count(1)
        self._kv_bytes = 0
        self._ckpt_bytes = 0
        self._tail_bytes = 0
        self._num_checkpoints = 0
        self._events: list[PrefixCacheEvent] | None = None  # recorded once record_events() is called
        self._counters = dict.fromkeys(
            (
                "lookups",
                "hits",
                "hit_tokens",
                "prompt_tokens",
                "checkpoints_stored",
                "checkpoints_evicted",
                "checkpoints_invalid",
                "checkpoints_skipped",
                "tails_stored",
                "tail_hits",
                "tails_evicted",
                "blocks_evicted",
            ),
            0,
        )

    # ------------------------------------------------------------------ lookup / lifecycle
    def begin(
        self, token_ids: Sequence[int], reuse: bool = True, reusable_prefix: int | None = None
    ) -> CachedSequence:
        """Look up a prompt and acquire its longest backed prefix (blocks referenced, checkpoint pinned).
        `reuse=False` (the prompt's log-probabilities are wanted): a miss, whatever is cached.
        `reusable_prefix`: the leading tokens later prompts are expected to share (checkpointed too)."""
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise ValueError("cannot look up an empty prompt")
        bs, g, n = self.config.block_size, self.config.granularity, len(tokens)
        keys = chain_keys(self._root, tokens, bs)
        path: list[_Node] = []  # cached nodes matching the prompt's leading blocks
        for key in keys:
            node = self._nodes.get(key)
            if node is None:
                break
            path.append(node)

        hit, checkpoint = 0, None
        # The last prompt token is always recomputed: its logits start generation.
        for depth in range(min(len(path), (n - 1) // bs) if reuse else 0, 0, -1):
            node = path[depth - 1]
            pos = depth * bs
            if pos % g or node.checkpoint is None:
                continue
            reason = node.checkpoint.validate(self.state_spec, node.key, pos)
            if reason is None:
                hit, checkpoint = pos, node.checkpoint
                break
            logger.warning("prefix cache: invalid GDN checkpoint at position %d not used: %s", pos, reason)
            self._counters["checkpoints_invalid"] += 1
            if node.checkpoint.pins == 0:  # else the next lookup after its release drops it
                self._drop_checkpoint(node)

        tail = self._tail_hit(tokens, path, hit) if reuse else None
        if tail is not None:  # the sequence takes the tail's block and state over
            self._remove_tail(tail)
            self._counters["tail_hits"] += 1
            self.pool.incref(tail.block)
            hit, checkpoint = tail.checkpoint.position, tail.checkpoint
        elif checkpoint is not None:
            checkpoint.pins += 1
            self._touch_checkpoint(checkpoint)
        shared = path[: hit // bs]
        for node in shared:
            self.pool.incref(node.block)
        self._touch_path(shared)

        end = (n - 1) // g * g
        branch = min(len(path) * bs, n - 1) // g * g
        stops = {end, branch}
        if reusable_prefix is not None:
            stops.add(min(reusable_prefix, n - 1) // g * g)
        if self.config.checkpoint_interval:
            stops.update(range(self.config.checkpoint_interval, end, self.config.checkpoint_interval))
        c = self._counters
        if reuse:  # a lookup that may not hit is no lookup for the hit rate
            c["lookups"] += 1
            c["prompt_tokens"] += n
            c["hit_tokens"] += hit
            c["hits"] += hit > 0
        return CachedSequence(
            token_ids=tokens,
            prompt_len=n,
            cached_tokens=hit,
            block_ids=[node.block for node in shared] + ([tail.block] if tail is not None else []),
            checkpoint=checkpoint,
            snapshot_positions=sorted(p for p in stops if p > hit) if self.caching else [],
            _keys=keys,
            _committed=len(shared),
            _taken=tail,
        )

    def begin_computed(self, token_ids: Sequence[int], num_computed: int) -> CachedSequence:
        """A sequence whose first ``num_computed`` tokens were computed elsewhere (their KV and GDN state are
        copied into its blocks and slot): nothing is looked up, and blocks for them are allocated; like any
        sequence, its blocks are registered as they fill (with caching on). Raises KVBlocksExhausted, keeping
        nothing, when the pool cannot hold them."""
        tokens = [int(t) for t in token_ids]
        if not 0 < num_computed < len(tokens):
            raise ValueError(f"a sequence of {len(tokens)} tokens cannot start after {num_computed} computed")
        seq = CachedSequence(
            token_ids=tokens,
            prompt_len=len(tokens),
            cached_tokens=num_computed,
            block_ids=[],
            checkpoint=None,
            snapshot_positions=[],
        )
        try:
            self.ensure_blocks(seq, num_computed)
        except KVBlocksExhausted:
            self.finish(seq, None)
            raise
        return seq

    def restore(self, seq: CachedSequence, conv_dst: torch.Tensor, recurrent_dst: torch.Tensor) -> None:
        """Copy the hit checkpoint into the row's slot: ``conv_state[:, s]``, ``recurrent_state[:, s]``."""
        if seq.checkpoint is None:
            raise RuntimeError(
                "this sequence has no checkpoint to restore (cold prefill or already restored)"
            )
        seq.checkpoint.restore_into(conv_dst, recurrent_dst)
        self._release_checkpoint(seq)

    def available_blocks(self) -> int:
        """Blocks a sequence could be given now: the free ones, the tails' and the cached ones no sequence
        uses (a sequence references every block of its path, so an unreferenced node's subtree is
        unreferenced too, and all of them can be evicted, leaves first)."""
        unused = sum(1 for node in self._nodes.values() if self.pool.ref_count(node.block) == 0)
        return self.pool.num_free + unused + len(self._tails)

    def ensure_blocks(self, seq: CachedSequence, num_tokens: int) -> list[int]:
        """Allocate own blocks so that the block table covers ``num_tokens`` positions; returns it. Raises
        KVBlocksExhausted when the pool runs out (the blocks allocated so far stay the sequence's)."""
        while len(seq.block_ids) * self.config.block_size < num_tokens:
            seq.block_ids.append(self._allocate_block())
        return seq.block_ids

    def commit(self, seq: CachedSequence, num_computed: int) -> None:
        """Register the full blocks among the first ``num_computed`` tokens, whose KV is now written."""
        bs = self.config.block_size
        if num_computed > len(seq.token_ids) or num_computed > len(seq.block_ids) * bs:
            raise ValueError(
                f"num_computed={num_computed} exceeds the sequence's {len(seq.token_ids)} tokens "
                f"or its {len(seq.block_ids)} blocks"
            )
        full = num_computed // bs
        while len(seq._keys) < full:  # generated tokens: extend the chain
            i = len(seq._keys)
            parent = seq._keys[-1] if seq._keys else self._root
            seq._keys.append(block_key(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        while seq._committed < full:
            i = seq._committed
            key = seq._keys[i]
            parent = self._nodes[seq._keys[i - 1]] if i else None  # alive: this sequence references it
            twin = self._nodes.get(key)
            if twin is not None:
                # Same tokens already cached (computed by someone else): keep our private copy for
                # this row (bitwise its own numbers) and hold the twin so our chain stays intact.
                self.pool.incref(twin.block)
                seq._extra_refs.append(twin.block)
                self._touch_path([twin])
            else:
                if not self._make_room(self.kv_bytes_per_block):
                    return  # over budget with nothing evictable: retry at the next commit
                node = _Node(
                    key, parent, seq.block_ids[i], i + 1, tuple(seq.token_ids[i * bs : (i + 1) * bs])
                )
                self._nodes[key] = node
                self._node_of_block[node.block] = node
                if parent is not None:
                    parent.children += 1
                self._kv_bytes += self.kv_bytes_per_block
                self._touch_path([node])
            seq._committed += 1

    def store_checkpoint(
        self, seq: CachedSequence, position: int, conv: torch.Tensor, recurrent: torch.Tensor
    ) -> bool:
        """Store the row's GDN state after exactly ``position`` tokens; False if it was not stored.

        Not stored when one already exists there, when the KV prefix could not be registered, or
        when it does not fit in the budget even after evicting everything unreferenced.
        """
        self._check_state(seq, position, conv, recurrent)
        node = self._checkpoint_holder(seq, position)
        if node is None:
            return False
        self._attach(node, GDNCheckpoint.capture(node.key, position, conv, recurrent))
        return True

    def decode_snapshot_due(self, seq: CachedSequence, num_computed: int) -> bool:
        """Whether the state after ``num_computed`` tokens (prompt + fed generated ones) should be staged."""
        return self.caching and num_computed >= seq.prompt_len and num_computed % self.config.granularity == 0

    def stage_checkpoint(
        self, seq: CachedSequence, position: int, conv: torch.Tensor, recurrent: torch.Tensor
    ) -> None:
        """Keep a copy of the decode-time state at ``position`` (replacing the previous one); ``finish``
        stores it if the sequence's tokens reach that far, so that a next turn reuses the answer."""
        self._check_state(seq, position, conv, recurrent)
        seq._staged = GDNCheckpoint.capture(b"", position, conv, recurrent)

    def finish(
        self,
        seq: CachedSequence,
        num_computed: int | None = None,
        end_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """End a sequence: register its computed blocks, store the staged state, release its references.

        ``num_computed``: how many of ``seq.token_ids`` have their KV and state computed
        (None: cache nothing more, e.g. after an error). ``end_state``: the row's conv and recurrent
        state after exactly those tokens; a sequence that decoded keeps it as a tail with its partial
        last block (nothing is kept when its tokens end on a block boundary).
        """
        if seq.finished:
            return
        if end_state is not None:  # before anything changes
            self._check_spec(*end_state)
        staged, seq._staged = seq._staged, None
        if num_computed is not None:
            self.commit(seq, num_computed)
            if staged is not None and staged.position <= num_computed:
                node = self._checkpoint_holder(seq, staged.position)
                if node is not None:
                    staged.key = node.key
                    self._attach(node, staged)
        tail_block = None
        if num_computed is not None and end_state is not None:
            tail_block = self._keep_tail(seq, num_computed, *end_state)
        if tail_block is None and seq._taken is not None and seq.checkpoint is seq._taken.checkpoint:
            tail_block = self._put_back(seq._taken)  # taken but never restored (e.g. its admission failed)
        if seq.checkpoint is not None:
            self._release_checkpoint(seq)
        for block in seq.block_ids + seq._extra_refs:
            if self.pool.decref(block) == 0 and block != tail_block:
                node = self._node_of_block.get(block)
                if node is None:
                    self.pool.free(block)  # private block (partial, duplicate or over budget)
                else:
                    self._push_node(node)
        seq.finished = True

    def clear(self) -> None:
        """Evict everything no in-flight sequence uses (e.g. to measure a cold run)."""
        while self._evict_one():
            pass

    # ------------------------------------------------------------------ observability
    def record_events(self) -> None:
        """From now on, record which reusable blocks are stored and removed (take_events() drains them)."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[PrefixCacheEvent]:
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, int | float]:
        c = dict(self._counters)
        c["hit_rate"] = c["hit_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
        c["checkpoints"] = self._num_checkpoints
        c["cached_blocks"] = len(self._nodes)
        c["free_blocks"] = self.pool.num_free
        c["kv_bytes"] = self._kv_bytes
        c["checkpoint_bytes"] = self._ckpt_bytes
        c["tails"] = len(self._tails)
        c["tail_bytes"] = self._tail_bytes
        c["bytes_used"] = self._kv_bytes + self._ckpt_bytes + self._tail_bytes
        c["budget_bytes"] = self.config.budget_bytes
        return c

    # ------------------------------------------------------------------ internals
    def _check_state(
        self, seq: CachedSequence, position: int, conv: torch.Tensor, recurrent: torch.Tensor
    ) -> None:
        g = self.config.granularity
        if position <= 0 or position % g or position > len(seq.token_ids):
            raise ValueError(
                f"checkpoint position must be a positive multiple of {g} within the sequence's "
                f"{len(seq.token_ids)} tokens, got {position}"
            )
        self._check_spec(conv, recurrent)

    def _check_spec(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        reason = self.state_spec.check(conv, recurrent)
        if reason is not None:
            raise ValueError(f"GDN state does not match the cache's state spec: {reason}")

    def _checkpoint_holder(self, seq: CachedSequence, position: int) -> _Node | None:
        """The node a new checkpoint at ``position`` would hang on, with room made for it; else None."""
        self.commit(seq, position)
        depth = position // self.config.block_size
        node = self._nodes.get(seq._keys[depth - 1]) if seq._committed >= depth else None
        if node is not None and node.checkpoint is not None:
            self._touch_checkpoint(node.checkpoint)
            return None
        if node is None or not self._make_room(self.state_spec.nbytes):
            self._counters["checkpoints_skipped"] += 1
            return None
        return node

    def _attach(self, node: _Node, ckpt: GDNCheckpoint) -> None:
        if self._events is not None:
            self._announce_path(node)
        node.checkpoint = ckpt
        self._ckpt_bytes += ckpt.nbytes
        self._num_checkpoints += 1
        self._counters["checkpoints_stored"] += 1
        self._touch_checkpoint(ckpt)

    def _announce_path(self, node: _Node) -> None:
        """A BlocksStored event for the blocks up to `node` not yet announced (now reusable up to it)."""
        path = []
        while node is not None and not node.announced:
            node.announced = True
            path.append(node)
            node = node.parent
        if path:
            path.reverse()
            self._events.append(
                BlocksStored(
                    tuple(block_hash(n.key) for n in path),
                    None if node is None else block_hash(node.key),
                    tuple(t for n in path for t in n.tokens),
                )
            )

    def _keep_tail(
        self, seq: CachedSequence, num_computed: int, conv: torch.Tensor, recurrent: torch.Tensor
    ) -> int | None:
        """Keep the finished sequence's partial last block and end state as a tail; returns the block kept."""
        depth, rest = divmod(num_computed, self.config.block_size)
        if not self.caching or rest == 0 or num_computed <= seq.prompt_len or seq._committed < depth:
            return None  # on a block boundary, not decoded (exact chunked checkpoints cover prompts), or
            # its full blocks are not all in the tree (over budget)
        parent = seq._keys[depth - 1] if depth else self._root
        tokens = tuple(seq.token_ids[depth * self.config.block_size : num_computed])
        for other in list(self._tails_below.get(parent, ())):
            shorter = min(len(other.tokens), len(tokens))
            if other.tokens[:shorter] == tokens[:shorter]:  # the same conversation's: the latest replaces it
                self._evict_tail(other)
        nbytes = self.kv_bytes_per_block + self.state_spec.nbytes
        if not self._make_room(nbytes):
            self._counters["checkpoints_skipped"] += 1
            return None
        ckpt = GDNCheckpoint.capture(block_key(parent, tokens), num_computed, conv, recurrent)
        tail = _Tail(parent, tokens, seq.block_ids[depth], ckpt, nbytes)
        self._add_tail(tail)
        self._counters["tails_stored"] += 1
        return tail.block

    def _put_back(self, tail: _Tail) -> int | None:
        """Return a taken tail nobody used to the cache (its block too); None if it no longer fits."""
        if not self._make_room(tail.nbytes):
            return None
        self._add_tail(tail)
        return tail.block

    def _add_tail(self, tail: _Tail) -> None:
        self._tails[tail.key] = tail
        self._tails_below.setdefault(tail.parent, []).append(tail)
        self._tail_bytes += tail.nbytes
        self._touch_tail(tail)

    def _tail_hit(self, tokens: list[int], path: list[_Node], hit: int) -> _Tail | None:
        """The deepest sound tail the prompt continues past ``hit``, short of its last token (recomputed)."""
        bs = self.config.block_size
        for depth in range(len(path), -1, -1):
            if depth * bs + bs <= hit:
                return None  # tails below end earlier still
            below = self._tails_below.get(path[depth - 1].key if depth else self._root, ())
            for tail in sorted(below, key=lambda t: -len(t.tokens)):
                end = depth * bs + len(tail.tokens)
                if end <= hit or end >= len(tokens) or tuple(tokens[depth * bs : end]) != tail.tokens:
                    continue
                reason = tail.checkpoint.validate(self.state_spec, tail.key, end)
                if reason is None:
                    return tail
                logger.warning("prefix cache: invalid tail state at position %d not used: %s", end, reason)
                self._counters["checkpoints_invalid"] += 1
                self._drop_tail(tail)
        return None

    def _remove_tail(self, tail: _Tail) -> None:
        """Take the tail out of the cache (its block is then the caller's to free or hand over)."""
        del self._tails[tail.key]
        below = self._tails_below[tail.parent]
        below.remove(tail)
        self._tail_bytes -= tail.nbytes
        if not below:
            del self._tails_below[tail.parent]
            node = self._nodes.get(tail.parent)
            if node is not None and node.children == 0:
                self._push_node(node)  # it may be a leaf again

    def _release_checkpoint(self, seq: CachedSequence) -> None:
        assert seq.checkpoint is not None
        if seq.checkpoint.pins:  # a cached checkpoint (a tail's state belongs to the sequence that took it)
            self._unpin(seq.checkpoint)
        seq.checkpoint = None

    def _push_node(self, node: _Node) -> None:
        heapq.heappush(self._node_heap, (node.last_used, node.key))
        self._maybe_compact(self._node_heap)

    def _push_checkpoint(self, ckpt: GDNCheckpoint) -> None:
        heapq.heappush(self._ckpt_heap, (ckpt.last_used, ckpt.key))
        self._maybe_compact(self._ckpt_heap)

    def _maybe_compact(self, heap: list[tuple[int, bytes]]) -> None:
        # Rebuild every heap from its live entries once this one holds many stale ones: heaps stay bounded.
        if len(heap) > 2 * (len(self._nodes) + len(self._tails)) + 1024:
            self._node_heap = [(n.last_used, k) for k, n in self._nodes.items()]
            self._ckpt_heap = [(n.checkpoint.last_used, k) for k, n in self._nodes.items() if n.checkpoint]
            self._tail_heap = [(t.last_used, k) for k, t in self._tails.items()]
            for rebuilt in (self._node_heap, self._ckpt_heap, self._tail_heap):
                heapq.heapify(rebuilt)

    def _touch_path(self, nodes: list[_Node]) -> None:
        # Deepest first, so shared prefixes end up more recent than the branches below them.
        for node in reversed(nodes):
            node.last_used = next(self._clock)
            self._push_node(node)

    def _touch_checkpoint(self, ckpt: GDNCheckpoint) -> None:
        ckpt.last_used = next(self._clock)
        self._push_checkpoint(ckpt)

    def _touch_tail(self, tail: _Tail) -> None:
        tail.last_used = next(self._clock)
        heapq.heappush(self._tail_heap, (tail.last_used, tail.key))
        self._maybe_compact(self._tail_heap)

    def _unpin(self, ckpt: GDNCheckpoint) -> None:
        ckpt.pins -= 1
        if ckpt.pins == 0:
            self._push_checkpoint(ckpt)

    def _evictable_node(self) -> _Node | None:
        heap = self._node_heap
        while heap:
            stamp, key = heap[0]
            node = self._nodes.get(key)
            if (
                node is not None
                and node.last_used == stamp
                and node.children == 0
                and node.key not in self._tails_below  # a tail is a leaf below its node: it goes first
                and self.pool.ref_count(node.block) == 0
            ):
                return node
            heapq.heappop(heap)
        return None

    def _evictable_checkpoint(self) -> _Node | None:
        heap = self._ckpt_heap
        while heap:
            stamp, key = heap[0]
            node = self._nodes.get(key)
            ckpt = node.checkpoint if node is not None else None
            if ckpt is not None and ckpt.last_used == stamp and ckpt.pins == 0:
                return node
            heapq.heappop(heap)
        return None

    def _evictable_tail(self) -> _Tail | None:
        heap = self._tail_heap
        while heap:
            stamp, key = heap[0]
            tail = self._tails.get(key)
            if tail is not None and tail.last_used == stamp:
                return tail
            heapq.heappop(heap)
        return None

    def _evict_one(self, blocks_only: bool = False) -> bool:
        """Evict the least recently used unreferenced leaf block, tail or unpinned checkpoint (only what
        frees a KV block with `blocks_only`)."""
        node = self._evictable_node()
        tail = self._evictable_tail()
        holder = None if blocks_only else self._evictable_checkpoint()
        candidates = [
            (item.last_used, kind, item) for kind, item in ((0, node), (1, tail)) if item is not None
        ]
        if holder is not None:
            candidates.append((holder.checkpoint.last_used, 2, holder))
        if not candidates:
            return False
        _, kind, item = min(candidates, key=lambda c: c[:2])
        if kind == 0:
            self._evict_node(item)
        elif kind == 1:
            self._evict_tail(item)
        else:
            self._drop_checkpoint(item)
            self._counters["checkpoints_evicted"] += 1
        return True

    def _evict_tail(self, tail: _Tail) -> None:
        self._drop_tail(tail)
        self._counters["tails_evicted"] += 1

    def _drop_tail(self, tail: _Tail) -> None:
        self._remove_tail(tail)
        self.pool.free(tail.block)

    def _evict_node(self, node: _Node) -> None:
        if node.checkpoint is not None:  # its KV prefix is going: the state is useless without it
            self._drop_checkpoint(node)
            self._counters["checkpoints_evicted"] += 1
        if node.announced and self._events is not None:
            self._events.append(BlocksRemoved((block_hash(node.key),)))
        del self._nodes[node.key]
        del self._node_of_block[node.block]
        if node.parent is not None:
            node.parent.children -= 1
            if node.parent.children == 0:
                self._push_node(node.parent)
        self.pool.free(node.block)
        self._kv_bytes -= self.kv_bytes_per_block
        self._counters["blocks_evicted"] += 1

    def _drop_checkpoint(self, node: _Node) -> None:
        ckpt = node.checkpoint
        assert ckpt is not None and ckpt.pins == 0, "dropping a missing or pinned checkpoint"
        node.checkpoint = None
        self._ckpt_bytes -= ckpt.nbytes
        self._num_checkpoints -= 1

    def _make_room(self, nbytes: int) -> bool:
        while self._kv_bytes + self._ckpt_bytes + self._tail_bytes + nbytes > self.config.budget_bytes:
            if not self._evict_one():
                return False
        return True

    def _allocate_block(self) -> int:
        block = self.pool.allocate()
        while block is None:
            if not self._evict_one(blocks_only=True):
                raise KVBlocksExhausted(
                    f"KV block pool exhausted: all {self.pool.num_blocks - 1} blocks are used by in-flight "
                    "sequences; raise num_blocks or run fewer/shorter sequences at once"
                )
            block = self.pool.allocate()
        return block
