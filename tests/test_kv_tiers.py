"""KV tiers below the device cache (engine/kv_tiers.py): demotion and promotion byte for byte, down to disk and
back, LRU and pins, tenants apart, failed copies dropped, events naming the tier; through the engine, greedy
outputs equal to a run that never evicted, with the evicted prefixes not computed again."""
import os
import random
import threading
import time

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.block_manager import BlockManager
from engine.kv_cache import KVCache, KVLayout
from engine.kv_tiers import KVTiers
from engine.kv_tiers_config import KVTiersConfig
from engine.request import Request

BS = 4
LAYOUT = KVLayout("m", "float32", BS, 2, 2, 8)
BLOCK_BYTES = 2 * 2 * BS * 2 * 8 * 4  # layers x K/V x tokens x heads x dim x 4 bytes


def tiers_config(host_blocks: int, disk_blocks: int = 0, disk_path=None) -> KVTiersConfig:
    gib = 2**30
    return KVTiersConfig(host_gb=host_blocks * BLOCK_BYTES / gib, disk_gb=disk_blocks * BLOCK_BYTES / gib,
                         disk_path=None if disk_path is None else str(disk_path))


def setup(num_blocks=6, host_blocks=16, disk_blocks=0, disk_path=None):
    cache = KVCache(LAYOUT, num_blocks)
    bm = BlockManager(num_blocks, BS)
    bm.tiers = KVTiers(tiers_config(host_blocks, disk_blocks, disk_path), cache, bm.events)
    return cache, bm


def request(tokens, salt=None, rid="r") -> Request:
    return Request(rid, list(tokens), SamplingParams(), max_tokens=4, cache_salt=salt)


def compute(cache: KVCache, bm: BlockManager, req: Request) -> int:
    """Admit and 'compute' `req`: its blocks get KV derived from their tokens (what a forward would write);
    returns the prefix-hit tokens."""
    bm.promote(req)
    computed = bm.get_computed_blocks(req)
    cached = len(computed) * BS
    assert bm.allocate_slots(req, req.num_tokens - cached, computed)
    for i, block_id in enumerate(req.block_table[len(computed):], start=len(computed)):
        cache.memory[:, :, block_id] = kv_of(req.all_token_ids[i * BS:(i + 1) * BS])
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)
    return cached


def kv_of(tokens) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(tuple(tokens)) % 2**31)
    return torch.randn(LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim, generator=g)


