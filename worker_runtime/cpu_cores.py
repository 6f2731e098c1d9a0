"""Pinning a CPU worker to cores of its own, and lending a worker's idle cores to its node neighbours.

There is no central allocator. Each physical core of a node has a lock file in a per-node directory
(`TANDEM_CPU_DIR`, default /dev/shm/tandem-cpu): a worker owns a core while it holds an exclusive
`flock` on `core<N>.lock`. The kernel drops the lock when the process dies, so a crashed, restarted or
replaced worker frees its cores with nobody cleaning up, and the next worker takes the lowest free ones.
Every worker of a node sees the same directory, simulated Ray nodes on one host included (they share
the host's cores too).

Decode workers take the highest free cores and prefill workers the lowest, so on a local `tandem serve`
the launcher knows before any worker starts which cores prefill will hold, and confines Ray's and Serve's
own processes to the others once it serves (cluster/launcher.py). Those processes carry the node's full
CPU list in `TANDEM_NODE_CPUS`: workers started from them claim from it, and unpinned ones run on it.

Lending: the first byte of an owner's lock file says whether it lends its cores now (b"1": its engine
is idle, or pauses between steps for a borrower), the second whether a borrower among the owners is
computing a prompt and would take lent cores (b"1"). A borrower holds `core<N>.borrow` while it runs
threads on a lent core, so two borrowers never share one; it looks before every forward and between
its decoder layers, takes what is lent and gives a core back as soon as its owner is busy. A busy owner
that paused for a borrower waits for that before its next step, so the two never share a core.
"""
from __future__ import annotations

import fcntl
import os
import re
import socket
import threading
import time
from pathlib import Path

from engine.config import CpuBinding

Core = tuple[int, ...]  # the logical CPUs (hyperthreads) of one physical core, lowest first
NODE_CPUS_ENV = "TANDEM_NODE_CPUS"


def parse_cpu_list(text: str) -> set[int]:
    """CPUs written as taskset and cpuset do: "0-3,6"."""
    cpus: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if not match or int(match[2] or match[1]) < int(match[1]):
            raise ValueError(f"{NODE_CPUS_ENV}={text!r} is not a CPU list such as 0-3,6")
        cpus.update(range(int(match[1]), int(match[2] or match[1]) + 1))
    return cpus


def format_cpu_list(cpus: set[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))


def node_cpus() -> set[int]:
    """The CPUs this node's workers share: `TANDEM_NODE_CPUS` where the launcher set it (this process may
    have inherited a confined affinity from Ray's processes), else the CPUs this process may run on."""
    listed = os.environ.get(NODE_CPUS_ENV)
    return parse_cpu_list(listed) if listed else os.sched_getaffinity(0)


def node_cores(cpus: set[int] | None = None) -> list[Core]:
    """The physical cores among `cpus` (default: the node's CPUs, `node_cpus()`), hyperthreads grouped."""
    cpus = sorted(node_cpus() if cpus is None else cpus)
    groups: dict[tuple[str, str], list[int]] = {}
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            key = ("cpu", str(cpu))
        groups.setdefault(key, []).append(cpu)
    return sorted(tuple(g) for g in groups.values())


def assign_cores(cores: list[Core], taken: set[int], want: int, top: bool = False) -> list[Core]:
    """The cores a new worker takes: `want` adjacent free cores if there is such a run, else the lowest
    free ones (fewer when fewer are free); with `top`, the same from the highest core down. `taken` holds
    the first CPU of each core in use."""
    order = cores[::-1] if top else cores
    free = [i for i, core in enumerate(order) if core[0] not in taken]
    for start in range(len(free) - want + 1):
        if free[start + want - 1] - free[start] == want - 1:
            return sorted(order[i] for i in free[start:start + want])
    return sorted(order[i] for i in free[:want])


def cpu_quota() -> float | None:
    """CPUs per period this process's cgroup may use under a CFS quota (cgroup v2 or v1), None without one."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        try:
            quota = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text().strip()
            period = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    return int(quota) / int(period)


def pinning_is_safe(cores: list[Core], quota: float | None) -> bool:
    """Pin only where the cores we see are ours: a container limited by a CFS quota below the CPUs it sees
    shares the host's cores with other containers, which would pin onto the same ones (Kubernetes'
    static CPU manager gives a Guaranteed pod an exclusive cpuset instead, and no quota below it)."""
    return quota is None or quota >= len(cores)


def pin_threads(cpus: set[int], pid: int | str = "self") -> None:
    """Restrict every thread of process `pid` (default: this one) to `cpus`; threads started later inherit it
    from their creator."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # the thread exited meanwhile


def unpin() -> None:
    """Let every thread of this process run on all the node's CPUs: an unpinned worker must not keep the
    affinity it inherited from Ray's confined processes."""
    pin_threads(node_cpus())


def confine(pids, cpus: set[int], directory: Path | None = None) -> int:
    """Restrict every thread of the processes `pids` to `cpus`, but those of engine workers (a process with
    a file of the core-lock directory open keeps its own cores); returns how many processes moved."""
    prefix = os.path.realpath(directory or lock_dir()) + "/"
    moved = 0
    for pid in pids:
        try:
            if any(path.startswith(prefix) for path in _open_files(pid)):
                continue
            pin_threads(cpus, pid)
        except OSError:
            continue  # the process exited meanwhile
        moved += 1
    return moved


