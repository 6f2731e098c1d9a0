"""Simulated hosts: Linux network namespaces on a bridge, each with its own IP and its own loopback, so that
127.0.0.1 on one host is not another host's. Tests and benchmarks of what crosses hosts start one Ray node per host.

    with SimulatedHosts("abc", workdir) as hosts:
        hosts.start_ray_head("a", num_cpus=4, resources={"host_a": 1})
        hosts.start_ray_node("b", num_cpus=0, resources={"host_b": 1})
        hosts.popen("a", ["tandem", "serve", "--address", hosts.gcs_address, ...])
        hosts.link_down("b")

The hosts live on a private /24 that no address or route of this machine overlaps; the root namespace
takes .1 on the bridge so the test process can reach them. Traffic goes only to the hosts' addresses:
`check_target` is asserted before anything is sent. Everything made is removed on exit, also after a
failure or an interrupt: every process in the namespaces (by pid; `ray stop` would kill every Ray
process on the machine, whatever its namespace), the namespaces, the bridge and the temp files. Names
carry the owner's pid, so a run that was killed outright is cleaned up by the next one.
"""
from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "tdm"
STALE = re.compile(rf"^{PREFIX}(\d+)(?:-[a-z]|[a-z]|br)$")
RAY_GCS_PORT = 6379
LOCK_PATH = "/tmp/tandem-bench.lock"
VENV_BIN = Path(sys.executable).parent
log = logging.getLogger(__name__)


@dataclass(slots=True)
class Host:
    name: str
    netns: str
    veth: str  # the root namespace's end of the host's link
    ip: str
    temp_dir: Path


