"""Block accounting, LRU eviction, KV events and prefix caching: on the BlockManager alone, and through
the engine for finishes, aborts (waiting, mid-chunked-prefill, after preemption) and tenants."""
import pytest

from engine import Engine, EngineConfig, SamplingParams
from engine.block_manager import BlockManager
from engine.hashing import block_hashes
from engine.kv_events import KVEvent
from engine.request import Request

BS = 4


def request(tokens, salt: str | None = None, rid: str = "r") -> Request:
    return Request(rid, list(tokens), SamplingParams(), max_tokens=16, cache_salt=salt)


def admit(bm: BlockManager, req: Request) -> int:
    """What the scheduler and engine do for a whole prefill: reuse cached blocks, allocate, compute,
    cache. Returns the number of prefix-hit tokens."""
    computed = bm.get_computed_blocks(req)
    num_cached = len(computed) * BS
    assert bm.allocate_slots(req, req.num_tokens - num_cached, computed)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return num_cached


def assert_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


# ---- accounting ---------------------------------------------------------------------------------

def test_freeing_every_request_returns_every_block():
    bm = BlockManager(16, BS)
    reqs = [request(range(10)), request(range(13), rid="b"), request(range(50, 57), rid="c")]
    for req in reqs:
        admit(bm, req)
    assert bm.num_free_blocks < bm.num_blocks
    for req in reqs:
        bm.free(req)
    assert_all_free(bm)


def test_shared_prefix_blocks_are_ref_counted():
    bm = BlockManager(16, BS)
    a, b = request(range(10)), request(range(10), rid="b")
    admit(bm, a)
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    assert not set(b.block_table) & set(bm.free_blocks)
    bm.free(b)
    assert_all_free(bm)


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(4, BS)
    admit(bm, request(range(9)))
    big = request(range(100, 108), rid="big")
    assert not bm.allocate_slots(big, 8)
    assert big.block_table == [] and bm.num_free_blocks == 1


# ---- LRU eviction and events --------------------------------------------------------------------

def test_uncached_blocks_are_reused_before_cached_ones_and_cached_tail_first():
    bm = BlockManager(6, BS)
    a = request(range(9))
    admit(bm, a)
    cached_tail_first = a.block_table[1::-1]
    bm.free(a)
    bm.take_events()
    first = bm.allocate_blocks(4)
    assert not set(first) & set(cached_tail_first)
    assert bm.take_events() == []
    assert bm.allocate_blocks(2) == cached_tail_first


def test_least_recently_used_cached_blocks_are_evicted_first():
    bm = BlockManager(4, BS)
    a, b = request(range(8)), request(range(20, 28), rid="b")
    admit(bm, a)
    admit(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    # A prefix hit on a's first block makes it the most recently used cached block.
    c = request(list(range(4)) + [90, 91, 92], rid="c")
    assert admit(bm, c) == 4
    bm.free(c)
    assert bm.allocate_blocks(4) == [a_blocks[1], b_blocks[1], b_blocks[0], a_blocks[0]]


def test_evicting_a_cached_block_emits_removed_and_forgets_it():
    bm = BlockManager(2, BS)
    a = request(range(8))
    admit(bm, a)
    h0, h1 = block_hashes(list(range(8)), BS)
    bm.free(a)
    bm.take_events()
    bm.allocate_blocks(1)
    assert bm.take_events() == [KVEvent("removed", [h1])]
    assert bm.lookup(h1) is None and bm.lookup(h0) is not None


def test_stored_events_carry_hashes_in_chain_order_with_their_parent():
    bm = BlockManager(8, BS)
    tokens = list(range(30, 43))
    req = request(tokens)
    assert bm.allocate_slots(req, len(tokens))
    h = block_hashes(tokens, BS)
    req.num_computed_tokens = 5  # a first prefill chunk: one full block
    bm.cache_full_blocks(req)
    req.num_computed_tokens = 13
    bm.cache_full_blocks(req)
    assert bm.take_events() == [KVEvent("stored", [h[0]], None), KVEvent("stored", [h[1], h[2]], h[0])]


def test_stored_events_do_not_bridge_a_block_cached_elsewhere():
    bm = BlockManager(8, BS)
    tokens = list(range(12))
    h = block_hashes(tokens, BS)
    [imported] = bm.allocate_blocks(1)
    bm.register_block(imported, h[1], tokens[4:8], h[0])
    bm.take_events()
    admit(bm, request(tokens + [99]))
    assert bm.take_events() == [KVEvent("stored", [h[0]], None), KVEvent("stored", [h[2]], h[1])]


def test_reset_prefix_cache_clears_only_when_no_block_is_held():
    bm = BlockManager(8, BS)
    a = request(range(8))
    admit(bm, a)
    assert not bm.reset_prefix_cache()
    bm.free(a)
    bm.take_events()
    assert bm.reset_prefix_cache()
    assert bm.take_events() == [KVEvent("cleared")]
    assert admit(bm, request(range(9), rid="b")) == 0


# ---- prefix hits --------------------------------------------------------------------------------

def test_a_prefix_hit_needs_equal_token_ids():
    bm = BlockManager(8, BS)
    tokens = list(range(9))
    h0 = block_hashes(tokens, BS)[0]
    [block] = bm.allocate_blocks(1)
    # A colliding entry: the same hash registered for different tokens.
    bm.register_block(block, h0, [7, 7, 7, 7], None)
    assert bm.lookup(h0, [7, 7, 7, 7]) == block
    assert bm.lookup(h0, tokens[:4]) is None
    assert bm.get_computed_blocks(request(tokens)) == []


def test_prefix_hits_leave_at_least_one_token_to_compute():
    bm = BlockManager(8, BS)
    admit(bm, request(range(8)))
    assert admit(bm, request(range(8), rid="b")) == 4


def test_the_same_prompt_under_another_cache_salt_gets_no_hits():
    bm = BlockManager(16, BS)
    admit(bm, request(range(9), salt="tenant-a"))
    assert admit(bm, request(range(9), salt="tenant-b", rid="b")) == 0
    assert admit(bm, request(range(9), rid="c")) == 0
    assert admit(bm, request(range(9), salt="tenant-a", rid="d")) == 8


def test_query_and_hit_counters_count_tokens():
    bm = BlockManager(16, BS)
    admit(bm, request(range(10)))
    admit(bm, request(list(range(8)) + [50, 51, 52], rid="b"))
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (21, 8)


def test_disabled_prefix_caching_neither_hits_nor_emits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    admit(bm, request(range(9)))
    assert admit(bm, request(range(9), rid="b")) == 0
    assert bm.take_events() == [] and bm.prefix_cache_queries == 0


# ---- through the engine -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_engine(tiny_llama_dir):
    """8 blocks of 16 tokens, 16-token steps, at most 2 running: chunking, waiting and preemption."""
    return Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=2))