def _open_files(pid: int) -> list[str]:
    paths = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    return paths


def lock_dir() -> Path:
    default = "/dev/shm/tandem-cpu" if os.path.isdir("/dev/shm") else "/tmp/tandem-cpu"
    path = Path(os.environ.get("TANDEM_CPU_DIR", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _try_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def claim_cores(want: int, directory: Path | None = None, cores: list[Core] | None = None,
                top: bool = False) -> dict[Core, int]:
    """Lock `want` free cores of this node (fewer if the node has fewer free); returns core -> lock fd.
    Workers starting at once may race for a core: the loser learns it is taken and picks again."""
    directory = directory or lock_dir()
    cores = node_cores() if cores is None else cores
    taken: set[int] = set()
    while True:
        held: dict[Core, int] = {}
        for core in assign_cores(cores, taken, want, top):
            fd = _try_lock(directory / f"core{core[0]}.lock")
            if fd is None:
                taken.add(core[0])
                break
            os.pwrite(fd, b"00", 0)  # not lent, and no prompt, until the new owner says so
            held[core] = fd
        else:
            return held
        for fd in held.values():
            os.close(fd)


class PinnedCores:
    """A worker's own cores, held while its process lives, and the lent cores it borrows right now.

    The engine loop calls `busy()` before each step and `idle()` before it waits: a lender publishes
    whether its cores are free; a borrower takes the free ones for the coming forward (threads = own
    threads + one per borrowed core) and gives them back once their owner is busy, or when it idles.
    A busy lender with `lend_busy_ms` calls `lend_between_steps` after each step."""

    # How long a lender that reclaims its cores waits for the borrower's forward to reach its next
    # decoder layer and let go, before it steps anyway (counted: `reclaim_timeouts`).
    RECLAIM_WAIT_S = 0.05

    def __init__(self, binding: CpuBinding, threads: int | None = None, directory: Path | None = None):
        self.binding = binding
        self.directory = directory or lock_dir()
        self.node = node_cores()
        self.owned = claim_cores(binding.cores, self.directory, self.node, binding.top)
        self.own_threads = threads or len(self.owned) or binding.cores
        self.borrowed: dict[Core, int] = {}
        self.lending: bool | None = None
        self.last_step_threads = self.own_threads
        self.borrowing_steps = 0  # steps that ran with borrowed cores
        self.reclaimed_midway = 0  # forwards that gave borrowed cores back between layers (owner turned busy)
        self.taken_midway = 0  # forwards that took cores lent between layers (a busy owner's pause)
        self.wanting: bool | None = None  # a borrower: whether it said it computes a prompt now
        self.busy_lends = 0  # a busy lender's pauses between steps for a borrower
        self.busy_lent_s = 0.0  # ... and their seconds
        self.reclaim_timeouts = 0  # steps begun while a borrower still held this worker's core
        self._states: dict[Core, int] = {}  # read-only fds of other owners' lock files
        if self.owned:
            pin_threads(self.cpus())

    @property
    def node_key(self) -> str:
        """Which cores this worker shares with its neighbours: its host and core-lock directory ("" when it
        owns none). Workers with one key lend to and borrow from each other."""
        return f"{socket.gethostname()}:{self.directory}" if self.owned else ""

    @property
    def threads(self) -> int:
        return self.own_threads + len(self.borrowed)

    @property
    def lends_while_busy(self) -> bool:
        """Whether this worker lends its cores between busy steps (`lend_between_steps`)."""
        return bool(self.binding.lend and self.binding.lend_busy_ms > 0 and self.owned)

    def cpus(self) -> set[int]:
        return {cpu for core in [*self.owned, *self.borrowed] for cpu in core}

    def busy(self) -> None:
        if self.binding.lend:
            self._lend(False)
        if self.binding.borrow and self.owned:
            self._want(True)
            self._borrow()
            self.borrowing_steps += bool(self.borrowed)
        self.last_step_threads = self.threads

    def idle(self) -> None:
        if self.binding.lend:
            self._lend(True)
        if self.binding.borrow and self.owned:
            self._want(False)
        if self.borrowed:
            self._give_back(list(self.borrowed))
            self._apply()

    def rebalance(self) -> tuple[bool, bool]:
        """Between two decoder layers of a forward: give back the borrowed cores whose owner has turned busy
        since the forward began, and take those lent since (a busy owner pausing between its steps), so the
        rest of the forward runs on the cores lent now. A thread left on a busy owner's core holds up every
        parallel region of the forward (each waits for its slowest thread, which gets only a share of that
        core): a 256-token prefill took 1.2-2.5 s instead of 0.45 s. Returns (gave some back, took some).
        Engine loop thread only."""
        returned = [core for core in self.borrowed if not self._is_lent(core)]
        self._give_back(returned)
        taken = self._take_lent()
        if returned or taken:
            self._apply()
        self.reclaimed_midway += bool(returned)
        self.taken_midway += taken
        return bool(returned), taken

    def lend_between_steps(self, step_started: float, interrupt: threading.Event | None = None) -> float:
        """A busy lender, after a step that began at `step_started` (time.monotonic()): while a borrower on
        this node is computing a prompt, lend this worker's cores until `lend_busy_ms` have passed since the
        step began or `interrupt` is set (work that should not wait: a new request), then take them back,
        waiting (at most RECLAIM_WAIT_S) until the borrower's forward has let go at its next decoder layer.
        Returns the seconds lent (0: it did not pause). Engine loop only."""
        if not self.lends_while_busy:
            return 0.0
        start = time.monotonic()
        pause = step_started + self.binding.lend_busy_ms / 1000 - start
        if pause < 0.001 or (interrupt is not None and interrupt.is_set()) or not self._borrower_wants():
            return 0.0
        self._lend(True)
        if interrupt is not None:
            interrupt.wait(pause)
        else:
            time.sleep(pause)
        pause = time.monotonic() - start
        self._lend(False)
        deadline = time.monotonic() + self.RECLAIM_WAIT_S
        while not self._returned():
            if time.monotonic() >= deadline:
                self.reclaim_timeouts += 1
                break
            time.sleep(0.0005)
        self.busy_lends += 1
        self.busy_lent_s += pause
        return pause

    def threads_if_borrowing_now(self) -> int:
        """The threads a forward starting now would run with, borrowing every core lent at this moment;
        0 when this worker does not borrow or nothing is lent. Engine loop thread only."""
        if not (self.binding.borrow and self.owned):
            return 0
        lent = sum(1 for core in self.node if core not in self.owned and self._is_lent(core))
        return self.own_threads + lent if lent else 0

    def describe(self) -> dict:
        """What a worker reports: its cores, the borrowed ones, its threads now and its affinity."""
        return {"cores": sorted(c for core in self.owned for c in core),
                "borrowed": sorted(c for core in self.borrowed for c in core), "threads": self.threads,
                "last_step_threads": self.last_step_threads, "borrowing_steps": self.borrowing_steps,
                "reclaimed_midway": self.reclaimed_midway, "taken_midway": self.taken_midway,
                "busy_lends": self.busy_lends, "busy_lent_s": round(self.busy_lent_s, 3),
                "reclaim_timeouts": self.reclaim_timeouts,
                "lending": bool(self.lending), "affinity": sorted(os.sched_getaffinity(0))}

    def close(self) -> None:
        if self.binding.borrow and self.owned:
            self._want(False)
        for fd in [*self.owned.values(), *self.borrowed.values(), *self._states.values()]:
            os.close(fd)
        self.owned, self.borrowed, self._states = {}, {}, {}

    def _lend(self, lend: bool) -> None:
        if lend != self.lending:
            for fd in self.owned.values():
                os.pwrite(fd, b"1" if lend else b"0", 0)
            self.lending = lend

    def _want(self, want: bool) -> None:
        if want != self.wanting:
            for fd in self.owned.values():
                os.pwrite(fd, b"1" if want else b"0", 1)
            self.wanting = want

    def _borrow(self) -> None:
        returned = [core for core in self.borrowed if not self._is_lent(core)]
        self._give_back(returned)
        if returned or self._take_lent():
            self._apply()

    def _take_lent(self) -> bool:
        """Lock the lent cores not yet borrowed (another borrower may hold one); True when some were taken."""
        added = False
        for core in self.node:
            if core in self.owned or core in self.borrowed or not self._is_lent(core):
                continue
            fd = _try_lock(self.directory / f"core{core[0]}.borrow")
            if fd is not None:
                self.borrowed[core] = fd
                added = True
        return added

    def _borrower_wants(self) -> bool:
        """Whether a live borrower on this node computes a prompt now (its lock file's second byte, and its
        lock held: a dead one's flag is stale)."""
        for core in self.node:
            if core in self.owned or self._state(core, 2)[1:] != b"1":
                continue
            fd = self._states[core]
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True  # its owner holds it: alive
            fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def _returned(self) -> bool:
        """Whether no borrower holds any of this worker's cores."""
        for core in self.owned:
            fd = _try_lock(self.directory / f"core{core[0]}.borrow")
            if fd is None:
                return False
            os.close(fd)
        return True

    def _is_lent(self, core: Core) -> bool:
        return self._state(core, 1) == b"1"

    def _state(self, core: Core, size: int) -> bytes:
        """The first `size` bytes of another owner's lock file (b"" where none was ever made)."""
        fd = self._states.get(core)
        if fd is None:
            try:
                fd = self._states[core] = os.open(self.directory / f"core{core[0]}.lock", os.O_RDONLY)
            except FileNotFoundError:
                return b""
        return os.pread(fd, size, 0)

    def _give_back(self, cores: list[Core]) -> None:
        for core in cores:
            os.close(self.borrowed.pop(core))

    def _apply(self) -> None:
        # Pin first: OpenMP threads the resize starts inherit the engine loop thread's affinity.
        import torch  # here, not at the top: the control plane reads bindings without loading torch
        pin_threads(self.cpus())
        torch.set_num_threads(self.threads)
