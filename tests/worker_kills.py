"""Killing a worker's real process at a chosen point: freeze it there (a hook that never returns), then
SIGKILL it. Shared by tests/test_worker_faults.py and tests/test_peer_prefix.py."""
from __future__ import annotations

import functools
import os
import signal
import threading

import ray

from tests import helpers

# Workers restart after kills: a state takes far longer to come about than in other tests.
wait_for = functools.partial(helpers.wait_for, timeout_s=180.0, interval_s=0.1)


def pid_of(handle) -> int:
    return ray.get(handle.__ray_call__.remote(lambda worker: os.getpid()), timeout=120)


def freeze_kv_export(worker) -> None:
    """In a worker that exports KV (a prefill worker's prompt, or any worker's prefix leased to a peer): the
    first KV chunk a puller asks for is never sent, and (a puller on this host copies from the shared cache)
    the lease release that confirms a copy never answers; either way the pull stays open."""
    worker.frozen = threading.Event()

    def freeze(*args, **kwargs):
        worker.frozen.set()
        threading.Event().wait()

    worker.kv_server.export.export_chunk = freeze
    worker.kv_server.leases.release = freeze


def kill_when_frozen(handle) -> None:
    """SIGKILL the worker's process once it froze (it answers calls while its engine loop is blocked)."""
    pid = pid_of(handle)
    frozen = wait_for(lambda: ray.get(handle.__ray_call__.remote(lambda worker: worker.frozen.is_set()), timeout=30))
    os.kill(pid, signal.SIGKILL)  # frozen or not: a worker left with its freeze hook would hang the tests after it
    assert frozen, "the worker's engine loop never reached the freeze point"
