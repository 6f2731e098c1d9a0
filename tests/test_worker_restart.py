"""A worker process killed outright is restarted by Ray (the pool's restart policy) and serves again."""
import asyncio
import os
import signal
import time

import ray

from cluster.config import ClusterConfig
from cluster.pools import Pools
from engine import SamplingParams
from worker_runtime.protocol import GenerateRequest
from router.dispatch import run_request


def pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def test_killed_decode_worker_is_restarted_and_serves_again(ray_cluster, tiny_llama_dir):
    pools = Pools(ClusterConfig(model=tiny_llama_dir, mode="colocated", name="restart",
                                engine={"num_kv_blocks": 32}, decode={"max_restarts": 2}))
    pools.start()
    try:
        info = next(iter(pools.decode.workers.values()))
        old_pid = pid_of(info.actor)
        os.kill(old_pid, signal.SIGKILL)
        assert pools.decode.check_health(timeout_s=2)[info.worker_id] is False
        deadline = time.monotonic() + 120
        while not pools.decode.check_health(timeout_s=5)[info.worker_id]:
            assert not info.dead, "a restarting worker must not be replaced"
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
