"""One ingress replica's view of its workers: load between stats polls, and workers going away."""
import asyncio
import logging
import random
import threading
import time

import pytest

from router.metrics import Metrics
from worker_runtime.engine_loop import EngineLoop, EngineStopped
from engine.hashing import block_hashes
from engine.kv_events import KVEvent, KVEventBatch
from worker_runtime.protocol import WorkerStats
from router.placement.index import PrefixIndex
from router.placement.routing import Placement, RouteDecision, Router
from router.placement.worker_view import WorkerState, WorkerView
from worker_runtime.membership import WorkerEntry

BLOCK = 16
PROMPT = list(range(100, 140))  # two full blocks and a partial one


def view_with(*workers: str) -> WorkerView:
    view = WorkerView(controller=None, router=Router(PrefixIndex(), BLOCK, rng=random.Random(0)), metrics=Metrics(), colocated=False)
    for worker_id in workers:
        view.workers[worker_id] = WorkerState(WorkerEntry(worker_id, "decode", actor=None, healthy=True,
                                                             draining=False))
        view.workers[worker_id].report(WorkerStats(worker_id, "decode", num_total_blocks=64), time.monotonic())
    return view


def poll(view: WorkerView, worker_id: str, **counters) -> None:
    """A stats report asked for now, as `_poll_stats` takes it."""
    view.workers[worker_id].report(WorkerStats(worker_id, "decode", num_total_blocks=64, **counters),
                                   time.monotonic())


def test_a_worker_that_just_finished_a_request_does_not_look_busy_until_the_next_poll():
    view = view_with("decode-0", "decode-1")
    view.index.apply(KVEventBatch("decode-0", 0, [KVEvent("stored", block_hashes(PROMPT, BLOCK))]))
    first = view.route(block_hashes(PROMPT, BLOCK), len(PROMPT))
    assert first.decode.worker_id == "decode-0" and first.decode.cached_tokens == 32
    view.begin(first, "r1", len(PROMPT))
    poll(view, "decode-0", num_running=1)  # asked while r1 runs
    assert view.workers["decode-0"].load().num_running == 1
    view.end(first, "r1")
    assert view.workers["decode-0"].load().num_running == 0
    # So the repeat goes where its blocks are, not to the idle worker that caches nothing.
    assert view.route(block_hashes(PROMPT, BLOCK), len(PROMPT)).decode.worker_id == "decode-0"
    poll(view, "decode-0", num_running=0)  # the next report no longer counts r1; nothing is subtracted twice
    assert view.workers["decode-0"].ended == []
    view.begin(first, "r2", len(PROMPT))
    assert view.workers["decode-0"].load().num_running == 1


def test_a_request_routed_after_the_report_is_counted_once_and_forgotten_at_its_end():
    view = view_with("decode-0")
    poll(view, "decode-0", num_running=2)  # two requests from another replica
    decision = view.route([], 8)
    view.begin(decision, "mine", 8)
    assert view.workers["decode-0"].load().num_running == 3
    view.end(decision, "mine")  # the report never counted it: nothing to subtract
    assert view.workers["decode-0"].load().num_running == 2


def test_saturated_once_every_path_has_prompts_queued_on_it():
    """The ingress queue's signal: every decode worker has prompts waiting and every prefill worker's queue
    is full (max_prefill_queue_size, 2 by default); a colocated cluster needs the first alone."""
    view = view_with("decode-0", "decode-1")
    view.workers["prefill-0"] = WorkerState(WorkerEntry("prefill-0", "prefill", actor=None, healthy=True,
                                                        draining=False))

    def report(worker_id: str, pool: str, waiting: int) -> None:
        view.workers[worker_id].report(WorkerStats(worker_id, pool, num_total_blocks=64, num_waiting=waiting),
                                       time.monotonic())

    report("prefill-0", "prefill", 2)
    report("decode-0", "decode", 1)
    assert not view.saturated()  # decode-1 can begin a prompt now
    report("decode-1", "decode", 3)
    assert view.saturated()
    report("prefill-0", "prefill", 1)
    assert not view.saturated()  # the prefill queue has room
    view.begin(RouteDecision(Placement("decode-0", 0, 0.0), Placement("prefill-0", 0, 0.0), "test"), "r1", 40)
    assert view.saturated()  # routed since the report: counted as queued there
    view.colocated = True
    report("prefill-0", "prefill", 0)
    assert view.saturated()  # no prefill path to wait for
    report("decode-1", "decode", 0)
    assert not view.saturated()
    view.workers["decode-1"].entry = WorkerEntry("decode-1", "decode", actor=None, healthy=True, draining=True)
    assert view.saturated()  # a draining worker takes nothing: the others decide
    view.workers["decode-0"].entry = WorkerEntry("decode-0", "decode", actor=None, healthy=False, draining=False)
    assert not view.saturated()  # no schedulable decode worker: routing waits for one on its own terms


