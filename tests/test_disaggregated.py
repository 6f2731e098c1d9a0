"""Disaggregated prefill/decode on a real (simulated two-node) Ray cluster with real actors and gRPC."""
import asyncio
import dataclasses
import os
import random
import socket
import time

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.pools import Pools
from engine import SamplingParams
from engine.kv_cache import KVCache
from worker_runtime.protocol import GenerateRequest
from kv_transfer import KVServerConfig, KVTransferServer
from router.placement.dispatch import run_request
from tests.hf_reference import hf_greedy
from tests.helpers import wait_for
from tests.pool_helpers import close_after, only, placed, run_all

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def pools(ray_cluster, tiny_llama_dir):
    config = ClusterConfig(model=tiny_llama_dir, engine={"num_kv_blocks": 96, "max_num_batched_tokens": 64},
                           prefill={"resources": {"prefill_pool": 1}, "num_cpus": 1},
                           decode={"resources": {"decode_pool": 1}, "num_cpus": 1},
                           transfer={"lease_ttl_s": 20})
    pools = Pools(config)
    pools.start()
    yield pools
    pools.shutdown()


@pytest.fixture(scope="module")
def colocated(ray_cluster, tiny_llama_dir):
    pools = Pools(ClusterConfig(model=tiny_llama_dir, mode="colocated", name="coloc", engine={"num_kv_blocks": 96}))
    pools.start()
    yield pools
    pools.shutdown()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def test_disaggregated_equals_colocated_and_hf_for_concurrent_requests(pools, colocated, tiny_llama_dir):
    batch = prompts(6, seed=0)
    disagg = run_all([GenerateRequest(f"d{i}", p, GREEDY) for i, p in enumerate(batch)],
                     only(pools.decode), only(pools.prefill))
    coloc = run_all([GenerateRequest(f"c{i}", p, GREEDY) for i, p in enumerate(batch)], only(colocated.decode))
    for prompt, (d_tokens, _), (c_tokens, _) in zip(batch, disagg, coloc):
        assert d_tokens == c_tokens == hf_greedy(tiny_llama_dir, prompt, GREEDY.max_tokens)
    stats = ray.get(only(pools.decode).transfer_stats.remote())
    assert stats["remote_prefills"] >= 6
    assert stats["transfer_failures"] == 0 and not any(stats["transfer_failures_by_reason"].values())
    # one host: every pull copied from the prefill worker's shared cache, none had to fall back to gRPC
    assert stats["shm_pulls"] == stats["remote_prefills"] and stats["shm_unavailable"] == 0


def test_a_seeded_request_samples_the_same_tokens_disaggregated_and_colocated(pools, colocated):
    """The prefill worker draws the first token; decode's generator skips that draw, not repeats it."""
    batch = prompts(4, seed=3)
    params = [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=12, ignore_eos=True) for i in range(4)]
    disagg = run_all([GenerateRequest(f"ds{i}", p, params[i]) for i, p in enumerate(batch)],
                     only(pools.decode), only(pools.prefill))
    coloc = run_all([GenerateRequest(f"cs{i}", p, params[i]) for i, p in enumerate(batch)], only(colocated.decode))
    assert [tokens for tokens, _ in disagg] == [tokens for tokens, _ in coloc]
    assert all(len(set(tokens)) > 3 for tokens, _ in disagg)  # really sampled


def test_workers_run_with_few_malloc_arenas(pools):
    """KV messages warm one arena for good, not one per pool thread (see cluster/pools.py)."""
    for pool in (pools.prefill, pools.decode):
        env = ray.get(only(pool).__ray_call__.remote(lambda self: os.environ.get("MALLOC_ARENA_MAX")))
        assert env == "2"


def test_first_token_arrives_while_decode_is_still_running(pools):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    decode = only(pools.decode)

    async def main():
        stream = run_request(placed(GenerateRequest("stream-1", prompts(1, seed=1)[0], params), True), decode,
                             only(pools.prefill))
        first = await stream.__anext__()
        first_received = time.time()
        rest = [d async for d in stream]
        return first, first_received, rest

    first, first_received, rest = asyncio.run(main())
    assert len(first.new_token_ids) == 1 and not first.finished
    assert rest[-1].finished and sum(len(d.new_token_ids) for d in rest) == 199
    assert first_received < rest[-1].times["finished"]
    assert len(rest) > 10  # tokens arrive as they are made, not in one piece


def test_abort_mid_stream_returns_blocks_to_baseline_on_both_workers(pools):
    prefill, decode = only(pools.prefill), only(pools.decode)
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)

    async def main():
        stream = run_request(placed(GenerateRequest("abort-1", prompts(1, seed=2)[0], params), True), decode, prefill)
        await close_after(stream, 5)

    asyncio.run(main())
    assert wait_for(lambda: ray.get(decode.stats.remote()).num_active_blocks == 0)
    assert wait_for(lambda: ray.get(prefill.stats.remote()).num_active_blocks == 0)
    assert ray.get(prefill.num_leases.remote()) == 0
    assert ray.get(decode.num_in_flight.remote()) == 0


def test_pools_are_placed_on_their_own_nodes(pools):
    def node_of(actor):
        return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))

    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    prefill_node, decode_node = node_of(only(pools.prefill)), node_of(only(pools.decode))
    assert prefill_node != decode_node
    assert "prefill_pool" in nodes[prefill_node] and "decode_pool" in nodes[decode_node]


def test_decode_worker_with_warm_prefix_pulls_fewer_blocks(pools):
    prefill, decode = only(pools.prefill), only(pools.decode)
    rng = random.Random(7)
    shared = [rng.randrange(3, 1000) for _ in range(64)]
    before = ray.get(decode.transfer_stats.remote())
    run_all([GenerateRequest("warm-1", shared + [5, 6, 7], GREEDY)], decode, prefill)
    middle = ray.get(decode.transfer_stats.remote())
    run_all([GenerateRequest("warm-2", shared + [8, 9, 10, 11], GREEDY)], decode, prefill)
    after = ray.get(decode.transfer_stats.remote())
    cold_pulled = middle["blocks_pulled"] - before["blocks_pulled"]
    warm_pulled = after["blocks_pulled"] - middle["blocks_pulled"]
    assert cold_pulled == 5
    assert warm_pulled == 1
    assert after["blocks_reused"] - middle["blocks_reused"] == 4
    assert after["bytes_pulled"] - middle["bytes_pulled"] < middle["bytes_pulled"] - before["bytes_pulled"]


def test_decode_without_prefill_worker_prefills_locally(pools, tiny_llama_dir):
    decode = only(pools.decode)
    prompt = prompts(1, seed=9)[0]
    before = ray.get(decode.transfer_stats.remote())["local_prefills"]
    [(tokens, _)] = run_all([GenerateRequest("local-1", prompt, GREEDY)], decode, None)
    assert tokens == hf_greedy(tiny_llama_dir, prompt, GREEDY.max_tokens)
    assert ray.get(decode.transfer_stats.remote())["local_prefills"] == before + 1


def test_a_worker_shutting_down_answers_engine_stopped_to_the_router(colocated):
    """The router polls workers the controller is removing; their answer must read as "going away"
    (EngineStopped, routed around quietly), not as a bug in the worker."""
    from worker_runtime.engine_loop import EngineStopped

    info = colocated.decode.scale_up(1)[0]
    try:
        colocated.decode.wait_ready([info])
        ray.get(info.actor.shutdown.remote())
        for call in (info.actor.stats.remote(), info.actor.kv_events.remote(-1, 0.0)):
            with pytest.raises(EngineStopped):
                ray.get(call, timeout=30)
    finally:
        colocated.decode.remove(info.worker_id)


# ---- a failed pull falls back to local recompute, and is counted by reason --------------------------------

def run_with_handle(prefill, decode, request: GenerateRequest, edit) -> list[int]:
    """Prefill on the real worker, give decode `edit(handle)` instead of the real handle, and return all the
    request's tokens; the real lease is released after."""
    async def main():
        result = await prefill.prefill.remote(request)
        try:
            result.kv_handle = await edit(result.kv_handle)
            tokens = list(result.first.new_token_ids)
            async for ref in decode.generate.options(num_returns="streaming").remote(request, result):
                tokens += (await ref).new_token_ids
            return tokens
        finally:
            await prefill.release.remote(request.request_id)
    return asyncio.run(main())


def failures_after(pools, run) -> tuple[dict[str, int], int]:
    """Run `run()`; the growth of the decode worker's failures per reason, and of its local prefills."""
    decode = only(pools.decode)
    before = ray.get(decode.transfer_stats.remote())
    run()
    after = ray.get(decode.transfer_stats.remote())
    grown = {reason: n - before["transfer_failures_by_reason"][reason]
             for reason, n in after["transfer_failures_by_reason"].items()}
    assert after["transfer_failures"] - before["transfer_failures"] == sum(grown.values())
    return {reason: n for reason, n in grown.items() if n}, after["local_prefills"] - before["local_prefills"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_handle_pointing_at_a_dead_port_is_recomputed_and_counted_unreachable(pools, tiny_llama_dir):
    dead = f"127.0.0.1:{closed_port()}"
    batch = prompts(2, seed=11)

    async def to_dead_port(handle):
        return dataclasses.replace(handle, address=dead)

    def run():
        for i, prompt in enumerate(batch):  # the second failure from the same peer is counted, not logged
            tokens = run_with_handle(only(pools.prefill), only(pools.decode),
                                     GenerateRequest(f"dead-{i}", prompt, GREEDY), to_dead_port)
            assert tokens == hf_greedy(tiny_llama_dir, prompt, GREEDY.max_tokens)

    assert failures_after(pools, run) == ({"unreachable": 2}, 2)


def test_an_expired_lease_is_recomputed_and_counted_lease_expired(pools, tiny_llama_dir):
    prefill, prompt = only(pools.prefill), prompts(1, seed=12)[0]

    async def released_first(handle):
        await prefill.release.remote(handle.request_id)
        return handle

    def run():
        tokens = run_with_handle(prefill, only(pools.decode), GenerateRequest("expired-1", prompt, GREEDY),
                                 released_first)
        assert tokens == hf_greedy(tiny_llama_dir, prompt, GREEDY.max_tokens)

    assert failures_after(pools, run) == ({"lease_expired": 1}, 1)


def test_a_server_refusing_the_token_is_recomputed_and_counted_unauthenticated(pools, tiny_llama_dir):
    prompt, servers = prompts(1, seed=13)[0], []

    async def to_a_stranger(handle):
        servers.append(KVTransferServer(KVCache(handle.layout, 8), "another-clusters-token",
                                        KVServerConfig()).start())
        return dataclasses.replace(handle, address=servers[0].address)

    def run():
        tokens = run_with_handle(only(pools.prefill), only(pools.decode),
                                 GenerateRequest("stranger-1", prompt, GREEDY), to_a_stranger)
        assert tokens == hf_greedy(tiny_llama_dir, prompt, GREEDY.max_tokens)

    try:
        assert failures_after(pools, run) == ({"unauthenticated": 1}, 1)
    finally:
        for server in servers:
            server.stop()


# ---- what a prefill worker advertises --------------------------------------------------------------------

def test_a_prefill_worker_advertises_its_ray_node_ip_by_default(pools):
    address, node_ip = ray.get(only(pools.prefill).__ray_call__.remote(
        lambda self: (self.kv_server.address, ray.util.get_node_ip_address())))
    assert address.rsplit(":", 1)[0] == node_ip


def test_the_workers_environment_overrides_the_advertised_host_and_decode_pulls_from_it(pools, tiny_llama_dir):
    from prefill_workers.worker import PrefillWorker

    pool = pools.prefill
    env = {"TANDEM_KV_ADVERTISE_HOST": "localhost", "TANDEM_KV_BIND_HOST": "127.0.0.1"}
    prefill = ray.remote(PrefillWorker).options(num_cpus=0.5, resources={"prefill_pool": 1},
                                               runtime_env={"env_vars": env}).remote(
        "prefill-env", pool.config.engine_config(pool.pool_config), pool.transfer)
    prompt, decode = prompts(1, seed=14)[0], only(pools.decode)
    try:
        handles = []

        async def keep(handle):
            handles.append(handle)
            return handle

        def run():
            tokens = run_with_handle(prefill, decode, GenerateRequest("env-1", prompt, GREEDY), keep)
            assert tokens == hf_greedy(tiny_llama_dir, prompt, GREEDY.max_tokens)

        before = ray.get(decode.transfer_stats.remote())["remote_prefills"]
        assert failures_after(pools, run) == ({}, 0)
        assert ray.get(decode.transfer_stats.remote())["remote_prefills"] == before + 1
        assert handles[0].address.startswith("localhost:")
    finally:
        ray.get(prefill.shutdown.remote())
        ray.kill(prefill)
