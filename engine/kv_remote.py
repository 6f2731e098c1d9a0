"""The optional shared tier below a worker's own (engine/kv_tiers.py): KV blocks in an external Redis or Valkey
server that every worker of the cluster reads and writes (`kv_tiers.remote_url`, off by default).

A block is stored under a key made of the KV layout's digest and its block hash (so workers of another model,
dtype, block size or TP split never read it, and the tenant's cache salt, part of the hash, keeps tenants apart),
as one value: a magic, its token ids, then its bytes. A read confirms the tokens and the length before a block
is used. The server bounds what it keeps (maxmemory with an LRU policy is the operator's to set); a block it has
dropped is a miss. Every call that fails is counted (`failures`) and treated as a miss or a skipped write: the
prefix is computed instead, never served wrong.
"""
from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Sequence

import torch

from engine.kv_cache import KVLayout

logger = logging.getLogger(__name__)

MAGIC = b"TKV1"
KEY_PREFIX = "tandem:kv:"


def layout_digest(layout: KVLayout, tp_size: int) -> str:
    text = f"{layout.model_id}|{layout.dtype}|{layout.block_size}|{layout.num_layers}|{layout.num_kv_heads}|" \
           f"{layout.head_dim}|tp{tp_size}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class RemoteStore:
    """Blocks of one KV layout in a Redis-protocol server at `url`; `timeout_s` bounds each call."""

    def __init__(self, url: str, layout: KVLayout, tp_size: int, block_shape: tuple[int, ...], timeout_s: float = 2.0):
        import redis  # only where a remote tier is configured

        self.url = url
        self.prefix = f"{KEY_PREFIX}{layout_digest(layout, tp_size)}:"
        self.dtype = getattr(torch, layout.dtype)
        self.block_shape = block_shape
        self.block_bytes = self.dtype.itemsize * int(torch.Size(block_shape).numel())
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.stored = 0
        self.hits = 0
        self.misses = 0
        self.failures = 0
        self.bytes_in = 0
        self.bytes_out = 0

    def key(self, block_hash: int) -> str:
        return f"{self.prefix}{block_hash:032x}"

    def put(self, blocks: Sequence[tuple[int, Sequence[int], torch.Tensor]]) -> None:
        """Store (hash, token ids, block tensor) triples in one round trip; a failure is counted, not raised."""
        if not blocks:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for block_hash, token_ids, block in blocks:
                pipe.set(self.key(block_hash), self._encode(token_ids, block))
            pipe.execute()
        except Exception as exc:  # the server is down or refuses: the blocks are only not shared
            self._failed("store", exc)
            return
        self.stored += len(blocks)
        self.bytes_in += len(blocks) * self.block_bytes

    def get_run(self, block_hashes: Sequence[int], token_ids: Sequence[int], block_size: int) -> list[torch.Tensor]:
        """The leading run of the chain's blocks the store holds with these tokens, as tensors of the block's
        shape, in one round trip; [] on a failure (counted)."""
        if not block_hashes:
            return []
        try:
            values = self.client.mget([self.key(h) for h in block_hashes])
        except Exception as exc:
            self._failed("read", exc)
            return []
        run = []
        for i, value in enumerate(values):
            block = None if value is None else self._decode(value, token_ids[i * block_size:(i + 1) * block_size])
            if block is None:
                break
            run.append(block)
        self.hits += len(run)
        self.misses += len(run) < len(block_hashes)
        self.bytes_out += len(run) * self.block_bytes
        return run

    def _encode(self, token_ids: Sequence[int], block: torch.Tensor) -> bytes:
        header = MAGIC + struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids)
        return header + block.contiguous().view(torch.uint8).numpy().tobytes()

    def _decode(self, value: bytes, token_ids: Sequence[int]) -> torch.Tensor | None:
        n = len(token_ids)
        header = MAGIC + struct.pack(f"<I{n}I", n, *token_ids)
        if not value.startswith(header) or len(value) != len(header) + self.block_bytes:
            return None  # other tokens under this hash, or a value that is not a block of this layout
        return torch.frombuffer(bytearray(value[len(header):]), dtype=torch.uint8).view(self.dtype).view(self.block_shape)

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 1000 == 0:
            logger.warning("the remote KV tier at %s failed to %s (%s, %d failures so far): computing instead",
                           self.url, what, exc, self.failures)

    def stats(self) -> dict:
        return {"stored": self.stored, "hits": self.hits, "misses": self.misses, "failures": self.failures,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass
