"""The pieces under the KV transports: generated stubs, chunk plans, block export/import, wire codec, leases."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.kv_cache import KVCache, KVLayout
from kv_transfer import chunks
from kv_transfer.chunks import ChunkSpec, coalesced, host_bytes, plan_chunks, read_chunk, write_chunk
from kv_transfer.lease import LeaseTable
from kv_transfer.wire import decode_chunk, encode_chunk
from protos import generate
from protos import kv_transfer_pb2 as pb

LAYOUT = KVLayout("tiny", "float32", 16, 6, 2, 8)
BLOCK_LAYER = 2 * LAYOUT.bytes_per_block_per_layer  # K+V of one block in one layer


def test_committed_stubs_match_the_proto():
    assert generate.stale_stubs() == [], "run `make protos` and commit the result"


@pytest.mark.parametrize("num_blocks,max_chunk_bytes", [(1, 1 << 20), (10, 3 * 10 * BLOCK_LAYER), (10, 3 * BLOCK_LAYER),
                                                        (7, 1), (128, 4 << 20)])
def test_chunk_plan_covers_every_block_layer_once_within_the_limit(num_blocks, max_chunk_bytes):
    plan = plan_chunks(LAYOUT, num_blocks, 1, 6, max_chunk_bytes)
    covered = [(layer, b) for s in plan for layer in range(s.layer_start, s.layer_end)
               for b in range(s.block_start, s.block_end)]
    assert sorted(covered) == [(layer, b) for layer in range(1, 6) for b in range(num_blocks)]
    assert len(covered) == len(set(covered))
    assert all(s.num_bytes(LAYOUT) <= max(max_chunk_bytes, BLOCK_LAYER) for s in plan)
    assert [s.layer_start for s in plan] == sorted(s.layer_start for s in plan)  # early layers first


def test_small_pulls_group_layers_and_large_ones_split_blocks():
    assert plan_chunks(LAYOUT, 2, 0, 6, 3 * 2 * BLOCK_LAYER) == [ChunkSpec(0, 3, 0, 2), ChunkSpec(3, 6, 0, 2)]
    assert plan_chunks(LAYOUT, 4, 0, 1, 2 * BLOCK_LAYER) == [ChunkSpec(0, 1, 0, 2), ChunkSpec(0, 1, 2, 4)]


@pytest.fixture(params=["coalesced", "per segment"])
def coalescing(request, monkeypatch) -> str:
    """Every chunk moves as one buffer, or none does (the tiny test layout would otherwise always coalesce)."""
    monkeypatch.setattr(chunks, "COALESCE_BELOW_BYTES", 1 << 40 if request.param == "coalesced" else 0)
    return request.param


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_export_then_import_copies_blocks_exactly(dtype, coalescing):
    layout = KVLayout("tiny", dtype, 16, 6, 2, 8)
    src, gen = KVCache(layout, 16), torch.Generator().manual_seed(0)
    for t in src.k + src.v:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    spec = ChunkSpec(2, 5, 0, 3)
    for src_ids, dst_ids in [([4, 5, 6], [9, 10, 11]), ([7, 1, 3], [0, 12, 5]), ([4, 5, 6], [0, 12, 5]),
                             ([7, 1, 3], [9, 10, 11])]:
        dst = KVCache(layout, 16)
        segments = read_chunk(src, src_ids, spec)
        assert len(segments) == (1 if coalescing == "coalesced" else 2 * spec.num_layers)
        payload = torch.cat([s.reshape(-1) for s in segments])
        assert payload.numel() * payload.element_size() == spec.num_bytes(layout)
        write_chunk(dst, dst_ids, spec, payload)
        for layer in range(2, 5):
            assert torch.equal(dst.k[layer][dst_ids], src.k[layer][src_ids])
            assert torch.equal(dst.v[layer][dst_ids], src.v[layer][src_ids])
        assert not dst.k[0].any() and not dst.k[5].any()  # layers outside the chunk are untouched


def test_consecutive_blocks_are_exported_as_cache_views_without_a_copy(monkeypatch):
    monkeypatch.setattr(chunks, "COALESCE_BELOW_BYTES", 0)
    cache = KVCache(LAYOUT, 16)
    segments = read_chunk(cache, [3, 4, 5], ChunkSpec(0, 2, 0, 3))
    assert [s.data_ptr() for s in segments] == [cache.k[0][3].data_ptr(), cache.v[0][3].data_ptr(),
                                                cache.k[1][3].data_ptr(), cache.v[1][3].data_ptr()]


def test_chunks_of_small_segments_move_as_one_buffer():
    big = KVLayout("big", "float32", 16, 30, 3, 64)  # 12 KiB per block and layer
    assert coalesced(big, ChunkSpec(0, 30, 0, 5)) and not coalesced(big, ChunkSpec(0, 10, 0, 16))
    cache = KVCache(LAYOUT, 16)
    for t in cache.k + cache.v:
        t.normal_()
    spec = ChunkSpec(1, 4, 0, 3)
    [buffer] = read_chunk(cache, [3, 4, 5], spec)
    assert buffer.is_contiguous() and buffer.numel() * buffer.element_size() == spec.num_bytes(LAYOUT)
    expected = torch.cat([t[3:6].reshape(-1) for layer in range(1, 4) for t in (cache.k[layer], cache.v[layer])])
    assert torch.equal(buffer.reshape(-1), expected)  # wire order: K then V of each layer


def test_chunk_codec_is_plain_protobuf_both_ways():
    header = pb.ChunkHeader(layer_start=1, layer_end=2, block_start=0, block_end=3, num_bytes=80, xxh3_64=7)
    parts = [torch.arange(10, dtype=torch.float32), torch.arange(10, 20, dtype=torch.float32)]
    data = b"".join(host_bytes(p).tobytes() for p in parts)
    encoded = encode_chunk(header, [host_bytes(p) for p in parts])
    assert encoded == pb.KVChunk(header=header, data=data).SerializeToString()
    decoded_header, payload = decode_chunk(pb.KVChunk(header=header, data=data).SerializeToString())
    assert decoded_header == header and bytes(payload) == data
    with pytest.raises(ValueError):
        decode_chunk(encoded[:-5])


def test_lease_released_during_a_pull_hands_blocks_back_when_the_pull_ends():
    table = LeaseTable(num_layers=2, default_ttl=60)
    released = []
    table.add("r", [1, 2], [], 32, released.append)
    lease = table.begin_pull("r")
    assert table.release("r") is True
    assert released == []  # still being read
    table.end_pull(lease)
    assert released == [[1, 2]]
    table.close()


def test_lease_being_pulled_does_not_expire():
    table = LeaseTable(num_layers=2, default_ttl=60)
    released = threading.Event()
    lease = table.add("r", [1], [], 16, lambda ids: released.set())
    assert table.begin_pull("r") is lease
    lease.ttl, lease.expires_at = 0.05, time.monotonic()  # its TTL runs out while the pull reads it
    table.wake()  # the reaper looks again
    assert not released.wait(0.3)
    table.end_pull(lease)  # the TTL restarts now
    assert released.wait(10)
    table.close()


def test_waiting_for_layers_ends_when_they_are_marked_ready_or_the_lease_is_released():
    table = LeaseTable(num_layers=4, default_ttl=60)
    lease = table.add("r", [1], [], 16, lambda ids: None, layers_ready=1)
    threading.Timer(0.05, table.mark_layers_ready, ("r", 3)).start()
    assert table.wait_layers(lease, 3, deadline=float("inf")) is True
    threading.Timer(0.05, table.release, ("r",)).start()
    assert table.wait_layers(lease, 4, deadline=float("inf")) is False
    table.close()


def test_closing_the_table_releases_every_lease():
    table = LeaseTable(num_layers=2, default_ttl=60)
    released = []
    table.add("a", [1], [], 16, released.append)
    table.add("b", [2, 3], [], 32, released.append)
    table.close()
    assert sorted(released) == [[1], [2, 3]]
