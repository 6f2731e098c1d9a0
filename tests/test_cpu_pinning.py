"""On CPU, real prefill and decode workers are pinned to cores of their own, run the threads their cores
imply, a prefill borrows the idle decode worker's cores (and only while it is idle), and a decode step the
idle prefill worker's (and only while that has no prompt)."""
import asyncio

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.pools import Pools
from engine import SamplingParams
from worker_runtime.cpu_cores import node_cores
from worker_runtime.protocol import GenerateRequest
from tests.helpers import wait_for
from tests.pool_helpers import collect, only, run_all

pytestmark = pytest.mark.skipif(len(node_cores()) < 2, reason="pinning two workers apart needs two cores")


@pytest.fixture(scope="module")
def pools(ray_cluster, tiny_llama_dir):
    config = ClusterConfig(model=tiny_llama_dir, name="pinning", engine={"num_kv_blocks": 256},
                           cpu={"decode_borrows": True, "lend_busy_ms": 0},  # decode lends only while idle
                           prefill={"resources": {"prefill_pool": 1}, "num_cpus": 1},
                           decode={"resources": {"decode_pool": 1}, "num_cpus": 1})
    pools = Pools(config)
    pools.start()
    yield pools
    pools.shutdown()


def placement(actor) -> dict:
    return ray.get(actor.cpu_placement.remote())


def test_workers_are_pinned_to_disjoint_cores_with_one_thread_per_core(pools):
    prefill, decode = placement(only(pools.prefill)), placement(only(pools.decode))
    assert len(prefill["cores"]) == len(decode["cores"]) == 1
    assert not set(prefill["cores"]) & set(decode["cores"])
    for worker in (prefill, decode):
        assert worker["affinity"] == worker["cores"]
        assert worker["torch_threads"] == worker["threads"] == 1


def test_prefill_borrows_the_idle_decode_workers_core_and_gives_it_back(pools):
    prefill, decode = only(pools.prefill), only(pools.decode)
    assert wait_for(lambda: placement(decode)["lending"])
    before = placement(prefill)["borrowing_steps"]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    run_all([GenerateRequest("borrow-idle", list(range(10, 90)), params)], decode, prefill)
    # Idle again: the loop gives the borrowed core back when it next finds no work, just after the last
    # output left; so did the affinity and the threads.
    assert wait_for(lambda: placement(prefill)["borrowed"] == [])
    after = placement(prefill)
    assert after["borrowing_steps"] > before
    assert after["last_step_threads"] == 2
    assert after["affinity"] == after["cores"] and after["torch_threads"] == 1
    # Placement reads from the stats what borrowing buys: the borrowed steps' speed, measured apart, and
    # the threads a forward would get now (the decode worker still lends its core).
    costs = ray.get(prefill.stats.remote()).step_costs
    assert costs.borrowed_prefill_tokens_per_s and costs.own_threads == 1 and costs.borrow_threads == 2


def test_decode_borrows_the_idle_prefill_workers_core_and_gives_it_back(pools):
    prefill, decode = only(pools.prefill), only(pools.decode)
    assert wait_for(lambda: placement(prefill)["lending"])
    before = placement(decode)["borrowing_steps"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (tokens, _), = run_all([GenerateRequest("decode-borrows", list(range(10, 40)), params)], decode, prefill)
    assert len(tokens) == 24
    # Idle again (the loop gives the core back when it next finds no work, just after the last output left):
    # the borrowed core went back, and so did the affinity and the threads.
    assert wait_for(lambda: placement(decode)["borrowed"] == [])
    after = placement(decode)
    assert after["borrowing_steps"] > before  # its steps ran on the idle prefill worker's core as well
    assert after["affinity"] == after["cores"] and after["torch_threads"] == 1


def test_prefill_keeps_to_its_own_core_while_decode_runs(pools):
    prefill, decode = only(pools.prefill), only(pools.decode)
    long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)

    async def main():
        streams = [asyncio.ensure_future(collect(GenerateRequest(f"busy-{i}", [5 + i] * 8, long), decode))
                   for i in range(4)]
        try:
            assert await asyncio.to_thread(wait_for, lambda: not placement(decode)["lending"], interval_s=0.01)
            own = placement(prefill)["cores"]
            # decode runs on the idle prefill core too
            assert await asyncio.to_thread(wait_for, lambda: placement(decode)["borrowed"] == own, interval_s=0.01)
            await prefill.prefill.remote(GenerateRequest("while-busy", list(range(100, 180)),
                                                         SamplingParams(temperature=0.0, max_tokens=1)))
            return placement(prefill), placement(decode), (await prefill.stats.remote()).step_costs
        finally:
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)

    prefill_after, decode_after, costs = asyncio.run(main())
    assert not decode_after["lending"]  # decode was still running when the prefill finished
    assert prefill_after["last_step_threads"] == 1
    assert costs.borrow_threads == 0  # nothing lent: placement predicts the prefill worker's own speed