def test_would_wait_previews_the_placement_only_when_a_prefill_queue_is_full():
    """The ingress asks each request whether it would wait for a prefill slot; only a full prefill queue can make
    it, so otherwise the placement's preview (the cost model for every worker) is skipped."""
    from router.placement.request_router import RequestRouter

    view = view_with("decode-0")
    view.workers["prefill-0"] = WorkerState(WorkerEntry("prefill-0", "prefill", actor=None, healthy=True,
                                                        draining=False))
    router = RequestRouter.__new__(RequestRouter)
    router.view, router.slot_waiters = view, {}
    previews = []
    real = view.preview
    view.preview = lambda *args, **kwargs: previews.append(1) or real(*args, **kwargs)

    def report(waiting: int) -> None:
        view.workers["prefill-0"].report(WorkerStats("prefill-0", "prefill", num_total_blocks=64,
                                                     num_waiting=waiting), time.monotonic())

    report(1)
    assert not router.would_wait(block_hashes(PROMPT, BLOCK), len(PROMPT), 0, 0.0, 16) and previews == []
    report(2)  # full (max_prefill_queue_size 2): the placement decides
    router.would_wait(block_hashes(PROMPT, BLOCK), len(PROMPT), 0, 0.0, 16)
    assert previews == [1]
    report(0)
    router.slot_waiters["other"] = ("prefill-0", 40, 0)  # a waiter ahead: the placement decides
    router.would_wait(block_hashes(PROMPT, BLOCK), len(PROMPT), 0, 0.0, 16)
    assert previews == [1, 1]


def test_a_request_that_goes_ahead_is_not_held_back_by_a_full_prefill_queue():
    """GenerateRequest.ahead: it will take the front of the prefill worker's queue, so the queue's length does not
    make it wait for a slot nor send it elsewhere."""
    view = view_with("decode-0")
    view.workers["prefill-0"] = WorkerState(WorkerEntry("prefill-0", "prefill", actor=None, healthy=True,
                                                        draining=False))
    view.workers["prefill-0"].report(WorkerStats("prefill-0", "prefill", num_total_blocks=64, num_waiting=2),
                                     time.monotonic())
    poll(view, "decode-0", num_running=8, num_waiting=1)
    held = view.route(block_hashes(PROMPT, BLOCK), len(PROMPT))
    assert held.reason in ("prefill_queue_full", "ttft_slo_missed_either_way"), held.reason
    ahead = view.route(block_hashes(PROMPT, BLOCK), len(PROMPT), ahead=True)
    assert not ahead.wait and ahead.prefill is not None and ahead.prefill.worker_id == "prefill-0", ahead.reason
    assert view.workers["prefill-0"].load().num_waiting == 2  # the worker's load itself is untouched


def test_a_worker_shutting_down_is_routed_around_without_an_error_log(caplog):
    view = view_with("decode-0", "decode-1")
    view.index.apply(KVEventBatch("decode-0", 0, [KVEvent("stored", block_hashes(PROMPT, BLOCK))]))
    with caplog.at_level(logging.WARNING, logger="router.placement.worker_view"):
        view._failed(view.workers["decode-0"], EngineStopped("the engine loop has stopped"))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "shutting down" in caplog.text and "Traceback" not in caplog.text
    assert not view.workers["decode-0"].schedulable
    assert view.route(block_hashes(PROMPT, BLOCK), len(PROMPT)).decode.worker_id == "decode-1"


