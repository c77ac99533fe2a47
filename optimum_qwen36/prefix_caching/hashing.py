"""Stable chained hashes of full KV blocks.

A block's key is ``blake2b(parent_key || int64 token ids)``, so equal keys mean equal token prefixes
from position 0 (with overwhelming probability), and the root key is salted with the
model/artifact identity so that states of different models or builds never match. Python's
``hash()`` is avoided because it is randomised per process and too short.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

HASH_BYTES = 16


def root_key(identity: str) -> bytes:
    """Key of the empty prefix for one model/artifact identity."""
    return hashlib.blake2b(identity.encode("utf-8"), digest_size=HASH_BYTES, person=b"qwen36-prefix").digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a block given its parent's key and its token ids."""
    data = np.asarray(tokens, dtype="<i8").tobytes()
    return hashlib.blake2b(parent + data, digest_size=HASH_BYTES).digest()


def chain_keys(parent: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Keys of the full blocks of ``token_ids`` chained from ``parent``; a trailing partial block has none."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys
