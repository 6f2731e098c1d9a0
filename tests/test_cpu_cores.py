"""Core assignment: each worker of a node gets cores of its own, without a central allocator (per-core
lock files), and a dead worker's cores go to the next one."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from cluster.config import ClusterConfig
from cluster.launcher import fit_pools_to_cores, serving_cores
from engine import Engine, EngineConfig, SamplingParams
from worker_runtime import cpu_cores
from engine.config import CpuBinding
from worker_runtime.cpu_cores import PinnedCores, assign_cores, claim_cores, node_cores, pinning_is_safe
from worker_runtime.engine_loop import EngineLoop, watch_lenders
from engine.layer_progress import decoder_layers
from engine.step_context import StepContext
from tests.helpers import wait_for

CORES = [(0,), (1,), (2,), (3,), (4,), (5,)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_workers_on_one_node_get_disjoint_cores():
    taken: set[int] = set()
    sets = []
    for want in (2, 1, 3):
        cores = assign_cores(CORES, taken, want)
        sets.append(cores)
        taken |= {core[0] for core in cores}
    assert sets == [[(0,), (1,)], [(2,)], [(3,), (4,), (5,)]]


def test_a_freed_core_is_reused_and_adjacent_cores_are_preferred():
    assert assign_cores(CORES, {0, 1, 3}, 1) == [(2,)]
    assert assign_cores(CORES, {1, 3}, 2) == [(4,), (5,)]
    assert assign_cores(CORES, {1, 3, 5}, 2) == [(0,), (2,)]  # no adjacent pair left: the lowest free


def test_a_short_node_gives_what_it_has():
    assert assign_cores(CORES, {0, 1, 2, 3}, 3) == [(4,), (5,)]
    assert assign_cores(CORES, {c[0] for c in CORES}, 1) == []


def test_hyperthreads_of_one_core_go_to_one_worker():
    smt = [(0, 2), (1, 3)]
    assert assign_cores(smt, set(), 1) == [(0, 2)]
    assert assign_cores(smt, {0}, 1) == [(1, 3)]


def test_decode_takes_the_highest_free_cores_and_prefill_the_lowest():
    assert assign_cores(CORES, set(), 2, top=True) == [(4,), (5,)]
    assert assign_cores(CORES, {5}, 2, top=True) == [(3,), (4,)]
    assert assign_cores(CORES, {1, 3, 5}, 2, top=True) == [(2,), (4,)]  # no adjacent pair: the highest free
    assert assign_cores(CORES, set(), 2) == [(0,), (1,)]


def test_claims_from_both_ends_meet_without_overlap(tmp_path):
    decode = claim_cores(2, tmp_path, CORES, top=True)
    prefill = claim_cores(3, tmp_path, CORES)
    assert set(decode) == {(4,), (5,)} and set(prefill) == {(0,), (1,), (2,)}
    assert set(claim_cores(2, tmp_path, CORES, top=True)) == {(3,)}


def test_node_cpus_come_from_the_launcher_when_it_set_them(monkeypatch):
    monkeypatch.setenv(cpu_cores.NODE_CPUS_ENV, "0-2,5")
    assert cpu_cores.node_cpus() == {0, 1, 2, 5}
    assert cpu_cores.format_cpu_list({5, 0, 2, 1}) == "0,1,2,5"
    monkeypatch.delenv(cpu_cores.NODE_CPUS_ENV)
    assert cpu_cores.node_cpus() == os.sched_getaffinity(0)


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "3,,4", "0-x", "3-1", "0,3-1"])
def test_a_bad_node_cpu_list_is_an_error_naming_the_variable(text):
    with pytest.raises(ValueError, match="TANDEM_NODE_CPUS"):
        cpu_cores.parse_cpu_list(text)


def test_serving_processes_get_the_cores_the_starting_prefill_workers_leave():
    cores = [(0, 4), (1, 5), (2, 6), (3, 7)]
    on = {"isolate_prefill": True}
    config = fit_pools_to_cores(ClusterConfig(cpu=on), 4)
    assert (config.prefill.num_cpus, config.decode.num_cpus) == (2, 2)
    assert serving_cores(config, cores) == [(2, 6), (3, 7)]
    two = ClusterConfig(cpu=on, prefill={"replicas": 2, "num_cpus": 1}, decode={"num_cpus": 2})
    assert serving_cores(two, cores) == [(2, 6), (3, 7)]
    # Nothing to isolate: isolation off (the default), no prefill pool, no pinning, fractional prefill
    # workers, or a prefill pool that takes every core.
    assert serving_cores(fit_pools_to_cores(ClusterConfig(), 4), cores) == []
    for nothing in (ClusterConfig(cpu=on, mode="colocated"), ClusterConfig(cpu=on, prefill={"replicas": 0}),
                    ClusterConfig(cpu={**on, "pin": False}), ClusterConfig(cpu=on, prefill={"num_cpus": 0.5}),
                    ClusterConfig(cpu=on, prefill={"num_cpus": 4})):
        assert serving_cores(nothing, cores) == []


def _sleeper(script: str = "") -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", script + "\nimport sys; print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert child.stdout.readline().strip() == "up"
    return child


def _affinities(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="confining needs two CPUs")
def test_confine_moves_every_thread_but_leaves_engine_workers_on_their_cores(tmp_path):
    one = {min(os.sched_getaffinity(0))}
    # A process with threads, and an engine worker: it holds a core lock of the directory.
    threaded = _sleeper("import threading, time\n"
                        "[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() for _ in range(3)]")
    worker = _sleeper(f"from pathlib import Path\nfrom worker_runtime.cpu_cores import claim_cores\n"
                      f"held = claim_cores(1, Path({str(tmp_path)!r}), {CORES!r})")
    try:
        before = _affinities(worker.pid)
        assert cpu_cores.confine([threaded.pid, worker.pid, 2 ** 22 + 1], one, tmp_path) == 1  # a gone pid is skipped
        assert _affinities(threaded.pid) == {frozenset(one)}
        assert len(os.listdir(f"/proc/{threaded.pid}/task")) >= 4
        assert _affinities(worker.pid) == before
    finally:
        for child in (threaded, worker):
            child.kill()
            child.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="widening needs two CPUs")
def test_an_unpinned_worker_started_from_a_confined_process_widens_to_the_node(tmp_path):
    node = os.sched_getaffinity(0)
    one = min(node)
    script = textwrap.dedent(f"""
        import os
        from worker_runtime.cpu_cores import unpin
        assert os.sched_getaffinity(0) == {{{one}}}
        unpin()
        print(sorted(os.sched_getaffinity(0)))
    """)
    env = {**os.environ, cpu_cores.NODE_CPUS_ENV: cpu_cores.format_cpu_list(node)}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60, preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(sorted(node))


def test_a_container_sharing_its_cores_under_a_quota_is_not_pinned():
    assert pinning_is_safe(CORES, None) and pinning_is_safe(CORES, 6.0)
    assert not pinning_is_safe(CORES, 2.0)


def test_claims_hold_cores_until_released(tmp_path):
    first = claim_cores(2, tmp_path, CORES)
    second = claim_cores(3, tmp_path, CORES)
    assert set(first) == {(0,), (1,)} and set(second) == {(2,), (3,), (4,)}
    for fd in first.values():
        os.close(fd)
    assert set(claim_cores(2, tmp_path, CORES)) == {(0,), (1,)}


def test_a_dead_workers_cores_are_free_for_its_replacement(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from worker_runtime.cpu_cores import claim_cores
        held = claim_cores(2, Path({str(tmp_path)!r}), {CORES!r})
        print(sorted(c[0] for c in held), flush=True)
        sys.stdin.read()
    """)
    worker = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert worker.stdout.readline().strip() == "[0, 1]"
        assert set(claim_cores(1, tmp_path, CORES)) == {(2,)}  # while it lives, its cores are taken
    finally:
        worker.kill()
        worker.wait()
    assert set(claim_cores(2, tmp_path, CORES)) == {(0,), (1,)}


