"""The rank processes of a tensor-parallel engine. Rank 0 is the engine's own process: it owns the scheduler, the
block manager and the sampler, and before each forward it broadcasts the step's plan (plain data: tokens,
positions, block tables, blocks to copy). Ranks 1..N-1 are processes it starts (spawned, so that a CUDA rank never
inherits a forked CUDA context); each builds its shard of the model and KV cache and runs every forward it is
sent, until rank 0 sends None or goes away (a collective then fails, and the rank exits)."""
from __future__ import annotations

import logging
import multiprocessing
import os
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.parallel.group import GroupAddress, TPGroup

logger = logging.getLogger(__name__)

# How long rank 0 waits for the other ranks to start and join (importing torch and reading a shard).
JOIN_TIMEOUT_S = 300.0


class Ranks:
    """Rank 0's handle on the other ranks: `group` is its TPGroup; `close` stops them."""

    def __init__(self, group: TPGroup, processes: list[multiprocessing.Process]):
        self.group, self.processes = group, processes

    @classmethod
    def start(cls, config: EngineConfig, model_dir: Path) -> Ranks:
        size = config.tensor_parallel_size
        device = rank_device(config, 0)
        store, address = TPGroup.host(size)
        context = multiprocessing.get_context("spawn")
        processes = [context.Process(target=run_rank, args=(config, str(model_dir), rank, address),
                                     name=f"tandem-tp-rank-{rank}", daemon=True) for rank in range(1, size)]
        for process in processes:
            process.start()  # each takes its share of this process's cores (`_pin_to_own_cores`)
        if config.cpu_binding is not None:  # a pinned worker's: its cores are the ranks' to split
            _pin_to_own_cores(0, size, every_thread=True)
        try:
            _wait_for_ranks(store, processes)
            group = TPGroup.join(address, 0, device, store=store, timeout_s=JOIN_TIMEOUT_S)
        except BaseException:
            for process in processes:
                process.kill()
            raise
        ranks = cls(group, processes)
        group.describe_ranks, group.alive = ranks.describe, ranks.alive
        return ranks

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def num_alive(self) -> int:
        return sum(p.is_alive() for p in self.processes)

    def describe(self) -> str:
        """The ranks that have exited, with their exit codes ("" while all run)."""
        return ", ".join(f"rank {rank} exited with code {p.exitcode}"
                         for rank, p in enumerate(self.processes, start=1) if not p.is_alive())

    def close(self, graceful: bool = True, timeout_s: float = 10.0) -> None:
        """Tell the other ranks to stop (they end after the forward they are in), then make sure they have; not
        `graceful`: kill them (a step may be in a collective on another thread)."""
        if graceful and self.alive():
            try:
                self.group.broadcast_object(None)
            except RuntimeError:  # a rank already gone: the kill below covers the rest
                pass
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                process.join(timeout_s)
        self.group.close()


def rank_device(config: EngineConfig, rank: int):
    """A rank's device: on CUDA the rank-th GPU the worker was given (Ray sets CUDA_VISIBLE_DEVICES to the
    worker's num_gpus x tensor_parallel_size GPUs), on CPU the CPU."""
    import torch

    device = config.torch_device
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _wait_for_ranks(store, processes: list[multiprocessing.Process]) -> None:
    """Until every rank has started and is about to join; RuntimeError naming one that exited first."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    keys = [f"tp/started/{rank}" for rank in range(1, len(processes) + 1)]
    while not store.check(keys):
        for rank, process in enumerate(processes, start=1):
            if not process.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {process.exitcode} "
                                   "before joining (its log says why)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not start within {JOIN_TIMEOUT_S:.0f}s")
        time.sleep(0.05)


def start_ranks(config: EngineConfig, model_dir: Path) -> Ranks:
    """Check that the model splits over `config.tensor_parallel_size` ranks (ValueError naming the numbers),
    then start the other ranks and join them."""
    from transformers import AutoConfig
    from engine.parallel.sharding import plan_for

    plan_for(AutoConfig.from_pretrained(model_dir), 0, config.tensor_parallel_size)
    if config.torch_device.type == "cuda":
        import torch
        if torch.cuda.device_count() < config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} needs a GPU per rank; "
                             f"{torch.cuda.device_count()} visible")
    return Ranks.start(config, model_dir)


def run_rank(config: EngineConfig, model_dir: str, rank: int, address: GroupAddress) -> None:
    """A follower rank's whole life: join, build its shard, run the forwards rank 0 sends."""
    from engine.model_runner import ModelRunner

    config.apply_threads()
    parent = os.getppid()
    if config.cpu_binding is not None:
        _pin_to_own_cores(rank, config.tensor_parallel_size)
    store = TPGroup.connect(address)
    store.set(f"tp/started/{rank}", "1")
    group = TPGroup.join(address, rank, rank_device(config, rank), store=store)
    group.alive = lambda: os.getppid() == parent  # rank 0 is this process's parent
    try:
        runner = ModelRunner(config, Path(model_dir), tp=group)
        runner.follow()
    except RuntimeError as e:  # rank 0 went away mid-collective: nothing left to serve
        logger.info("tensor-parallel rank %d stops: %s", rank, e)
    finally:
        group.close()


def _pin_to_own_cores(rank: int, size: int, every_thread: bool = False) -> None:
    """Each rank keeps to its share of the CPUs the worker was given (rank r the r-th of `size` equal slices), so
    that the ranks' threads do not contend; rank 0 (the worker's process, `every_thread`) once the others have
    started from the whole set. Fewer CPUs than ranks: they share them."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < size:
        return
    share = len(cpus) // size
    mine = cpus[rank * share:(rank + 1) * share]
    for tid in os.listdir("/proc/self/task") if every_thread else ["0"]:
        try:
            os.sched_setaffinity(int(tid), mine)
        except OSError:
            pass  # the thread exited meanwhile
