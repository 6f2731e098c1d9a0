"""CPU lending as placement sees it: on a CPU node the decode workers lend their cores to the node's
prefill workers while their batch is empty (worker_runtime/cpu_cores.py), so a prefill worker's speed
depends on which decode workers are idle right now. The router's live loads say so sooner than any
worker's stats."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.step_costs import StepCosts
from worker_runtime.protocol import WorkerLoad


def lent_threads(prefill: WorkerLoad, decode_loads: Sequence[WorkerLoad]) -> WorkerLoad:
    """`prefill` with `borrow_threads_now`: its own threads plus those of every idle lending decode worker
    on its node, from the router's live loads. A decode worker's stats snapshot goes stale as soon as its
    batch empties or fills, and a prefill worker's report of what is lent dates from its last stats poll,
    which, under a steady trickle of requests, always finds the decode worker busy with the previous one."""
    costs = prefill.step_costs
    if not (costs.borrows and costs.cpu_node):
        return prefill
    lent = sum(d.step_costs.lend_threads for d in decode_loads if _lends_now(d, costs))
    return dataclasses.replace(prefill, borrow_threads_now=costs.own_threads + lent if lent else 0)


def lent_to_busy_prefill(decode: WorkerLoad, prefill: WorkerLoad) -> bool:
    """Whether `decode` lends its cores to `prefill` and that one is computing a prompt now, so a forward
    of its own would share its cores with a borrowed one."""
    costs = prefill.step_costs
    return bool(costs.borrows and costs.cpu_node and decode.step_costs.lend_threads and _lends_now(decode, costs)
                and (prefill.num_running or prefill.queued_prefill_tokens))


def _lends_now(decode: WorkerLoad, borrower: StepCosts) -> bool:
    """Whether `decode`'s cores are lent to workers of `borrower`'s node right now: it is there, healthy and idle."""
    return decode.step_costs.cpu_node == borrower.cpu_node and decode.healthy and decode.idle