def test_pools_split_the_machine_between_starting_workers():
    fitted = fit_pools_to_cores(ClusterConfig(), 2)
    assert (fitted.prefill.num_cpus, fitted.decode.num_cpus) == (1, 1)
    fitted = fit_pools_to_cores(ClusterConfig(prefill={"replicas": 1}, decode={"replicas": 2}), 16)
    assert (fitted.prefill.num_cpus, fitted.decode.num_cpus) == (5, 5)  # one core left to Serve
    fitted = fit_pools_to_cores(ClusterConfig(), 3)
    assert (fitted.prefill.num_cpus, fitted.decode.num_cpus) == (1, 2)  # the rest to decode, which lends


def test_a_pools_own_num_cpus_is_kept():
    fitted = fit_pools_to_cores(ClusterConfig(prefill={"num_cpus": 1}), 8)
    assert (fitted.prefill.num_cpus, fitted.decode.num_cpus) == (1, 6)


def test_pinned_workers_take_their_threads_from_their_cores():
    config = ClusterConfig(prefill={"num_cpus": 2}, decode={"num_cpus": 1, "num_threads": 3})
    prefill, decode = config.engine_config(config.prefill, "prefill"), config.engine_config(config.decode, "decode")
    assert prefill.cpu_binding == CpuBinding(2, lend=False, borrow=True) and prefill.num_threads is None
    # Decode takes the highest free cores, prefill the lowest.
    assert decode.cpu_binding == CpuBinding(1, lend=True, borrow=False, top=True, lend_busy_ms=100.0)
    assert decode.num_threads == 3
    both_ways = ClusterConfig(cpu={"decode_borrows": True})
    assert both_ways.engine_config(both_ways.prefill, "prefill").cpu_binding == CpuBinding(1, lend=True, borrow=True)
    assert both_ways.engine_config(both_ways.decode, "decode").cpu_binding == CpuBinding(1, lend=True, borrow=True,
                                                                                       top=True, lend_busy_ms=100.0)
    neither = ClusterConfig(cpu={"borrow": False})
    assert neither.engine_config(neither.decode, "decode").cpu_binding == CpuBinding(1, lend=False, borrow=False,
                                                                                    top=True)
    unpinned = ClusterConfig(cpu={"pin": False}, prefill={"num_cpus": 2})
    assert unpinned.engine_config(unpinned.prefill, "prefill").cpu_binding is None
    assert unpinned.engine_config(unpinned.prefill, "prefill").num_threads == 2
    fractional = ClusterConfig(decode={"num_cpus": 0.5})
    assert fractional.engine_config(fractional.decode, "decode").cpu_binding is None


def test_a_borrowing_worker_slices_its_borrowed_forwards_by_the_itl_slo_unless_told():
    config = ClusterConfig(prefill={"num_cpus": 1}, decode={"num_cpus": 1}, slo={"itl_ms": 180})
    assert config.engine_config(config.prefill, "prefill").borrow_slice_ms == 180
    assert config.engine_config(config.decode, "decode").borrow_slice_ms is None  # it lends, never borrows
    both_ways = ClusterConfig(decode={"num_cpus": 1}, slo={"itl_ms": 180}, cpu={"decode_borrows": True})
    assert both_ways.engine_config(both_ways.decode, "decode").borrow_slice_ms == 180
    told = ClusterConfig(prefill={"num_cpus": 1}, cpu={"borrow_slice_ms": 0})
    assert told.engine_config(told.prefill, "prefill").borrow_slice_ms == 0
    no_borrow = ClusterConfig(prefill={"num_cpus": 1}, cpu={"borrow": False})
    assert no_borrow.engine_config(no_borrow.prefill, "prefill").borrow_slice_ms is None
    with pytest.raises(ValueError, match="borrow_slice_ms"):
        ClusterConfig(cpu={"borrow_slice_ms": -1})


@pytest.mark.skipif(len(node_cores()) < 2, reason="lending needs two cores")
def test_two_workers_lend_each_other_their_idle_cores_and_take_them_back_when_busy(tmp_path, monkeypatch):
    # The protocol alone, in this process: pinning and thread counts are recorded, not applied.
    applied = []
    monkeypatch.setattr(cpu_cores, "pin_threads", lambda cpus: applied.append(sorted(cpus)))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    both = CpuBinding(1, lend=True, borrow=True)
    prefill, decode = PinnedCores(both, directory=tmp_path), PinnedCores(both, directory=tmp_path)
    try:
        (prefill_core,), (decode_core,) = prefill.owned, decode.owned
        prefill.idle()  # no prompt: its core is lent
        decode.busy()
        assert list(decode.borrowed) == [prefill_core] and decode.threads == 2
        assert applied[-1] == sorted({*prefill_core, *decode_core})
        prefill.busy()  # a prompt: it stops lending, and borrows nothing from the busy decode worker
        assert not prefill.borrowed and prefill.threads == 1
        decode.busy()  # decode's next step gives the core back
        assert not decode.borrowed and decode.threads == 1 and applied[-1] == sorted(decode_core)
        decode.idle()
        prefill.busy()  # now decode is idle: the prefill takes its core
        assert list(prefill.borrowed) == [decode_core]
        decode.busy()  # and decode, busy again, cannot take the busy prefill worker's core meanwhile
        assert not decode.borrowed
        prefill.busy()
        assert not prefill.borrowed
    finally:
        prefill.close()
        decode.close()