def unavailable_reason() -> str | None:
    """Why simulated hosts cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return "simulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root to create network namespaces (run the tests as root)"
    if shutil.which("ip") is None:
        return "simulated hosts need iproute2's `ip` command (apt-get install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-z"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class SimulatedHosts:
    """N hosts (namespaces) on one bridge; Ray nodes on them; links that can be cut and restored."""

    def __init__(self, names: str, workdir: Path, ray_env: dict[str, str] | None = None):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.tag}br"
        self.workdir = Path(workdir)
        self.ray_env = dict(ray_env or {})
        self.names = list(names)
        self.hosts: dict[str, Host] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self.gcs_address: str | None = None
        self._previous_sigterm = None

    # ---- building and removing --------------------------------------------------------------------

    def __enter__(self) -> SimulatedHosts:
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            remove_stale()
            self.subnet = pick_subnet()
            addresses = list(self.subnet.hosts())
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{addresses[0]}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                host = Host(name, f"{self.tag}-{name}", f"{self.tag}{name}", str(addresses[i + 1]),
                            self.workdir / name)
                self.hosts[name] = host
                _ip("netns", "add", host.netns)
                _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
                _ip("link", "set", host.veth, "master", self.bridge, "up")
                _ip("-n", host.netns, "addr", "add", f"{host.ip}/{self.subnet.prefixlen}", "dev", "eth0")
                _ip("-n", host.netns, "link", "set", "eth0", "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
                host.temp_dir.mkdir(parents=True, exist_ok=True)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process in the namespaces, then remove them, the bridge and the temp files."""
        for host in self.hosts.values():
            kill_namespace_processes(host.netns)
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    # ---- addresses --------------------------------------------------------------------------------

    def ip(self, name: str) -> str:
        return self.hosts[name].ip

    def check_target(self, ip: str) -> None:
        """Refuse any destination but a host made here, reached over the bridge made here."""
        hosts = {h.ip: h for h in self.hosts.values()}
        assert ip in hosts, f"{ip} is not a simulated host ({sorted(hosts)}); refusing to send to it"
        route = json.loads(_ip("-j", "route", "get", ip))[0]
        assert route.get("dev") == self.bridge, f"{ip} is routed via {route.get('dev')}, not {self.bridge}"
        assert _ip("netns", "list").count(hosts[ip].netns) == 1, f"namespace {hosts[ip].netns} is gone"

    def url(self, name: str, port: int) -> str:
        self.check_target(self.ip(name))
        return f"http://{self.ip(name)}:{port}"

    # ---- processes --------------------------------------------------------------------------------

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        # No proxies (nothing may leave the bridge), no pointer at another Ray, and Ray as on a real
        # Linux host: the tests' RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 pins Ray's addresses to loopback.
        env = {k: v for k, v in os.environ.items()
               if not k.lower().endswith("_proxy") and k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
        env.update(self.ray_env)
        env.update(extra or {})
        env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
        return env

    def run(self, name: str, args: list[str], timeout: float = 120, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run(["ip", "netns", "exec", self.hosts[name].netns, *args], capture_output=True,
                             text=True, timeout=timeout, env=self.env(env))
        if check and out.returncode != 0:
            raise RuntimeError(f"on host {name}: {' '.join(args)} failed ({out.returncode}):\n"
                               f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def popen(self, name: str, args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start a long-running process on a host, in its own process group, output to `log`."""
        with open(log, "ab") as out:
            return subprocess.Popen(["ip", "netns", "exec", self.hosts[name].netns, *args], stdout=out,
                                    stderr=subprocess.STDOUT, env=self.env(env), start_new_session=True)

    def processes(self, name: str) -> list[str]:
        """The command lines of the processes on a host (Ray actors show as `ray::ClassName...`)."""
        lines = []
        for pid in namespace_pids(self.hosts[name].netns):
            try:
                lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
            except OSError:
                pass
        return lines

    # ---- Ray --------------------------------------------------------------------------------------

    def start_ray_head(self, name: str, num_cpus: float, resources: dict[str, float]) -> str:
        host = self.hosts[name]
        self.run(name, ["ray", "start", "--head", "--port", str(RAY_GCS_PORT), *self._ray_args(host, num_cpus,
                                                                                           resources),
                        "--include-dashboard=false"])
        self.gcs_address = f"{host.ip}:{RAY_GCS_PORT}"
        self.wait_for_node(host.ip)
        log.info("Ray head on host %s (%s)", name, self.gcs_address)
        return self.gcs_address

    def start_ray_node(self, name: str, num_cpus: float, resources: dict[str, float]) -> None:
        """Join a host to the cluster and return once the GCS lists it alive. One at a time: nodes that
        start together on one file system race for their socket names."""
        host = self.hosts[name]
        self.run(name, ["ray", "start", "--address", self.gcs_address, *self._ray_args(host, num_cpus, resources)])
        self.wait_for_node(host.ip)
        log.info("Ray node on host %s (%s) joined", name, host.ip)

    def stop_ray_node(self, name: str) -> None:
        kill_namespace_processes(self.hosts[name].netns)

    def _ray_args(self, host: Host, num_cpus: float, resources: dict[str, float]) -> list[str]:
        return ["--node-ip-address", host.ip, "--num-cpus", str(num_cpus), "--resources", json.dumps(resources),
                "--temp-dir", str(host.temp_dir), "--object-store-memory", str(128 * 2**20),
                "--disable-usage-stats"]

    def alive_nodes(self) -> list[str]:
        """IPs of the nodes the GCS holds alive (asked from the head's namespace)."""
        script = ("import json, sys\nfrom ray._raylet import GcsClient\n"
                  "infos = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=10).values()\n"
                  "print(json.dumps([i.node_manager_address for i in infos if i.state == 0]))")
        head = next(h for h in self.hosts.values() if self.gcs_address.startswith(f"{h.ip}:"))
        out = self.run(head.name, [sys.executable, "-c", script, self.gcs_address], timeout=60)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def wait_for_node(self, ip: str, alive: bool = True, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while (ip in self.alive_nodes()) != alive:
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {ip} is not {'alive' if alive else 'dead'} after {timeout_s:.0f} s")
            time.sleep(0.5)

    # ---- links ------------------------------------------------------------------------------------

    def link_down(self, name: str) -> None:
        log.info("link of host %s down", name)
        _ip("link", "set", self.hosts[name].veth, "down")

    def link_up(self, name: str) -> None:
        log.info("link of host %s up", name)
        _ip("link", "set", self.hosts[name].veth, "up")


@contextlib.contextmanager
def ray_lock(timeout_s: float = 600):
    """Hold the machine's Ray lock (one Ray cluster at a time), unless an ancestor process already holds it
    (`flock /tmp/tandem-bench.lock pytest ...`), which taking it again would deadlock on."""
    if _held_by_ancestor(LOCK_PATH):
        yield
        return
    with open(LOCK_PATH, "a") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{LOCK_PATH} is held by another Ray run for {timeout_s:.0f} s")
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _held_by_ancestor(path: str) -> bool:
    if not os.path.exists(path):
        return False
    inode = os.stat(path).st_ino
    holders = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
            holders.add(int(fields[4]))
    pid = os.getppid()
    while pid > 1:
        if pid in holders:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


# ---- helpers ----------------------------------------------------------------------------------------

def _ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pick_subnet() -> ipaddress.IPv4Network:
    """The first 10.213.x.0/24 that overlaps no address or route of this machine."""
    used = [ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}").network
            for link in json.loads(_ip("-j", "-4", "addr")) for a in link.get("addr_info", [])]
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all")):
        if route.get("dst") not in (None, "default"):
            used.append(ipaddress.ip_network(route["dst"], strict=False))
    for x in range(256):
        candidate = ipaddress.ip_network(f"10.213.{x}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise RuntimeError("no free 10.213.x.0/24 subnet for simulated hosts")


def namespace_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def kill_namespace_processes(netns: str, grace_s: float = 3.0) -> None:
    """SIGTERM every process in the namespace, then SIGKILL what is left (Ray daemonizes its processes,
    so they are found by namespace, not by process group)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = namespace_pids(netns)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while namespace_pids(netns) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not namespace_pids(netns):
            return


def remove_stale() -> None:
    """Remove namespaces and links left by a run whose process is gone (killed before it could clean)."""
    for line in _ip("netns", "list").splitlines():
        netns = line.split()[0] if line.strip() else ""
        match = STALE.match(netns)
        if match and not _alive(int(match.group(1))):
            kill_namespace_processes(netns)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
    for link in json.loads(_ip("-j", "link")):
        match = STALE.match(link["ifname"])
        if match and not _alive(int(match.group(1))):
            subprocess.run(["ip", "link", "del", link["ifname"]], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