def assert_blocks_hold_their_kv(cache, req):
    for i, block_id in enumerate(req.block_table[:req.num_tokens // BS]):
        assert torch.equal(cache.memory[:, :, block_id], kv_of(req.all_token_ids[i * BS:(i + 1) * BS])), i


def test_evicted_blocks_come_back_byte_equal_from_the_host_tier():
    cache, bm = setup()
    a = request(range(17))  # 4 full blocks + 1 token
    assert compute(cache, bm, a) == 0
    bm.free(a)
    bm.tiers.flush()
    b = request(range(100, 121), rid="b")  # takes every device block: a's are evicted
    compute(cache, bm, b)
    bm.free(b)
    assert all(bm.lookup(h) is None for h in a.block_hashes)
    again = request(range(17), rid="again")
    assert compute(cache, bm, again) == 16
    assert_blocks_hold_their_kv(cache, again)
    host = bm.tiers.stats()["tiers"]["host"]
    assert host["hits"] == 4 and host["stored"] == 9 and host["bytes_out"] == 4 * BLOCK_BYTES


def test_blocks_go_down_to_disk_and_come_back(tmp_path):
    cache, bm = setup(num_blocks=6, host_blocks=4, disk_blocks=16, disk_path=tmp_path)
    assert os.listdir(tmp_path) == []  # the disk tier's file is unlinked once mapped
    prompts = [request(range(k * 100, k * 100 + 17), rid=str(k)) for k in range(4)]
    for req in prompts:
        compute(cache, bm, req)
        bm.free(req)
    bm.tiers.flush()
    stats = bm.tiers.stats()["tiers"]
    assert stats["host"]["evicted"] == 12 and stats["disk"]["stored"] == 12
    first = request(range(17), rid="first-again")  # on disk only by now
    assert [bm.tiers.find(h, range(i * BS, (i + 1) * BS))[0] for i, h in enumerate(prompts[0].block_hashes)] == [1] * 4
    assert compute(cache, bm, first) == 16
    assert_blocks_hold_their_kv(cache, first)
    assert bm.tiers.stats()["tiers"]["disk"]["hits"] == 4


def test_tenants_never_hit_each_others_blocks_in_a_tier():
    cache, bm = setup()
    a = request(range(17), salt="tenant-a")
    compute(cache, bm, a)
    bm.free(a)
    evict = request(range(100, 117), rid="evict", salt="tenant-a")
    compute(cache, bm, evict)
    bm.free(evict)
    other = request(range(17), salt="tenant-b", rid="b")
    assert compute(cache, bm, other) == 0
    bm.free(other)
    assert bm.tiers.stats()["tiers"]["host"]["hits"] == 0
    assert compute(cache, bm, request(range(17), salt="tenant-a", rid="a2")) == 16


def test_a_pinned_slot_is_never_evicted():
    cache, bm = setup(num_blocks=6, host_blocks=4)
    a = request(range(17))
    compute(cache, bm, a)
    bm.free(a)
    level, slot = bm.tiers.find(a.block_hashes[0], range(BS))
    bm.tiers.pin(level, slot)
    for k in range(1, 4):
        req = request(range(k * 100, k * 100 + 17), rid=str(k))
        compute(cache, bm, req)
        bm.free(req)
    bm.tiers.flush()
    assert bm.tiers.find(a.block_hashes[0], range(BS)) == (level, slot)
    assert bm.tiers.find(a.block_hashes[1], range(BS, 2 * BS)) is None
    bm.tiers.unpin(level, slot)
    req = request(range(900, 917), rid="after")
    compute(cache, bm, req)
    bm.free(req)
    bm.tiers.flush()
    assert bm.tiers.find(a.block_hashes[0], range(BS)) is None


def test_a_block_is_not_rewritten_before_its_demotion_copied_it(monkeypatch):
    """The copier is slowed down: reusing the block waits for it, so the tier holds the old KV."""
    cache, bm = setup(num_blocks=5)
    submit = bm.tiers._copier.submit
    started = threading.Event()

    def slow(job):
        def run():
            started.set()
            time.sleep(0.3)
            job()
        return submit(run)

    monkeypatch.setattr(bm.tiers._copier, "submit", slow)
    a = request(range(17))
    compute(cache, bm, a)
    bm.free(a)
    b = request(range(100, 117), rid="b")
    compute(cache, bm, b)  # overwrites a's blocks as soon as it may
    bm.free(b)
    again = request(range(17), rid="again")
    assert compute(cache, bm, again) == 16
    assert_blocks_hold_their_kv(cache, again)


def test_a_failed_copy_drops_its_entries_and_is_counted(monkeypatch):
    cache, bm = setup()
    submit = bm.tiers._copier.submit

    def failing(job):
        def run():
            raise RuntimeError("copy failed")
        return submit(run)

    monkeypatch.setattr(bm.tiers._copier, "submit", failing)
    a = request(range(17))
    compute(cache, bm, a)
    bm.free(a)
    bm.tiers.flush()
    assert bm.tiers.copy_failures == 4
    assert bm.tiers.stats()["tiers"]["host"]["num_used"] == 0
    events = bm.take_events()
    removed = [h for e in events if e.kind == "removed" and e.tier == "host" for h in e.block_hashes]
    assert sorted(removed) == sorted(a.block_hashes)


def test_events_name_the_tier_and_a_reset_clears_every_tier():
    cache, bm = setup()
    a = request(range(9))
    compute(cache, bm, a)
    bm.free(a)
    events = bm.take_events()
    assert [(e.kind, e.tier, len(e.block_hashes)) for e in events] == [
        ("stored", "device", 2), ("stored", "host", 1), ("stored", "host", 1)]
    assert bm.tier_snapshot() == {"host": list(reversed(a.block_hashes))}
    assert bm.reset_prefix_cache()
    assert [e.kind for e in bm.take_events()] == ["cleared"]
    assert bm.tier_snapshot() == {"host": []}
    assert compute(cache, bm, request(range(9), rid="after-reset")) == 0


def test_promotion_stops_where_free_blocks_run_out():
    cache, bm = setup(num_blocks=6)
    a = request(range(21))  # 5 full blocks
    compute(cache, bm, a)
    bm.free(a)
    holder = request(range(100, 113), rid="holder")  # holds 4 blocks: 2 stay free
    bm.promote(holder)
    assert bm.allocate_slots(holder, 13)
    assert bm.promote(request(range(21), rid="again")) <= bm.num_free_blocks
    bm.free(holder)
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("values, message", [
    ({"host_gb": -1}, "host_gb"), ({"host_gb": float("nan")}, "host_gb"), ({"host_gb": True}, "host_gb"),
    ({"host_gb": 1, "disk_gb": 1}, "disk_path"), ({"disk_gb": 1, "disk_path": "/tmp"}, "host_gb"),
])
def test_bad_tier_sizes_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        KVTiersConfig(**values)


def test_a_tier_too_small_for_one_block_is_refused():
    with pytest.raises(ValueError, match="holds no block"):
        KVTiers(KVTiersConfig(host_gb=1e-9), KVCache(LAYOUT, 4), [])


# ---- through the engine ---------------------------------------------------------------------------

def test_engine_outputs_equal_a_run_that_never_evicted(tiny_llama_dir, tmp_path):
    """Eight 64-token prompts through a cache of 12 blocks: each round evicts the others' prefixes. With tiers,
    the second round finds every prefix block below the cache and computes only the last block of each."""
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 200) for _ in range(64)] for _ in range(8)]
    params = SamplingParams(max_tokens=6, temperature=0)
    roomy = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=256))
    want = [c.token_ids for c in roomy.generate(prompts, params)]
    tiers = KVTiersConfig(host_gb=20 * 8192 / 2**30, disk_gb=0.001, disk_path=str(tmp_path))
    engines = {name: Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=12, kv_tiers=config))
               for name, config in (("tiers", tiers), ("none", None))}
    for engine in engines.values():
        for _ in range(2):
            assert [engine.generate([p], params)[0].token_ids for p in prompts] == want
    with_tiers, without = (engines[name].block_manager for name in ("tiers", "none"))
    assert without.prefix_cache_hits == 0
    assert with_tiers.prefix_cache_hits == 8 * 48  # the second round: 3 of each prompt's 4 blocks
    stats = engines["tiers"].stats()["kv_tiers"]
    assert stats["tiers"]["host"]["hits"] + stats["tiers"]["disk"]["hits"] == 24
    assert stats["tiers"]["disk"]["stored"] > 0 and stats["copy_failures"] == 0
    for engine in engines.values():
        engine.close()


