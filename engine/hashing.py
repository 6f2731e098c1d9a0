"""Stable prefix-block hashing shared by workers and the router.

A full block's hash is H(parent_hash, token_ids, extra). The first block mixes
in the tenant salt, so two tenants never share a cached prefix. H is blake2b
(stable across processes and machines, unlike Python's hash()), truncated to
64 bits so the router's index can hold millions of entries cheaply; hits are
still confirmed by comparing token ids.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

NONE_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(extra)
    return int.from_bytes(h.digest(), "little")


def salt_bytes(cache_salt: str | None) -> bytes:
    return b"" if not cache_salt else b"salt:" + cache_salt.encode()


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                 start: int = 0, parent_hash: int = NONE_HASH) -> list[int]:
    """Hashes of the full blocks of `token_ids`, from block index `start` on.

    `parent_hash` must be the hash of block `start - 1` when `start > 0`.
    """
    out = []
    salt = salt_bytes(cache_salt)
    for i in range(start, len(token_ids) // block_size):
        block = token_ids[i * block_size:(i + 1) * block_size]
        parent_hash = hash_block(parent_hash, block, salt if i == 0 else b"")
        out.append(parent_hash)
    return out
