"""Paged KV block allocation with ref counts, LRU eviction and prefix caching by hash chain."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.hashing import extend_block_hashes
from engine.kv_events import KVEvent
from engine.request import Request

if TYPE_CHECKING:
    from engine.kv_tiers import KVTiers


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Owns which block holds what. Free blocks sit in LRU order; cached ones stay findable until evicted.

    Forked requests (n candidates, beams) share blocks by reference count; a request about to write into
    a shared block gets a copy of it first (copy on write): `take_copies` hands the (src, dst) pairs to
    the engine, which copies the KV before the forward that writes.

    With `tiers` (engine/kv_tiers.py), a cached block whose last reference is dropped is demoted to the tiers
    below, and `promote` brings a prompt's blocks back from them."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}
        self.events: list[KVEvent] = []
        self.copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.tiers: KVTiers | None = None
        self.window_released = 0  # blocks given back out of every layer's sliding window (release_outside_window)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, req: Request) -> None:
        """Extend `req.block_hashes` to cover every full block of its tokens."""
        if len(req.block_hashes) < req.num_tokens // self.block_size:  # most decode steps fill no block
            extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, req.cache_salt,
                                req.lora and req.lora.key)

    def lookup(self, block_hash: int, token_ids=None) -> int | None:
        """The block caching `block_hash` (confirmed by token ids when given), or None."""
        block_id = self.cached.get(block_hash)
        if block_id is None:
            return None
        if token_ids is not None and self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def get_computed_blocks(self, req: Request, num_tokens: int | None = None) -> list[int]:
        """Leading blocks of `req` already in the cache; at least one token of its first `num_tokens`
        (default: all of them) is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        hits = self.peek_computed_blocks(req, num_tokens)
        self.count_lookup(req, hits)
        return hits

    def count_lookup(self, req: Request, hits: list[int]) -> None:
        """Count a prefix lookup of `req` that found `hits` (vllm:prefix_cache_queries / _hits)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += len(hits) * self.block_size

    def peek_computed_blocks(self, req: Request, num_tokens: int | None = None) -> list[int]:
        """`get_computed_blocks` without counting the lookup (`count_lookup` counts it once it is used)."""
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(req)
        max_blocks = ((req.num_tokens if num_tokens is None else num_tokens) - 1) // self.block_size
        return self._chain_hits(req.block_hashes[:max_blocks], req.all_token_ids)

    def can_allocate(self, num_blocks: int, computed_blocks: list[int] = ()) -> bool:
        reclaimed = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        return num_blocks <= self.num_free_blocks - reclaimed

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens; False (and no change) when the pool is short."""
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(req.block_table) - len(computed_blocks)
        written = num_computed // self.block_size  # the first block this step writes into
        shared = written < len(req.block_table) and self.blocks[req.block_table[written]].ref_count > 1
        if not self.can_allocate(max(need, 0) + shared, computed_blocks):
            return False
        if shared:
            self._copy_on_write(req, written)
        for block_id in computed_blocks:
            self._touch(block_id)
        req.block_table.extend(computed_blocks)
        req.block_table.extend(self._pop_free() for _ in range(need))
        return True

    def reserve_for_import(self, req: Request) -> list[int] | None:
        """Give `req` blocks for its whole prompt, reusing locally cached prefix blocks.

        Returns the indices (into `req.block_table`) of the blocks whose KV must be imported, or None when
        the pool is short. The whole prompt's KV comes with the import, so every full prompt block may be
        reused, whether or not the first token sampled elsewhere is already in `req` (decode may reserve
        before it exists)."""
        num_prompt = req.num_prompt_tokens
        self.promote(req, num_prompt + 1, remote=True)
        computed = self.get_computed_blocks(req, num_prompt + 1)
        num_cached = len(computed) * self.block_size
        if not self.allocate_slots(req, num_prompt - num_cached, computed):
            return None
        req.num_cached_tokens = num_cached
        return list(range(len(computed), self.blocks_needed(num_prompt)))

    def promote(self, req: Request, num_tokens: int | None = None, remote: bool = False) -> int:
        """Bring back from the tiers below (engine/kv_tiers.py) the blocks of `req`'s prefix that follow its
        device hits, as far as the chain goes and free blocks allow: they become cached blocks no request holds
        yet, found by the next `get_computed_blocks`. `remote`: past the worker's own tiers, ask the shared
        store too (a network round trip: once per request, not at every step). Returns how many came back."""
        if self.tiers is None or not self.enable_prefix_caching:
            return 0
        hits = self.peek_computed_blocks(req, num_tokens)
        max_blocks = ((req.num_tokens if num_tokens is None else num_tokens) - 1) // self.block_size
        return self._promote_chain(req.block_hashes[:max_blocks], req.all_token_ids, hits, remote)

    def _promote_chain(self, block_hashes, token_ids, hits: list[int], remote: bool = True) -> int:
        """`promote` for the chain `block_hashes` of `token_ids`, whose first `len(hits)` blocks are cached."""
        bs = self.block_size
        found = []
        for i in range(len(hits), len(block_hashes)):
            location = self.tiers.find(block_hashes[i], token_ids[i * bs:(i + 1) * bs])
            if location is None:
                break
            found.append((*location, block_hashes[i]))
        start = len(hits) + len(found)
        if remote and start < len(block_hashes) and len(found) < self.num_free_blocks:
            found += self.tiers.remote_run(block_hashes[start:], token_ids[start * bs:len(block_hashes) * bs])
        del found[max(0, self.num_free_blocks - sum(1 for b in hits if self.blocks[b].ref_count == 0)):]
        if not found:
            return 0
        self.add_references(hits)  # the pops below must not take the hits the promoted blocks extend
        block_ids = [self._pop_free() for _ in found]
        self.tiers.promote(found, block_ids)
        first = len(hits)
        self.events.append(KVEvent("stored", [], block_hashes[first - 1] if first else None))
        for i, ((_, _, block_hash), block_id) in enumerate(zip(found, block_ids), start=first):
            block = self.blocks[block_id]
            block.block_hash, block.token_ids = block_hash, tuple(token_ids[i * bs:(i + 1) * bs])
            self.cached[block_hash] = block_id
            self.events[-1].block_hashes.append(block_hash)
        self.free_block_ids(reversed(block_ids))
        self.free_block_ids(hits)
        return len(found)

    def hold_prefix(self, block_hashes, token_ids) -> list[int]:
        """The leading blocks of the chain `block_hashes` (of `token_ids`) in the cache, after bringing back
        what a tier below holds, each with one more reference (a lease for a peer's pull: `free_block_ids`
        lets go)."""
        if not self.enable_prefix_caching:
            return []
        hits = self._chain_hits(block_hashes, token_ids)
        if self.tiers is not None and self._promote_chain(block_hashes, token_ids, hits):
            hits = self._chain_hits(block_hashes, token_ids)
        self.add_references(hits)
        return hits

    def reserve_prefix(self, block_hashes, token_ids) -> tuple[int, list[int]] | None:
        """Before pulling the prefix chain `block_hashes` (of `token_ids`) from a peer: how many of its leading
        blocks are here already (tiers included), and fresh blocks (ref count 1) for the rest; None when the
        pool is short."""
        hits = self._chain_hits(block_hashes, token_ids)
        if self.tiers is not None and self._promote_chain(block_hashes, token_ids, hits):
            hits = self._chain_hits(block_hashes, token_ids)
        if len(hits) >= len(block_hashes):
            return len(hits), []
        self.add_references(hits)  # the allocation must not take them
        dst = self.allocate_blocks(len(block_hashes) - len(hits))
        self.free_block_ids(hits)
        return None if dst is None else (len(hits), dst)

    def adopt_prefix(self, block_hashes, token_ids, dst: list[int], have: int) -> None:
        """Blocks `dst` now hold blocks `have`, `have + 1`, ... of the chain `block_hashes` (pulled from a
        peer): into the prefix cache (where a block is cached already, that copy stays) and free, for the
        prompts that start with it to find."""
        bs = self.block_size
        for i, block_id in enumerate(dst, start=have):
            parent = block_hashes[i - 1] if i else None
            self.register_block(block_id, block_hashes[i], token_ids[i * bs:(i + 1) * bs], parent)
        self.free_block_ids(reversed(dst))

    def _chain_hits(self, block_hashes, token_ids) -> list[int]:
        bs = self.block_size
        hits = []
        for i, block_hash in enumerate(block_hashes):
            block_id = self.lookup(block_hash, token_ids[i * bs:(i + 1) * bs])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the blocks of `parent` (one more reference each) and its cache bookkeeping."""
        self.add_references(parent.block_table[parent.num_released_blocks:])
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_released_blocks = parent.num_released_blocks

    def take_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies copy-on-write decided since the last call."""
        copies, self.copies = self.copies, []
        return copies

    def _copy_on_write(self, req: Request, index: int) -> None:
        src = req.block_table[index]
        dst = self._pop_free()
        self.blocks[src].ref_count -= 1  # still held by the requests it was shared with
        req.block_table[index] = dst
        req.num_cached_blocks = min(req.num_cached_blocks, index)
        self.copies.append((src, dst))

    def allocate_blocks(self, n: int) -> list[int] | None:
        """Take `n` fresh blocks (ref count 1) outside any request, e.g. as KV import targets."""
        if n > self.num_free_blocks:
            return None
        return [self._pop_free() for _ in range(n)]

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks that became full since the last call, emitting a `stored` event.
        Only new blocks are visited, so the cost per step does not grow with the context."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(req)
        bs = self.block_size
        num_full = min(req.num_computed_tokens // bs, len(req.block_hashes), len(req.block_table))
        run: KVEvent | None = None
        for i in range(max(req.num_cached_blocks, req.num_released_blocks), num_full):
            block = self.blocks[req.block_table[i]]
            h = req.block_hashes[i]
            if block.block_hash is not None or h in self.cached:
                run = None  # a skipped block breaks the chain: the next stored block starts a new event
                continue
            block.block_hash, block.token_ids = h, tuple(req.all_token_ids[i * bs:(i + 1) * bs])
            self.cached[h] = block.block_id
            if run is None:
                run = KVEvent("stored", [], req.block_hashes[i - 1] if i else None)
                self.events.append(run)
            run.block_hashes.append(h)
        req.num_cached_blocks = max(req.num_cached_blocks, num_full)

    def register_block(self, block_id: int, block_hash: int, token_ids, parent_hash: int | None) -> bool:
        """Put an imported block into the prefix cache; False if that hash is already cached elsewhere."""
        if not self.enable_prefix_caching or block_hash in self.cached:
            return False
        block = self.blocks[block_id]
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self.cached[block_hash] = block_id
        self.events.append(KVEvent("stored", [block_hash], parent_hash))
        return True

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Free the blocks of `req` past its first `num_tokens` tokens (KV written for rejected drafts)."""
        keep = self.blocks_needed(num_tokens)
        if len(req.block_table) > keep:
            self.free_block_ids(reversed(req.block_table[keep:]))
            del req.block_table[keep:]

    def free(self, req: Request) -> None:
        self.free_block_ids(reversed(req.block_table[req.num_released_blocks:]))
        req.block_table = []
        req.num_cached_blocks = req.num_released_blocks = 0

    def release_outside_window(self, req: Request, window: int) -> int:
        """Give back the leading blocks of `req` that no later query attends: every layer attends only the last
        `window` positions, and the next query is at `num_computed_tokens`, so tokens before
        num_computed_tokens - window + 1 are out of reach (vLLM's sliding-window manager does the same). Cached
        blocks stay in the prefix cache (another request's prompt may still hit them). Their table entries stay
        (masked, never read into a result); returns how many blocks were given back now."""
        reach = (req.num_computed_tokens - window + 1) // self.block_size
        if self.enable_prefix_caching:
            reach = min(reach, req.num_cached_blocks)  # offered to the cache first: it reads them once
        reach = min(reach, len(req.block_table))
        if reach <= req.num_released_blocks:
            return 0
        self.free_block_ids(req.block_table[req.num_released_blocks:reach])
        released, req.num_released_blocks = reach - req.num_released_blocks, reach
        self.window_released += released
        return released

    def free_block_ids(self, block_ids) -> None:
        """Drop one reference from each block; tail blocks first so they are evicted first. Cached blocks
        nobody holds any more go down to the tiers, when there are some."""
        demoted = []
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
                if block.block_hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)
                elif self.tiers is not None:
                    demoted.append((block_id, block.block_hash, block.token_ids))
        if demoted:
            self.tiers.demote(demoted)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block that no request holds; False if some are still in use."""
        if any(b.ref_count for b in self.blocks):
            return False
        for block in self.blocks:
            block.block_hash, block.token_ids = None, ()
        self.cached.clear()
        if self.tiers is not None:
            self.tiers.clear()
        self.events.append(KVEvent("cleared"))
        return True

    def snapshot(self) -> list[int]:
        """All cached block hashes, for a router resync."""
        return list(self.cached)

    def tier_snapshot(self) -> dict[str, list[int]]:
        """Per tier below the device cache, the block hashes it holds (for a router resync)."""
        return {} if self.tiers is None else self.tiers.snapshot()

    def take_events(self) -> list[KVEvent]:
        events = list(self.events)
        self.events.clear()  # the same list: the tiers append to it too
        return events

    def add_references(self, block_ids) -> None:
        """Take one more reference on each block (a KV lease pinning a running request's blocks);
        `free_block_ids` drops it."""
        for block_id in block_ids:
            self._touch(block_id)

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        if self.tiers is not None:
            self.tiers.wait_block(block_id)  # it is about to be written: a pending demotion reads it first
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            self.events.append(KVEvent("removed", [block.block_hash]))
            block.block_hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