# ---- configuration and metrics ----------------------------------------------------------------------

def test_the_cluster_config_and_flags_give_every_worker_its_tiers(tmp_path, capsys):
    from cluster.cli import build_parser, main
    from cluster.config import ClusterConfig, load_config

    args = build_parser().parse_args(["serve", "--kv-host-gb", "2", "--kv-disk-gb", "8",
                                      "--kv-disk-path", str(tmp_path)])
    config = load_config(None, **{"kv_tiers.host_gb": args.kv_host_gb, "kv_tiers.disk_gb": args.kv_disk_gb,
                                  "kv_tiers.disk_path": args.kv_disk_path})
    for role in ("prefill", "decode"):
        assert config.engine_config(config.decode, role).kv_tiers == KVTiersConfig(2.0, str(tmp_path), 8.0)
    assert ClusterConfig().engine_config(ClusterConfig().decode, "decode").kv_tiers is None  # off by default
    assert main(["serve", "--kv-disk-gb", "1", "--kv-host-gb", "1"]) == 1
    assert "invalid config field 'kv_tiers'" in capsys.readouterr().err
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        ClusterConfig(kv_tiers={"host_gb": 1, "disk_gb": 1, "disk_path": str(file)})
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_tiers=KVTiersConfig(host_gb=1), enable_prefix_caching=False)


def test_tier_series_are_exported_per_worker_and_tier():
    from router.metrics import WorkerStatsCollector
    from worker_runtime.protocol import WorkerLoad, WorkerStats

    cache, bm = setup(host_blocks=4, disk_blocks=8, disk_path="/tmp")
    for req in (request(range(17)), request(range(100, 121), rid="b"), request(range(17), rid="again")):
        compute(cache, bm, req)
        bm.free(req)
        bm.tiers.flush()
    collector = WorkerStatsCollector()
    stats = WorkerStats("decode-1", "decode", kv_tiers=bm.tiers.stats())
    collector.update(stats)
    families = {f.name: f for f in collector.collect()}
    hits = {s.labels["tier"]: s.value for s in families["tandem:kv_tier_hits"].samples}
    assert hits == {"host": 0.0, "disk": 4.0}  # a's blocks went down to disk under b's
    used = {s.labels["tier"]: s.value for s in families["tandem:kv_tier_blocks"].samples}
    assert used == {"host": 4.0, "disk": 8.0}  # a came back up, pushing b down; the disk tier is full
    assert [s.value for s in families["tandem:kv_tier_copy_failures"].samples] == [0.0]
    assert WorkerLoad.reported("decode-1", stats, True).promote_s_per_block > 0  # the prior before any hit
    assert WorkerLoad.reported("decode-1", WorkerStats("decode-1", "decode"), True).promote_s_per_block == 0