class IdleEngine:
    def has_unfinished_requests(self) -> bool:
        return False


def test_commands_to_a_stopped_engine_loop_fail_instead_of_hanging():
    loop = EngineLoop(IdleEngine())
    assert loop.submit(lambda: 7).result(timeout=5) == 7
    blocked, release = threading.Event(), threading.Event()
    running = loop.submit(lambda: (blocked.set(), release.wait(10)))
    assert blocked.wait(5)
    queued = loop.submit(lambda: "never")  # behind a command still running when stop() gives up
    stopper = threading.Thread(target=loop.stop)
    stopper.start()
    stopper.join(timeout=10)
    release.set()
    with pytest.raises(EngineStopped):
        queued.result(timeout=5)
    assert running.result(timeout=5)[1] is True
    with pytest.raises(EngineStopped):
        loop.submit(lambda: 8).result(timeout=5)
    with pytest.raises(EngineStopped):
        asyncio.run(loop.run(lambda: 9))


# ---- peer prefix pulls (issue 41) ---------------------------------------------------------------------

def peer_view(prefill_tokens_per_s: float):
    from engine.step_costs import StepCosts
    view = view_with("decode-0", "decode-1")
    costs = StepCosts(prefill_tokens_per_s={4096: prefill_tokens_per_s, 2048: prefill_tokens_per_s,
                                            1024: prefill_tokens_per_s}, decode_step_s={1: 0.02})
    for worker_id in ("decode-0", "decode-1"):
        poll(view, worker_id, kv_bytes_per_token=23040, serves_prefixes=True, pulls_prefixes=True, step_costs=costs)
    return view


def test_a_decode_worker_is_pointed_at_the_peer_holding_more_of_the_prefix_when_pulling_is_faster():
    prompt = list(range(2000))
    hashes = block_hashes(prompt, BLOCK)
    view = peer_view(prefill_tokens_per_s=2000.0)  # 1,984 tokens: ~1 s to compute, ~50 ms to pull at 1 GB/s
    view.index.apply(KVEventBatch("decode-1", 0, [KVEvent("stored", hashes[:100]),
                                                   KVEvent("stored", hashes[100:], tier="host")]))
    view.index.apply(KVEventBatch("decode-0", 0, [KVEvent("stored", hashes[:10])]))
    source = view.peer_prefix("decode-0", hashes, len(prompt))
    assert source.worker_id == "decode-1" and source.num_blocks == (len(prompt) - 1) // BLOCK  # a token left
    assert view.peer_prefix("decode-1", hashes, len(prompt)) is None  # it holds the most itself
    slow_pull = peer_view(prefill_tokens_per_s=1e7)  # computing is faster than any pull
    slow_pull.index.apply(KVEventBatch("decode-1", 0, [KVEvent("stored", hashes)]))
    assert slow_pull.peer_prefix("decode-0", hashes, len(prompt)) is None


def test_no_peer_pull_for_a_worker_that_does_not_pull_or_a_holder_that_does_not_serve():
    prompt = list(range(2000))
    hashes = block_hashes(prompt, BLOCK)
    view = peer_view(prefill_tokens_per_s=2000.0)
    view.index.apply(KVEventBatch("decode-1", 0, [KVEvent("stored", hashes)]))
    poll(view, "decode-0", kv_bytes_per_token=23040, pulls_prefixes=False)
    assert view.peer_prefix("decode-0", hashes, len(prompt)) is None
    view = peer_view(prefill_tokens_per_s=2000.0)
    view.index.apply(KVEventBatch("decode-1", 0, [KVEvent("stored", hashes)]))
    poll(view, "decode-1", serves_prefixes=False)
    assert view.peer_prefix("decode-0", hashes, len(prompt)) is None
    view = peer_view(prefill_tokens_per_s=2000.0)
    view.index.apply(KVEventBatch("decode-1", 0, [KVEvent("stored", hashes[:1])]))  # one block: not worth a call
    assert view.peer_prefix("decode-0", hashes, len(prompt)) is None
