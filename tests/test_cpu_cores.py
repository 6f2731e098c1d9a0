"""Core assignment: each worker of a node gets cores of its own, without a central allocator (per-core
lock files), and a dead worker's cores go to the next one."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from cluster.config import ClusterConfig
from cluster.launcher import fit_pools_to_cores
from engine import cpu_cores
from engine.cpu_cores import CpuBinding, PinnedCores, assign_cores, claim_cores, node_cores, pinning_is_safe

CORES = [(0,), (1,), (2,), (3,), (4,), (5,)]


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
        from engine.cpu_cores import claim_cores
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
    assert decode.cpu_binding == CpuBinding(1, lend=True, borrow=False) and decode.num_threads == 3
    both_ways = ClusterConfig(cpu={"decode_borrows": True})
    assert both_ways.engine_config(both_ways.prefill, "prefill").cpu_binding == CpuBinding(1, lend=True, borrow=True)
    assert both_ways.engine_config(both_ways.decode, "decode").cpu_binding == CpuBinding(1, lend=True, borrow=True)
    neither = ClusterConfig(cpu={"borrow": False})
    assert neither.engine_config(neither.decode, "decode").cpu_binding == CpuBinding(1, lend=False, borrow=False)
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
    monkeypatch.setattr(cpu_cores.torch, "set_num_threads", lambda n: None)
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