def assert_engine_idle(engine: Engine) -> None:
    assert not engine.has_unfinished_requests() and not engine.requests
    assert_all_free(engine.block_manager)


def assert_ref_counts_match_block_tables(engine: Engine) -> None:
    holders = [0] * engine.block_manager.num_blocks
    for req in engine.scheduler.running + list(engine.scheduler.waiting):
        for block_id in req.block_table:
            holders[block_id] += 1
    assert [b.ref_count for b in engine.block_manager.blocks] == holders
    assert engine.block_manager.num_free_blocks == holders.count(0)


LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def prompt(seed: int, n: int = 30) -> list[int]:
    return [100 + (seed * 37 + i * 11) % 900 for i in range(n)]


def test_blocks_return_after_preempted_requests_finish(small_engine):
    start = small_engine.scheduler.num_preemptions
    for i in range(2):
        small_engine.add_request(f"fin-{i}", prompt(i), LONG)
    while small_engine.has_unfinished_requests():
        small_engine.step()
        assert_ref_counts_match_block_tables(small_engine)
    assert small_engine.scheduler.num_preemptions > start
    assert_engine_idle(small_engine)


def test_blocks_return_after_abort_while_waiting(small_engine):
    for i in range(3):
        small_engine.add_request(f"wait-{i}", prompt(10 + i, 8), SamplingParams(max_tokens=2, ignore_eos=True))
    small_engine.step()
    assert small_engine.requests["wait-2"] in small_engine.scheduler.waiting
    assert small_engine.abort("wait-2")
    while small_engine.has_unfinished_requests():
        small_engine.step()
    assert_engine_idle(small_engine)


def test_blocks_return_after_abort_mid_chunked_prefill(small_engine):
    req = small_engine.add_request("chunked", prompt(20, 40), LONG)
    small_engine.step()
    assert 0 < req.num_computed_tokens < req.num_prompt_tokens
    assert small_engine.abort("chunked")
    assert_engine_idle(small_engine)


def test_blocks_return_after_abort_of_a_preempted_request(small_engine):
    start = small_engine.scheduler.num_preemptions
    reqs = [small_engine.add_request(f"pre-{i}", prompt(30 + i), LONG) for i in range(2)]
    while small_engine.scheduler.num_preemptions == start and small_engine.has_unfinished_requests():
        small_engine.step()
    preempted = next(r for r in reqs if r.num_preemptions)
    small_engine.step()
    assert small_engine.abort(preempted.request_id)
    assert_ref_counts_match_block_tables(small_engine)
    for req in reqs:
        small_engine.abort(req.request_id)
    assert_engine_idle(small_engine)


def run(engine: Engine, request_id: str, tokens, salt: str | None = None):
    engine.add_request(request_id, tokens, SamplingParams(temperature=0.0, max_tokens=1), cache_salt=salt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out


def test_engine_tenants_with_different_salts_share_no_prefix(tiny_engine):
    tokens = prompt(40, 40)
    assert run(tiny_engine, "salt-a", tokens, salt="a").num_cached_tokens == 0
    assert run(tiny_engine, "salt-b", tokens, salt="b").num_cached_tokens == 0
    assert run(tiny_engine, "salt-a2", tokens, salt="a").num_cached_tokens == 32


def test_engine_prefix_counters_count_queried_and_hit_tokens(tiny_engine):
    bm = tiny_engine.block_manager
    tokens = prompt(41, 40)
    run(tiny_engine, "count-1", tokens)
    queries, hits = bm.prefix_cache_queries, bm.prefix_cache_hits
    run(tiny_engine, "count-2", tokens)
    assert (bm.prefix_cache_queries - queries, bm.prefix_cache_hits - hits) == (40, 32)


def test_blocks_filled_while_decoding_are_stored_once_each_in_chain_order(tiny_engine):
    tiny_engine.block_manager.take_events()
    tokens = prompt(7, 20)
    [out] = tiny_engine.generate([tokens], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    bs = tiny_engine.config.block_size
    stored = [h for e in tiny_engine.block_manager.take_events() if e.kind == "stored" for h in e.block_hashes]
    # 59 tokens computed (the last sampled token never is): three full blocks, each stored exactly once.
    assert stored == block_hashes(tokens + out.token_ids, bs)[:59 // bs]
