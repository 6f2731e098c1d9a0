"""A worker process killed outright is restarted by Ray (the pool's restart policy) and serves again."""
import asyncio
import os
import signal
import time

import ray

from cluster.config import ClusterConfig
from cluster.health import HealthChanges, observe
from cluster.pools import Pools, WorkerPool
from engine import SamplingParams
from worker_runtime.protocol import GenerateRequest
from router.placement.dispatch import run_request


def pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def health_check(pool: WorkerPool, timeout_s: float) -> HealthChanges:
    """One round of the controller's health check on `pool`."""
    return observe(list(pool.workers.values()), pool.ping(timeout_s))


def test_killed_decode_worker_is_restarted_and_serves_again(ray_cluster, tiny_llama_dir):
    pools = Pools(ClusterConfig(model=tiny_llama_dir, mode="colocated", name="restart",
                                engine={"num_kv_blocks": 32}, decode={"max_restarts": 2}))
    pools.start()
    try:
        info = next(iter(pools.decode.workers.values()))
        old_pid = pid_of(info.actor)
        os.kill(old_pid, signal.SIGKILL)
        assert health_check(pools.decode, timeout_s=2).flipped == {info.worker_id: False}
        deadline = time.monotonic() + 120
        while not (changes := health_check(pools.decode, timeout_s=5)).flipped.get(info.worker_id):
            assert not changes.dead, "a restarting worker must not be replaced"
            assert time.monotonic() < deadline, "worker did not come back"
            time.sleep(0.5)
        assert pid_of(info.actor) != old_pid

        async def one():
            request = GenerateRequest("after-restart", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4))
            return [d async for d in run_request(request, info.actor)]

        deltas = asyncio.run(one())
        assert deltas[-1].finished and sum(len(d.new_token_ids) for d in deltas) == 4
    finally:
        pools.shutdown()