@pytest.mark.skipif(len(node_cores()) < 2, reason="lending needs two cores")
def test_a_busy_lender_lends_between_its_steps_only_while_a_live_borrower_computes_a_prompt(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_cores, "pin_threads", lambda cpus: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    prefill = PinnedCores(CpuBinding(1, borrow=True), directory=tmp_path)
    decode = PinnedCores(CpuBinding(1, lend=True, lend_busy_ms=40), directory=tmp_path)
    try:
        (decode_core,) = decode.owned
        decode.busy()
        prefill.idle()  # no prompt: a busy decode worker keeps its core between steps
        assert decode.lend_between_steps(time.monotonic()) == 0.0 and decode.busy_lends == 0
        prefill.busy()  # a prompt, while decode is busy: nothing lent yet
        assert not prefill.borrowed
        assert decode.lend_between_steps(time.monotonic() - 0.05) == 0.0  # its step took longer than 40 ms

        # The pause: the borrower's next layer takes the core; once the pause ends the lender waits until
        # the borrower's following layer has given it back.
        took, gave_back = threading.Event(), threading.Event()

        def borrower():
            assert wait_for(lambda: prefill.rebalance() == (False, True), interval_s=0.001)
            took.set()
            assert list(prefill.borrowed) == [decode_core] and prefill.threads == 2
            assert wait_for(lambda: prefill.rebalance() == (True, False), interval_s=0.01)
            gave_back.set()

        thread = threading.Thread(target=borrower)
        thread.start()
        started = time.monotonic()
        lent = decode.lend_between_steps(started)
        thread.join()
        assert took.is_set() and gave_back.is_set()
        assert 0.0 < lent < 0.06 and time.monotonic() - started >= 0.04
        assert not decode.lending and not prefill.borrowed and prefill.threads == 1
        assert (decode.busy_lends, decode.reclaim_timeouts, prefill.taken_midway, prefill.reclaimed_midway) == (1, 0, 1, 1)

        # Work that should not wait (a new request) ends the pause early.
        interrupt = threading.Event()
        timer = threading.Timer(0.005, interrupt.set)
        timer.start()
        lent = decode.lend_between_steps(time.monotonic(), interrupt)
        timer.join()
        assert 0.0 < lent < 0.03 and decode.busy_lends == 2
        prefill.rebalance()
        assert decode.lend_between_steps(time.monotonic(), interrupt) == 0.0  # still set: no pause at all

        # A borrower that does not let go in time: the lender steps anyway, and counts it.
        monkeypatch.setattr(PinnedCores, "RECLAIM_WAIT_S", 0.02)
        timer = threading.Timer(0.01, prefill.rebalance)
        timer.start()
        decode.lend_between_steps(time.monotonic())
        timer.join()
        assert prefill.borrowed and decode.reclaim_timeouts == 1
        prefill.rebalance()
        assert not prefill.borrowed

        # A borrower that died computing a prompt left its flag set; its lock went with it: no pause for it.
        prefill.close()
        (prefill_core,) = [core for core in decode.node if core not in decode.owned][:1]
        os.pwrite(os.open(tmp_path / f"core{prefill_core[0]}.lock", os.O_RDWR), b"01", 0)
        assert decode.lend_between_steps(time.monotonic()) == 0.0 and decode.busy_lends == 3
    finally:
        prefill.close()
        decode.close()


@pytest.mark.skipif(len(node_cores()) < 2, reason="lending needs two cores")
def test_the_decode_loop_paces_its_steps_while_a_neighbours_prompt_runs(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.setattr(cpu_cores, "pin_threads", lambda cpus: None)
    prefill = PinnedCores(CpuBinding(1, borrow=True), directory=tmp_path)
    decode = PinnedCores(CpuBinding(1, lend=True, lend_busy_ms=30), directory=tmp_path)
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64))
    loop = EngineLoop(engine, cores=decode)
    try:
        def decode_tokens(n: int) -> float:
            started = time.monotonic()
            loop.submit(engine.add_request, f"r{n}-{started}", [3, 4, 5],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)).result()
            assert wait_for(lambda: not loop.submit(engine.has_unfinished_requests).result(), interval_s=0.005)
            return time.monotonic() - started

        # A neighbour computes a prompt (the flag its busy() sets; it takes nothing here, so that the idle
        # loop's lent core is not held): every step but the last is followed by a pause.
        prefill._want(True)
        assert decode_tokens(6) >= 5 * 0.03 and decode.busy_lends == 5 and decode.reclaim_timeouts == 0
        prefill._want(False)  # and without one, none
        decode_tokens(6)
        assert decode.busy_lends == 5
    finally:
        loop.stop()
        prefill.close()
        decode.close()


