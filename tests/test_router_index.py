"""PrefixIndex: an exact block -> workers index fed by KV events."""
from engine.hashing import block_hashes
from engine.kv_events import KVEvent, KVEventBatch
from router.placement.index import PrefixIndex

BLOCK = 16
PROMPT = list(range(1000, 1000 + 8 * BLOCK))  # 8 full blocks
HASHES = block_hashes(PROMPT, BLOCK)


def stored(worker, seq, hashes):
    return KVEventBatch(worker, seq, [KVEvent("stored", list(hashes))])


def test_stored_blocks_count_as_overlap():
    index = PrefixIndex()
    assert index.apply(stored("w0", 0, HASHES[:5]))
    assert index.overlap(HASHES, ["w0"]) == {"w0": 5}


def test_overlap_reports_every_requested_worker_including_unknown_ones():
    index = PrefixIndex()
    index.apply(stored("w0", 0, HASHES))
    assert index.overlap(HASHES, ["w0", "w1", "never-seen"]) == {"w0": 8, "w1": 0, "never-seen": 0}


def test_overlap_stops_at_the_first_missing_block():
    index = PrefixIndex()
    index.apply(stored("w0", 0, HASHES[:2] + HASHES[3:]))  # block 2 missing
    index.apply(stored("w1", 0, HASHES[1:]))  # block 0 missing
    assert index.overlap(HASHES, ["w0", "w1"]) == {"w0": 2, "w1": 0}


def test_overlap_is_computed_per_worker():
    index = PrefixIndex()
    for seq, worker in enumerate(["w0", "w1", "w2"]):
        index.apply(stored(worker, 0, HASHES[:2 + 3 * seq]))
    assert index.overlap(HASHES, ["w0", "w1", "w2"]) == {"w0": 2, "w1": 5, "w2": 8}


def test_removed_blocks_leave_only_that_worker():
    index = PrefixIndex()
    index.apply(stored("w0", 0, HASHES))
    index.apply(stored("w1", 0, HASHES))
    index.apply(KVEventBatch("w0", 1, [KVEvent("removed", HASHES[4:])]))
    assert index.overlap(HASHES, ["w0", "w1"]) == {"w0": 4, "w1": 8}


def test_cleared_drops_all_blocks_of_that_worker():
    index = PrefixIndex()
    index.apply(stored("w0", 0, HASHES))
    index.apply(stored("w1", 0, HASHES[:3]))
    index.apply(KVEventBatch("w0", 1, [KVEvent("cleared")]))
    assert index.overlap(HASHES, ["w0", "w1"]) == {"w0": 0, "w1": 3}
    assert index.num_blocks("w0") == 0


def test_events_in_one_batch_apply_in_order():
    index = PrefixIndex()
    batch = KVEventBatch("w0", 0, [KVEvent("stored", HASHES), KVEvent("cleared"), KVEvent("stored", HASHES[:1])])
    index.apply(batch)
    assert index.overlap(HASHES, ["w0"]) == {"w0": 1}


def test_storing_a_block_twice_then_removing_it_once_forgets_it():
    index = PrefixIndex()
    index.apply(stored("w0", 0, HASHES[:2]))
    index.apply(stored("w0", 1, HASHES[:2]))
    index.apply(KVEventBatch("w0", 2, [KVEvent("removed", HASHES[1:2])]))
    assert index.overlap(HASHES, ["w0"]) == {"w0": 1}
    assert len(index) == 1


def test_sequence_gap_is_reported_and_the_batch_is_not_applied():
    index = PrefixIndex()
    assert index.apply(stored("w0", 0, HASHES[:2]))
    assert not index.apply(stored("w0", 2, HASHES))
    assert index.needs_resync("w0")
    assert index.overlap(HASHES, ["w0"]) == {"w0": 2}


def test_batches_after_a_gap_are_refused_until_resync():
    index = PrefixIndex()
    index.apply(stored("w0", 0, HASHES[:2]))
    index.apply(stored("w0", 2, HASHES[:4]))
    assert not index.apply(stored("w0", 1, HASHES))
    assert index.overlap(HASHES, ["w0"]) == {"w0": 2}


def test_worker_first_seen_mid_stream_needs_a_resync():
    index = PrefixIndex()
    assert not index.apply(stored("w0", 7, HASHES))
    assert index.needs_resync("w0")


def test_replayed_batches_are_ignored():
    index = PrefixIndex()
    index.apply(stored("w0", 0, HASHES))
    index.apply(KVEventBatch("w0", 1, [KVEvent("removed", HASHES[2:])]))
    assert index.apply(stored("w0", 0, HASHES))
    assert index.overlap(HASHES, ["w0"]) == {"w0": 2}


def test_resync_replaces_a_workers_entries_and_resumes_after_the_snapshot_seq():
    index = PrefixIndex()
    index.apply(stored("w0", 0, HASHES))
    index.apply(stored("w0", 5, HASHES))  # gap
    index.resync("w0", HASHES[:3], seq=9)
    assert not index.needs_resync("w0")
    assert index.overlap(HASHES, ["w0"]) == {"w0": 3}
    assert index.apply(stored("w0", 10, HASHES[3:5]))
    assert index.overlap(HASHES, ["w0"]) == {"w0": 5}


def test_resync_leaves_other_workers_alone():
    index = PrefixIndex()
    index.apply(stored("w0", 0, HASHES))
    index.apply(stored("w1", 0, HASHES))
    index.resync("w0", [], seq=3)
    assert index.overlap(HASHES, ["w0", "w1"]) == {"w0": 0, "w1": 8}
    assert len(index) == len(HASHES)


def test_removed_worker_entries_vanish_at_once():
    index = PrefixIndex()
    index.apply(stored("w0", 0, HASHES))
    index.apply(stored("w1", 0, HASHES[:4]))
    index.remove_worker("w0")
    assert index.workers() == ["w1"]
    assert index.overlap(HASHES, ["w0", "w1"]) == {"w0": 0, "w1": 4}
    assert len(index) == 4


def test_a_new_worker_reusing_a_removed_workers_slot_starts_empty():
    index = PrefixIndex()
    index.apply(stored("w0", 0, HASHES))
    index.overlap(HASHES, ["w0", "w1"])  # caches the pool's mask
    index.remove_worker("w0")
    index.apply(stored("w1", 0, HASHES[:1]))
    assert index.overlap(HASHES, ["w0", "w1"]) == {"w0": 0, "w1": 1}


def test_tenant_salt_gives_different_hashes_so_tenants_never_share_a_prefix():
    index = PrefixIndex()
    index.apply(stored("w0", 0, block_hashes(PROMPT, BLOCK, cache_salt="tenant-a")))
    other = block_hashes(PROMPT, BLOCK, cache_salt="tenant-b")
    assert index.overlap(other, ["w0"]) == {"w0": 0}
    assert index.overlap(block_hashes(PROMPT, BLOCK, cache_salt="tenant-a"), ["w0"]) == {"w0": 8}


# ---- tiers below the device cache -----------------------------------------------------------------

def tier_batch(worker, seq, kind, hashes, tier):
    return KVEventBatch(worker, seq, [KVEvent(kind, list(hashes), tier=tier)])


def test_blocks_in_a_lower_tier_count_only_when_tiers_are_asked_for():
    index = PrefixIndex()
    index.apply(stored("w0", 0, HASHES[:3]))
    index.apply(tier_batch("w0", 1, "stored", HASHES[3:6], "host"))
    index.apply(tier_batch("w1", 0, "stored", HASHES[:8], "disk"))
    assert index.overlap(HASHES, ["w0", "w1"]) == {"w0": 3, "w1": 0}
    assert index.overlap(HASHES, ["w0", "w1"], tiers=True) == {"w0": 6, "w1": 8}
    assert index.tier_overlap(HASHES, ["w0", "w1"]) == {"w0": (3, 6), "w1": (0, 8)}
    assert index.num_blocks("w0") == 3 and index.num_lower_blocks("w0") == {"host": 3}


