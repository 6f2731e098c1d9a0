"""Stable prefix-block hashing shared by workers and the router.

A full block's hash is H(parent_hash, token_ids, extra). The first block mixes
in the tenant salt, so two tenants never share a cached prefix. H is blake2b
(stable across processes and machines, unlike Python's hash()) with a 128-bit
digest: a client that could find a 64-bit collision for another tenant's
prefix would still need the token ids to match, but 128 bits put collisions out
of reach of anyone's compute; hits are also confirmed by comparing token ids.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

NONE_HASH = 0
HASH_BYTES = 16  # 128-bit block hashes


def hash_block(parent_hash: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent_hash.to_bytes(HASH_BYTES, "little"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(extra)
    return int.from_bytes(h.digest(), "little")


def salt_bytes(cache_salt: str | None, lora_key: str | None = None) -> bytes:
    """What block 0 mixes in: the LoRA adapter it was computed with (length-prefixed, so no salt can
    imitate it), then the tenant salt. Neither: nothing, as before adapters existed."""
    adapter = b"" if not lora_key else b"lora:" + struct.pack("<H", len(lora_key.encode())) + lora_key.encode()
    return adapter + (b"" if not cache_salt else b"salt:" + cache_salt.encode())


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int,
                        cache_salt: str | None = None, lora_key: str | None = None) -> list[int]:
    """The chain rule, the one implementation router and workers share: appends to `hashes` the
    hashes of the full blocks of `token_ids` it does not cover yet, and returns it.

    `hashes` must hold the hashes of the first `len(hashes)` full blocks of these same tokens (and
    salt), so a caller that keeps its list hashes each block once, as it fills. Block 0 mixes in the
    tenant salt and the LoRA adapter's key (engine/lora.py); every block mixes in its parent's hash.
    """
    start, end = len(hashes), len(token_ids) // block_size
    parent = hashes[-1] if start else NONE_HASH
    for i in range(start, end):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size],
                            salt_bytes(cache_salt, lora_key) if i == 0 else b"")
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                 lora_key: str | None = None) -> list[int]:
    """Hashes of the full blocks of `token_ids`."""
    return extend_block_hashes([], token_ids, block_size, cache_salt, lora_key)
