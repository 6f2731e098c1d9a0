"""What `tandem status` shows of one pool: its sizes and, per worker, state, load, KV usage, prefix hit rate
and (decode workers) the KV pulls that fell back to local recompute, per reason."""
from __future__ import annotations

import ray

from cluster.pools import WorkerInfo, WorkerPool


def pool_status(pool: WorkerPool, desired: int) -> dict:
    """The pool's row of the controller's `status()`; workers are asked concurrently, 5 s each at most."""
    workers = list(pool.workers.values())
    refs = [w.actor.stats.remote() if w.ready else None for w in workers]
    transfer = [w.actor.transfer_stats.remote() if w.ready and pool.pool == "decode" else None for w in workers]
    return {"replicas": len(pool.active()), "desired": desired, "min_replicas": pool.pool_config.min_replicas,
            "max_replicas": pool.pool_config.max_replicas,
            "workers": [worker_row(w, ref, transfer_ref) for w, ref, transfer_ref in zip(workers, refs, transfer)]}


def worker_state(w: WorkerInfo) -> str:
    return "starting" if not w.ready else "draining" if w.draining else "healthy" if w.healthy else "unhealthy"


def worker_row(w: WorkerInfo, stats_ref, transfer_ref) -> dict:
    row = {"worker_id": w.worker_id, "state": worker_state(w)}
    if stats_ref is None:
        return row
    try:
        s = ray.get(stats_ref, timeout=5)
        row.update(running=s.num_running, waiting=s.num_waiting, queued_prefill_tokens=s.queued_prefill_tokens,
                   kv_usage=round(s.kv_usage, 4), prefix_cache_queries=s.prefix_cache_queries,
                   prefix_cache_hits=s.prefix_cache_hits,
                   prefix_hit_rate=round(s.prefix_cache_hits / max(s.prefix_cache_queries, 1), 4),
                   tensor_parallel_size=s.tensor_parallel_size, tp_ranks_alive=s.tp_ranks_alive)
        if transfer_ref is not None:
            failures = ray.get(transfer_ref, timeout=5)["transfer_failures_by_reason"]
            row.update(kv_transfer_failures=sum(failures.values()),
                       kv_transfer_failures_by_reason={r: n for r, n in failures.items() if n})
    except ray.exceptions.RayError as exc:
        row["error"] = type(exc).__name__
    return row
