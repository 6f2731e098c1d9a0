"""Disaggregation through the transports with real engines: prefill on one, KV moved, decode on another."""
from __future__ import annotations

import pytest

from engine import Engine, EngineConfig, SamplingParams
from kv_transfer import KVServerConfig, KVTransferServer
from kv_transfer.dist_client import DistKVClient
from kv_transfer.grpc_client import GrpcKVClient

CLIENTS = {"grpc": GrpcKVClient, "torch_dist": DistKVClient}
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    def make() -> Engine:
        return Engine(EngineConfig(model=tiny_llama_dir, device="cpu", num_kv_blocks=64))
    return make(), make(), make()  # prefill, decode, colocated reference


def prefill_remotely(engine: Engine, request_id: str, prompt: list[int]) -> tuple[list[int], dict, list[int]]:
    """Run a prompt to its first token with the blocks kept for a decode worker (as a prefill worker does)."""
    req = engine.make_request(request_id, prompt, PARAMS)
    req.do_remote_decode = True
    engine.add(req)
    while True:
        for out in engine.step():
            if out.kv_transfer_params is not None:
                return out.new_token_ids, out.kv_transfer_params, req.block_hashes


def disaggregate(prefill: Engine, decode: Engine, server: KVTransferServer, client, request_id: str,
                 prompt: list[int]) -> tuple[list[int], int, list[int]]:
    """Prefill on one engine, pull what decode lacks, decode to the end: (indices pulled, bytes, tokens)."""
    first, params, hashes = prefill_remotely(prefill, request_id, prompt)
    num_full = params["num_tokens"] // prefill.config.block_size
    handle = server.lease(request_id, params["block_ids"], hashes[:num_full], params["num_tokens"],
                          on_release=prefill.block_manager.free_block_ids)
    req = decode.make_request(request_id, prompt, PARAMS)
    req.all_token_ids.extend(first)
    indices = decode.reserve_for_import(req)
    stats = client.pull(handle, [req.block_table[i] for i in indices], indices)
    assert client.release(handle) or stats.path == "shm"  # a same-host copy released it already
    decode.add_imported(req)
    tokens = list(first)
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    return indices, stats.num_bytes, tokens


@pytest.fixture(params=["grpc", "torch_dist"])
def link(request, engines):
    """A KV server on the prefill engine's cache and a client on the decode engine's, for one transport."""
    prefill, decode, _ = engines
    transport = request.param
    server = KVTransferServer(prefill.kv_cache, "t", KVServerConfig(dist=transport == "torch_dist")).start()
    client = CLIENTS[transport](decode.kv_cache, "t")
    yield transport, server, client
    client.close()
    server.stop()


def test_decode_from_transferred_kv_gives_the_same_greedy_tokens(engines, link):
    prefill, decode, reference = engines
    transport, server, client = link
    offset = len(transport)  # a prompt per transport, so that decode has none of it cached
    prompt = [(i * 37 + offset) % 500 + 3 for i in range(45)]  # 2 full blocks and a partial one
    expected = reference.generate([prompt], PARAMS)[0].token_ids
    free_before = prefill.block_manager.num_free_blocks
    indices, _, tokens = disaggregate(prefill, decode, server, client, f"req-{transport}", prompt)
    assert indices == [0, 1, 2]
    assert tokens == expected
    assert prefill.block_manager.num_free_blocks == free_before  # the lease gave every block back


def test_decode_pulls_only_the_blocks_its_prefix_cache_lacks(engines, link):
    prefill, decode, reference = engines
    transport, server, client = link
    shared = [(i * 29 + len(transport)) % 500 + 7 for i in range(32)]  # two full blocks
    first = shared + [11, 12, 13, 14, 15]
    second = shared + [(i * 13) % 500 + 3 for i in range(24)]  # same two blocks, then one full and a partial
    disaggregate(prefill, decode, server, client, f"first-{transport}", first)
    sent_before = server.stats.bytes_sent
    indices, num_bytes, tokens = disaggregate(prefill, decode, server, client, f"second-{transport}", second)
    layout = decode.kv_cache.layout
    assert indices == [2, 3]
    assert num_bytes == server.stats.bytes_sent - sent_before == 2 * 2 * layout.num_layers * \
        layout.bytes_per_block_per_layer
    assert tokens == reference.generate([second], PARAMS)[0].token_ids
