"""KV transfer between simulated hosts: bench/transfer.py's pull (a 2,048-token SmolLM2 prompt's KV, 94 MB)
from a sender on host a to a receiver on host b, two network namespaces joined by veth links on a bridge
(bench/netns.py), next to the same pair of processes on host a's loopback. Raw TCP is the baseline of each.

The sender advertises its host's address (as a prefill worker advertises its node's IP), so the pull
crosses the bridge. Nothing is sent anywhere but the two hosts this script makes. Needs root; run it alone:

    flock /tmp/tandem-bench.lock .venv/bin/python bench/transfer_hosts.py
"""
from __future__ import annotations

import argparse
import pickle
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.transfer import TOKEN, layout_for  # noqa: E402

CASES = ["tandem gRPC", "tandem torch.distributed", "raw TCP"]


# ---- the two roles, each in its own process on its own host ---------------------------------------

def sender(args) -> None:
    """Serve the KV of `args.blocks` blocks on `args.host`; write what the receiver needs to `args.out`."""
    import torch

    from engine.kv_cache import KVCache
    from kv_transfer.server import KVTransferServer
    from kv_transfer.server_config import KVServerConfig

    torch.set_num_threads(1)
    layout = layout_for("cpu")
    if args.case == "raw TCP":
        listener = socket.create_server((args.host, 0))
        info = (args.host, listener.getsockname()[1], args.blocks * layout.block_size * layout.bytes_per_token)
        threading.Thread(target=_serve_raw, args=(listener, info[2]), daemon=True).start()
    else:
        cache = KVCache(layout, args.blocks + 8, "cpu")
        cache.kv.normal_()
        config = KVServerConfig(advertise_host=args.host, dist=args.case.endswith("distributed"))
        server = KVTransferServer(cache, TOKEN, config).start()
        ids = list(range(args.blocks))
        info = server.lease("bench", ids, [], args.blocks * layout.block_size, lambda _: None, ttl=3600)
    Path(args.out).write_bytes(pickle.dumps(info))
    threading.Event().wait()


def _serve_raw(listener: socket.socket, nbytes: int) -> None:
    payload = bytes(nbytes)
    peer, _ = listener.accept()
    while peer.recv(1):
        peer.sendall(payload)


def receiver(args) -> None:
    """Pull `args.repeats` times after a warm-up; print the seconds of each pull."""
    import torch

    from engine.kv_cache import KVCache
    from kv_transfer.dist_client import DistKVClient
    from kv_transfer.grpc_client import GrpcKVClient

    torch.set_num_threads(1)
    info = pickle.loads(Path(args.info).read_bytes())
    if args.case == "raw TCP":
        peer = socket.create_connection(info[:2])
        view = memoryview(bytearray(info[2]))

        def pull():
            peer.sendall(b"x")
            got = 0
            while got < len(view):
                got += peer.recv_into(view[got:])
    else:
        cache = KVCache(layout_for("cpu"), args.blocks + 8, "cpu")
        client = (DistKVClient if args.case.endswith("distributed") else GrpcKVClient)(cache, TOKEN)
        everything = list(range(args.blocks))

        def pull():
            client.pull(info, everything, everything)
    pull()
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        pull()
        seconds.append(time.perf_counter() - start)
    print(" ".join(f"{s:.6f}" for s in seconds))


# ---- driver (root namespace) -----------------------------------------------------------------------

def measure(hosts, case: str, receiver_host: str, args, workdir: Path) -> float:
    """Median seconds per pull from a sender on host a to a receiver on `receiver_host`."""
    address = "127.0.0.1" if receiver_host == "a" else hosts.ip("a")
    if address != "127.0.0.1":
        hosts.check_target(address)
    info = workdir / "info.pickle"
    info.unlink(missing_ok=True)
    me = [sys.executable, __file__]
    common = ["--case", case, "--tokens", str(args.tokens)]
    send = hosts.popen("a", [*me, "sender", *common, "--host", address, "--out", str(info)], workdir / "sender.log")
    try:
        deadline = time.monotonic() + 120
        while not info.exists():
            assert send.poll() is None and time.monotonic() < deadline, (workdir / "sender.log").read_text()
            time.sleep(0.2)
        out = hosts.run(receiver_host, [*me, "receiver", *common, "--info", str(info),
                                        "--repeats", str(args.repeats)], timeout=600)
        return statistics.median(float(s) for s in out.stdout.split())
    finally:
        send.kill()
        send.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", choices=["sender", "receiver"], help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--info", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    layout = layout_for("cpu")
    args.blocks = args.tokens // layout.block_size
    if args.role == "sender":
        return sender(args)
    if args.role == "receiver":
        return receiver(args)

    from bench.netns import SimulatedHosts, ray_lock, unavailable_reason

    reason = unavailable_reason()
    if reason:
        sys.exit(f"transfer_hosts: {reason}")
    nbytes = args.blocks * layout.block_size * layout.bytes_per_token
    print(f"{args.tokens} tokens of SmolLM2-135M KV ({nbytes / 1e6:.1f} MB per pull), median of {args.repeats} "
          f"pulls after a warm-up; sender and receiver are single-threaded processes")
    print(f"{'case':<26} {'loopback GB/s':>14} {'cross-host GB/s':>16}")
    with ray_lock(), SimulatedHosts("ab", Path(tempfile.mkdtemp(prefix="tdm"))) as hosts:
        workdir = hosts.workdir
        for case in CASES:
            loopback = nbytes / measure(hosts, case, "a", args, workdir) / 1e9
            cross = nbytes / measure(hosts, case, "b", args, workdir) / 1e9
            print(f"{case:<26} {loopback:>14.2f} {cross:>16.2f}", flush=True)


if __name__ == "__main__":
    main()