def test_a_block_leaves_a_worker_only_when_its_last_tier_drops_it():
    index = PrefixIndex()
    index.apply(tier_batch("w0", 0, "stored", HASHES[:2], "host"))
    index.apply(tier_batch("w0", 1, "stored", HASHES[:2], "disk"))
    index.apply(stored("w0", 2, HASHES[:2]))
    index.apply(KVEventBatch("w0", 3, [KVEvent("removed", HASHES[:2])]))  # from the device cache
    index.apply(tier_batch("w0", 4, "removed", HASHES[:1], "host"))
    assert index.tier_overlap(HASHES, ["w0"]) == {"w0": (0, 2)}
    index.apply(tier_batch("w0", 5, "removed", HASHES[:1], "disk"))
    assert index.tier_overlap(HASHES, ["w0"]) == {"w0": (0, 0)}
    index.apply(KVEventBatch("w0", 6, [KVEvent("cleared")]))  # every tier
    assert index.overlap(HASHES[1:], ["w0"], tiers=True) == {"w0": 0}
    assert len(index._lower_owners) == 0


def test_a_resync_and_a_removed_worker_replace_and_drop_the_lower_tiers_too():
    index = PrefixIndex()
    index.apply(tier_batch("w0", 0, "stored", HASHES, "host"))
    index.resync("w0", HASHES[:1], 7, {"disk": HASHES[1:4]})
    assert index.tier_overlap(HASHES, ["w0"]) == {"w0": (1, 4)}
    index.remove_worker("w0")
    assert index.overlap(HASHES, ["w0"], tiers=True) == {"w0": 0} and not index._lower_owners


def test_the_shared_store_counts_for_every_worker_that_reads_it_and_only_those():
    """Blocks one worker wrote to the shared store are a hit below the device cache for every worker whose
    snapshot lists the store (a fresh worker that never wrote there included), priced as its "remote" tier;
    a worker without the store never counts them. The store's drops, a reader's leaving or a resync without
    the store stop the counting; a worker's "cleared" (its own tiers) leaves the store's blocks be."""
    index = PrefixIndex()
    index.resync("fresh", [], 0, {"host": [], "remote": []})  # reads the store, holds nothing yet
    index.resync("no-store", [], 0, {"host": []})
    index.apply(stored("writer", 0, HASHES[:2]))
    index.apply(tier_batch("writer", 1, "stored", HASHES[:5], "remote"))
    workers = ["writer", "fresh", "no-store"]
    assert index.overlap(HASHES, workers) == {"writer": 2, "fresh": 0, "no-store": 0}
    assert index.overlap(HASHES, workers, tiers=True) == {"writer": 5, "fresh": 5, "no-store": 0}
    assert index.tier_overlap(HASHES, workers) == {"writer": (2, 5), "fresh": (0, 5), "no-store": (0, 0)}
    assert index.lower_tiers("fresh", HASHES[:5]) == {"remote": 5}
    assert index.lower_tiers("writer", HASHES[2:5]) == {"remote": 3}
    assert index.num_lower_blocks("fresh") == {"host": 0, "remote": 5}
    assert index.num_lower_blocks("no-store") == {"host": 0}
    index.begin_prompt("fresh", "p", HASHES[5:7])
    assert index.overlap(HASHES, ["fresh"], in_flight=True, tiers=True) == {"fresh": 7}
    index.apply(tier_batch("fresh", 1, "removed", HASHES[3:4], "remote"))  # the store had dropped it
    assert index.overlap(HASHES, workers, tiers=True) == {"writer": 3, "fresh": 3, "no-store": 0}
    index.apply(KVEventBatch("writer", 2, [KVEvent("cleared")]))
    assert index.overlap(HASHES, ["fresh"], tiers=True) == {"fresh": 3}
    index.remove_worker("writer")  # the store keeps its blocks: a reader still finds them
    assert index.overlap(HASHES, ["fresh"], tiers=True) == {"fresh": 3} and index.num_shared_blocks() == 4
    index.resync("fresh", [], 5, {"host": []})  # restarted without the store
    assert index.overlap(HASHES, ["fresh"], tiers=True) == {"fresh": 0}


def test_in_flight_overlap_counts_lower_tiers_when_asked():
    index = PrefixIndex()
    index.apply(tier_batch("w0", 0, "stored", HASHES[:2], "host"))
    index.begin_prompt("w0", "p", HASHES[2:4])
    assert index.overlap(HASHES, ["w0"], in_flight=True, tiers=True) == {"w0": 4}
    assert index.overlap(HASHES, ["w0"], in_flight=True) == {"w0": 0}
