"""The cluster controller's plain parts, without Ray: versioned membership and its long poll, health
bookkeeping, scaling and drain decisions, the event log."""
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.config import PoolConfig
from cluster.event_log import EventLog
from cluster.health import Ping, observe
from cluster.pools import WorkerInfo
from cluster.roster import Roster
from cluster.scaling_plan import ScalingPlan
from worker_runtime.membership import WorkerEntry


def worker(worker_id: str, ready=True, healthy=True, draining=False) -> WorkerInfo:
    pool = worker_id.split("-")[0]
    return WorkerInfo(worker_id, pool, actor=None, healthy=healthy, draining=draining, ready=ready)


# ---- membership -----------------------------------------------------------------------------------

def test_every_change_bumps_the_membership_version_once():
    roster = Roster(version=7)
    with roster.change():
        pass
    assert roster.membership(list).version == 8


def test_membership_hands_out_copies_of_the_entries_not_the_controller_records():
    roster, w = Roster(version=1), worker("decode-0")
    [entry] = roster.membership(lambda: [w]).workers
    w.draining = True
    assert type(entry) is WorkerEntry and entry == WorkerEntry("decode-0", "decode", None, True, False)


def test_a_long_poll_wakes_when_the_version_changes():
    roster, workers = Roster(version=1), []
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(roster.membership, lambda: list(workers), 1, 600.0)
        with roster.change():
            workers.append(worker("decode-3"))
        membership = waiting.result(timeout=60)
    assert membership.version == 2 and [w.worker_id for w in membership.workers] == ["decode-3"]


def test_a_long_poll_without_a_change_returns_the_known_version_when_its_wait_is_over():
    roster = Roster(version=5)
    assert roster.membership(list, known_version=5, wait_s=0.05).version == 5


def test_a_poll_for_an_older_version_answers_at_once():
    roster = Roster(version=5)
    assert roster.membership(list, known_version=4, wait_s=600.0).version == 5


def test_a_change_is_never_read_halfway():
    roster, w = Roster(version=1), worker("decode-0")
    inside, release = threading.Event(), threading.Event()

    def change():
        with roster.change():
            w.draining = True
            inside.set()
            release.wait()
            w.healthy = False

    changer = threading.Thread(target=change)
    changer.start()
    inside.wait()
    with ThreadPoolExecutor(1) as pool:
        read = pool.submit(roster.membership, lambda: [w])
        release.set()
        [entry] = read.result(timeout=60).workers
    changer.join()
    assert (entry.draining, entry.healthy) == (True, False)


# ---- health ---------------------------------------------------------------------------------------

def test_a_failed_ping_makes_a_worker_unhealthy_and_an_answer_recovers_it():
    w = worker("prefill-0")
    assert observe([w], {"prefill-0": Ping(False)}).flipped == {"prefill-0": False}
    assert not w.healthy
    assert observe([w], {"prefill-0": Ping(True)}).flipped == {"prefill-0": True}
    assert w.healthy


def test_an_unchanged_health_is_no_flip():
    w = worker("prefill-0")
    assert observe([w], {"prefill-0": Ping(True)}).flipped == {}


def test_a_worker_found_dead_once_may_be_restarting_twice_in_a_row_is_dead_for_good():
    w = worker("decode-1")
    assert observe([w], {"decode-1": Ping(False, died=True)}).dead == []
    assert observe([w], {"decode-1": Ping(False, died=True)}).dead == [w]


def test_an_answer_between_two_deaths_starts_the_count_again():
    w = worker("decode-1")
    observe([w], {"decode-1": Ping(False, died=True)})
    observe([w], {"decode-1": Ping(True)})
    assert observe([w], {"decode-1": Ping(False, died=True)}).dead == []


def test_a_draining_worker_that_dies_is_left_to_its_drain():
    w = worker("decode-1", draining=True)
    for _ in range(3):
        changes = observe([w], {"decode-1": Ping(False, died=True)})
    assert changes.dead == []


def test_a_stalled_worker_is_listed_for_a_restart_with_the_reason():
    w = worker("decode-2")
    changes = observe([w], {"decode-2": Ping(False, stalled="engine loop stuck for 130 s")})
    assert changes.stalled == [w] and w.stalled == "engine loop stuck for 130 s" and not w.healthy


def test_workers_without_a_ping_keep_their_state():
    starting = worker("decode-4", ready=False, healthy=False)
    assert observe([starting], {}).flipped == {} and not starting.healthy


# ---- scaling and drains ---------------------------------------------------------------------------

def plan(**decode) -> ScalingPlan:
    return ScalingPlan({"prefill": PoolConfig(max_replicas=3), "decode": PoolConfig(max_replicas=3, **decode)})


def test_a_target_beyond_max_replicas_is_refused_with_the_limit():
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        plan().check_target("prefill", 4)


def test_the_decode_pool_cannot_scale_to_zero():
    with pytest.raises(ValueError, match="at least one"):
        plan().check_target("decode", 0)


def test_scaling_up_adds_the_missing_workers_and_makes_the_target_desired():
    p = plan()
    step = p.scale("prefill", [worker("prefill-0")], 3, in_flight=lambda w: 0)
    assert (step.add, step.drain, step.event) == (2, [], "scale_up")
    assert (step.result.replicas_before, step.result.replicas) == (1, 3) and p.desired["prefill"] == 3


def test_scaling_down_drains_the_least_busy_workers():
    busy = {"decode-0": 5, "decode-1": 0, "decode-2": 2}
    active = [worker(wid) for wid in busy]
    step = plan().scale("decode", active, 1, in_flight=lambda w: busy[w.worker_id])
    assert [w.worker_id for w in step.drain] == ["decode-1", "decode-2"] and step.event == "scale_down"


def test_scaling_to_the_current_size_does_nothing():
    step = plan().scale("decode", [worker("decode-0")], 1, in_flight=lambda w: 0)
    assert (step.add, step.drain, step.event) == (0, [], None)


def test_the_last_decode_worker_cannot_be_drained():
    last = worker("decode-0")
    with pytest.raises(ValueError, match="last decode worker"):
        plan().check_drain("decode", last, [last])
    plan().check_drain("prefill", worker("prefill-0"), [worker("prefill-0")])


def test_a_drained_worker_is_not_replaced():
    p = plan(replicas=2)
    p.drained("decode", [worker("decode-0")])
    assert p.missing("decode", [worker("decode-0")]) == 0


def test_dead_workers_are_replaced_up_to_the_desired_size():
    p = plan(replicas=3)
    assert p.missing("decode", [worker("decode-0")]) == 2
    assert p.missing("decode", [worker(f"decode-{i}") for i in range(4)]) == 0


def test_a_restarted_controller_keeps_the_size_it_adopted_or_restarts_an_empty_pool():
    p = plan(replicas=2)
    assert p.adopted("decode", [worker("decode-5")]) == 0 and p.desired["decode"] == 1
    assert plan(replicas=2).adopted("decode", []) == 2


# ---- event log ------------------------------------------------------------------------------------

def test_the_event_log_keeps_the_newest_events_and_counts_them_all():
    log = EventLog(max_events=3)
    for i in range(5):
        log.record("decode", "add", f"decode-{i}", "test")
    assert [e.worker_id for e in log.since(0.0)] == ["decode-2", "decode-3", "decode-4"]
    assert log.totals() == {("decode", "add"): 5}


def test_events_since_a_time_are_the_newer_ones_only():
    log = EventLog()
    log.record("prefill", "add", "prefill-1", "operator")
    [event] = log.since(0.0)
    assert log.since(event.time) == [] and log.since(event.time - 1.0) == [event]