@pytest.mark.parametrize("lender_turns_busy", [True, False])
def test_a_borrowed_forward_gives_the_core_back_between_layers_once_its_owner_is_busy(
        tmp_path, monkeypatch, tiny_llama_dir, lender_turns_busy):
    threads = []
    monkeypatch.setattr(cpu_cores, "pin_threads", lambda cpus: None)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    prefill = PinnedCores(CpuBinding(1, borrow=True), directory=tmp_path)
    decode = PinnedCores(CpuBinding(1, lend=True), directory=tmp_path)
    try:
        engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64))
        context = StepContext()
        watch_lenders(engine.runner.model, prefill, context)
        layers = decoder_layers(engine.runner.model)
        if lender_turns_busy:  # decode gets a request while the prefill's first layer runs
            layers[0].register_forward_hook(lambda *args: decode.busy())
        decode.idle()
        prefill.busy()
        assert prefill.threads == 2 and threads[-1] == 2
        context.borrowing = True
        engine.add_request("p", list(range(3, 60)), SamplingParams(temperature=0.0, max_tokens=4))
        observed = dict(engine.step_costs.borrowed_prefill_tokens_per_s)
        engine.step(context)  # the prompt's one forward
        if lender_turns_busy:
            assert not prefill.borrowed and threads[-1] == 1 and prefill.reclaimed_midway == 1
            assert context.borrow_cut and not context.borrowing
            assert engine.step_costs.borrowed_prefill_tokens_per_s == observed  # a mixed step is not measured
        else:
            assert len(prefill.borrowed) == 1 and threads[-1] == 2 and prefill.reclaimed_midway == 0
            assert not context.borrow_cut
    finally:
        prefill.close()
        decode.close()


def test_a_forward_on_its_own_core_takes_a_core_lent_midway(tmp_path, monkeypatch, tiny_llama_dir):
    threads = []
    monkeypatch.setattr(cpu_cores, "pin_threads", lambda cpus: None)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    prefill = PinnedCores(CpuBinding(1, borrow=True), directory=tmp_path)
    decode = PinnedCores(CpuBinding(1, lend=True, lend_busy_ms=100), directory=tmp_path)
    if len(decode.node) < 2:
        pytest.skip("lending needs two cores")
    try:
        engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64))
        context = StepContext()
        watch_lenders(engine.runner.model, prefill, context)
        # decode, busy when the forward starts, pauses between its steps while the first layer runs
        decoder_layers(engine.runner.model)[0].register_forward_hook(lambda *args: decode._lend(True))
        decode.busy()
        prefill.busy()
        assert prefill.threads == 1
        engine.add_request("p", list(range(3, 60)), SamplingParams(temperature=0.0, max_tokens=4))
        observed = dict(engine.step_costs.prefill_tokens_per_s)
        engine.step(context)
        assert len(prefill.borrowed) == 1 and threads[-1] == 2 and prefill.taken_midway == 1
        assert context.borrow_cut and not context.borrowing  # a mixed step: measured as neither speed
        assert engine.step_costs.prefill_tokens_per_s == observed
    finally:
        prefill.close()
        decode.close()
