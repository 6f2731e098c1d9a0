"""KV transfer throughput: a 2,048-token SmolLM2 prompt's KV between two processes, against baselines.

Each case runs in a fresh pair of processes (sender, receiver), so allocator
and thread settings never leak from one case into another:

  tandem gRPC / tandem torch.distributed   KVTransferServer -> GrpcKVClient / DistKVClient
  ... scattered blocks                      same, with shuffled block ids on both sides (gather + scatter)
  ... no checksums                          KVServerConfig(dist_checksums=False)
  bare gRPC byte stream                     one server-streaming call of raw 4 MiB bytes messages
  bare Gloo send/recv                       one send/recv of the whole buffer on a two-rank Gloo group
  raw TCP                                   sendall / recv_into on one loopback socket
  tandem gRPC (CUDA caches)                 with a GPU: both processes' caches on it
  NCCL case                                 only with two visible GPUs (NCCL refuses two ranks on one GPU)

"CPU ms/pull" is the user + system time of both processes per pull: on a shared
box it says what the wall-clock numbers cannot (less is faster on idle cores).

Then layer-wise pipelining: the sender "prefills" (busy compute, --layer-ms per
layer) and marks layers ready one by one while the receiver already pulls,
against prefill-then-transfer. Run: .venv/bin/python bench/transfer.py
(`--only TEXT` runs just the cases whose name contains TEXT).
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine.kv_cache import KVCache, KVLayout  # noqa: E402
from kv_transfer.dist_client import DistKVClient  # noqa: E402
from kv_transfer.dist_group import open_store  # noqa: E402
from kv_transfer.grpc_client import GrpcKVClient  # noqa: E402
from kv_transfer.malloc import keep_message_buffers_in_heap  # noqa: E402
from kv_transfer.server import KVTransferServer  # noqa: E402
from kv_transfer.server_config import KVServerConfig  # noqa: E402

TOKEN = "bench"
BARE_CHUNK = 4 << 20


def layout_for(device: str) -> KVLayout:
    return KVLayout("smollm2-135m-instruct", "float32", 16, 30, 3, 64)


def block_ids(num_blocks: int, scattered: bool, seed: int) -> list[int]:
    ids = list(range(num_blocks))
    if scattered:
        random.Random(seed).shuffle(ids)
    return ids


def busy(seconds: float) -> None:
    """Keep one core busy with real tensor work for `seconds` (a stand-in for a layer's prefill)."""
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


# ---- senders (process 1) ----------------------------------------------------------------------

def send_tandem(args, case, conn) -> None:
    layout, device = layout_for(case["device"]), case["device"]
    cache = KVCache(layout, args.blocks + 8, device)
    for t in cache.k + cache.v:
        t.normal_()
    config = KVServerConfig(dist=case["dist"], max_message_bytes=16 << 20, dist_checksums=case.get("checksums", True))
    server = KVTransferServer(cache, TOKEN, config).start()
    ids = block_ids(args.blocks, case.get("scattered", False), seed=1)
    conn.send(server.lease("bench", ids, [], args.blocks * layout.block_size, lambda _: None, ttl=3600))
    while True:  # pipelining rounds: ("prefill", request_id, layer_ms, layer_wise)
        _, request_id, layer_ms, layer_wise = conn.recv()
        n = args.blocks * layout.block_size
        if not layer_wise:
            for _ in range(layout.num_layers):
                busy(layer_ms / 1000)
        handle = server.lease(request_id, ids, [], n, lambda _: None, ttl=3600,
                              layers_ready=0 if layer_wise else None)
        conn.send(handle)
        if layer_wise:
            for layer in range(layout.num_layers):
                busy(layer_ms / 1000)
                server.mark_layers_ready(request_id, layer + 1)


def bare_grpc_server(nbytes: int) -> grpc.Server:
    """A started server streaming `nbytes` of raw 4 MiB bytes messages per call on `server.address`."""
    payload = torch.randn(nbytes // 4).numpy().view("uint8")

    def stream(request, context):
        for off in range(0, len(payload), BARE_CHUNK):
            yield payload[off:off + BARE_CHUNK].tobytes()

    server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_send_message_length", 16 << 20)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Bytes", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})])
    server.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    return server


def send_interleaved(args, case, conn) -> None:
    """Our server(s) and the bare baseline in one process: the receiver alternates between them."""
    layout = layout_for("cpu")
    cache = KVCache(layout, args.blocks + 8, "cpu")
    for t in cache.k + cache.v:
        t.normal_()
    ids = block_ids(args.blocks, False, seed=1)
    servers, handles = [], {}
    for name, checksums in case["tandem"].items():
        config = KVServerConfig(dist=case["dist"], max_message_bytes=16 << 20, dist_checksums=checksums)
        servers.append(KVTransferServer(cache, TOKEN, config).start())
        handles[name] = servers[-1].lease("bench", ids, [], args.blocks * layout.block_size, lambda _: None,
                                          ttl=3600)
    if case["dist"]:
        conn.send((handles, bare_gloo_sender(case["nbytes"])))
    else:
        servers.append(bare_grpc_server(case["nbytes"]))
        conn.send((handles, servers[-1].address))
    threading.Event().wait()


def send_bare_grpc(args, case, conn) -> None:
    if case.get("heap_tuning"):
        keep_message_buffers_in_heap(16 << 20)
    server = bare_grpc_server(case["nbytes"])
    conn.send(server.address)
    threading.Event().wait()


def bare_gloo_sender(nbytes: int) -> int:
    """A thread that sends `nbytes` in one message over a two-rank Gloo group per receiver request;
    returns the group's store port."""
    store = open_store("127.0.0.1", 0, True, 60)

    def serve():
        group = _bare_group(store, 0)
        buf = torch.randn(nbytes // 4)
        try:
            while True:
                group.recv([torch.empty(1)], 1, 0).wait()  # the receiver asks for the next round
                group.send([buf], 1, 1).wait()
        except RuntimeError:
            pass  # the receiver is gone
    threading.Thread(target=serve, daemon=True).start()
    return store.port


def send_bare_gloo(args, case, conn) -> None:
    conn.send(bare_gloo_sender(case["nbytes"]))
    threading.Event().wait()


def send_raw_tcp(args, case, conn) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    peer, _ = listener.accept()
    payload = torch.randn(case["nbytes"] // 4).numpy().view("uint8")
    while peer.recv(1):
        peer.sendall(payload)


def _bare_group(store, rank: int) -> dist.ProcessGroup:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=60)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore("bare/", store), rank, 2, options)


# ---- receivers (process 2): return per-round seconds ------------------------------------------

def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(args, fn) -> dict:
    """Wall seconds per round, and CPU seconds per round of both processes (robust to a busy box)."""
    fn()  # warm-up: connections, page faults, allocator
    seconds = []
    cpu = cpu_seconds(os.getpid()) + cpu_seconds(args.sender_pid)
    for _ in range(args.repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    cpu = cpu_seconds(os.getpid()) + cpu_seconds(args.sender_pid) - cpu
    return {"seconds": seconds, "cpu": cpu / args.repeats}


def recv_tandem(args, case, handle, sender) -> dict:
    device = case.get("recv_device", case["device"])
    layout = layout_for(device)
    cache = KVCache(layout, args.blocks + 8, device)
    client = (DistKVClient if case["dist"] else GrpcKVClient)(cache, TOKEN, max_message_bytes=16 << 20)
    dst = block_ids(args.blocks, case.get("scattered", False), seed=2)
    everything = list(range(args.blocks))
    result = timed(args, lambda: client.pull(handle, dst, everything))
    if case.get("pipelining"):
        result["pipelining"] = {False: [], True: []}
        for r in range(args.repeats):  # alternating, so that load drift hits both alike
            for layer_wise in (False, True):
                start = time.perf_counter()
                sender.send(("prefill", f"p{layer_wise}{r}", args.layer_ms, layer_wise))
                client.pull(sender.recv(), dst, everything)
                result["pipelining"][layer_wise].append(time.perf_counter() - start)
    return result


def bare_grpc_pull(address: str, nbytes: int):
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 16 << 20)])
    call = channel.unary_stream("/bench.Bytes/Stream")

    def pull():
        assert sum(len(m) for m in call(b"", timeout=60)) == nbytes
    return pull


def bare_gloo_pull(port: int, nbytes: int):
    group = _bare_group(open_store("127.0.0.1", port, False, 60), 1)
    buf = torch.empty(nbytes // 4)

    def pull():
        group.send([torch.empty(1)], 0, 0).wait()
        group.recv([buf], 0, 1).wait()
    return pull


def recv_bare_grpc(args, case, address, sender) -> dict:
    if case.get("heap_tuning"):
        keep_message_buffers_in_heap(16 << 20)
    return timed(args, bare_grpc_pull(address, case["nbytes"]))


def recv_bare_gloo(args, case, port, sender) -> dict:
    return timed(args, bare_gloo_pull(port, case["nbytes"]))


def recv_interleaved(args, case, info, sender) -> dict:
    """One pull of each kind per round, in an order that rotates every round; seconds per kind."""
    handles, bare = info
    layout = layout_for("cpu")
    cache = KVCache(layout, args.blocks + 8, "cpu")
    client_type = DistKVClient if case["dist"] else GrpcKVClient
    everything = list(range(args.blocks))
    pulls = {}
    for name, handle in handles.items():
        client = client_type(cache, TOKEN, max_message_bytes=16 << 20)
        pulls[name] = lambda client=client, handle=handle: client.pull(handle, everything, everything)
    baseline = case["baseline"]
    pulls[baseline] = (bare_gloo_pull if case["dist"] else bare_grpc_pull)(bare, case["nbytes"])
    names = list(pulls)
    for name in names:
        pulls[name]()  # warm-up
    seconds = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            pulls[name]()
            seconds[name].append(time.perf_counter() - start)
    return {"interleaved": seconds}


def recv_raw_tcp(args, case, port, sender) -> dict:
    peer = socket.create_connection(("127.0.0.1", port))
    view = memoryview(bytearray(case["nbytes"]))

    def pull():
        peer.sendall(b"x")
        got = 0
        while got < len(view):
            got += peer.recv_into(view[got:])
    return timed(args, pull)


# ---- driver -----------------------------------------------------------------------------------

def _sender_main(args, case, conn) -> None:
    torch.set_num_threads(1)
    try:
        case["send"](args, case, conn)
    except (EOFError, ConnectionError, RuntimeError):
        pass  # the receiver is gone: it has its numbers (a real failure shows on its side)


def _receiver_main(args, case, info, sender, out) -> None:
    torch.set_num_threads(1)
    out.send(case["recv"](args, case, info, sender))


def run_case(args, case) -> dict:
    ctx = mp.get_context("spawn")
    to_sender, sender_end = ctx.Pipe()
    sender = ctx.Process(target=_sender_main, args=(args, case, sender_end), daemon=True)
    sender.start()
    info = to_sender.recv()
    args.sender_pid = sender.pid
    results, results_end = ctx.Pipe()
    receiver = ctx.Process(target=_receiver_main, args=(args, case, info, to_sender, results_end), daemon=True)
    receiver.start()
    try:
        return results.recv()
    finally:
        receiver.kill()
        sender.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layer-ms", type=float, default=3.0, help="simulated prefill time per layer")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this text")
    parser.add_argument("--interleaved-repeats", type=int, default=60,
                        help="rounds of the interleaved comparison (one pull of each kind per round)")
    args = parser.parse_args()
    args.blocks = args.tokens // 16
    layout = layout_for("cpu")
    nbytes = 2 * layout.num_layers * args.blocks * layout.bytes_per_block_per_layer
    cases = {
        "tandem gRPC": dict(send=send_tandem, recv=recv_tandem, dist=False, device="cpu", pipelining=True),
        "tandem gRPC, scattered blocks": dict(send=send_tandem, recv=recv_tandem, dist=False, device="cpu",
                                              scattered=True),
        "bare gRPC byte stream": dict(send=send_bare_grpc, recv=recv_bare_grpc),
        "bare gRPC byte stream + heap tuning": dict(send=send_bare_grpc, recv=recv_bare_grpc, heap_tuning=True),
        "tandem torch.distributed (gloo)": dict(send=send_tandem, recv=recv_tandem, dist=True, device="cpu",
                                                pipelining=True),
        "tandem torch.distributed (gloo), scattered blocks": dict(send=send_tandem, recv=recv_tandem, dist=True,
                                                                  device="cpu", scattered=True),
        "tandem torch.distributed (gloo), no checksums": dict(send=send_tandem, recv=recv_tandem, dist=True,
                                                              device="cpu", checksums=False),
        "bare Gloo send/recv": dict(send=send_bare_gloo, recv=recv_bare_gloo),
        "raw TCP": dict(send=send_raw_tcp, recv=recv_raw_tcp),
    }
    gpus = torch.cuda.device_count()
    if gpus >= 1:  # gRPC between two processes sharing one GPU: device -> host -> wire -> host -> device
        cases["tandem gRPC (CUDA caches)"] = dict(send=send_tandem, recv=recv_tandem, dist=False, device="cuda:0",
                                                  recv_device="cuda:0")
    if gpus >= 2:  # NCCL refuses two ranks on one GPU (since NCCL 2.5), so the receiver takes the second one
        cases["tandem torch.distributed (nccl)"] = dict(send=send_tandem, recv=recv_tandem, dist=True,
                                                         device="cuda:0", recv_device="cuda:1", pipelining=True)
    print(f"KV of {args.tokens} tokens: {nbytes / 1e6:.1f} MB ({layout}); {args.repeats} rounds after a warm-up; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    if gpus < 2:
        print(f"NCCL case skipped: it needs two visible GPUs ({gpus} here)")
    print(f"{'case':52s} {'median GB/s':>12s} {'best GB/s':>10s} {'CPU ms/pull':>12s}")
    pipelining = {}
    for name, case in cases.items():
        if args.only not in name:
            continue
        case["nbytes"] = nbytes
        result = run_case(args, case)
        secs = result["seconds"]
        print(f"{name:52s} {nbytes / statistics.median(secs) / 1e9:12.2f} {nbytes / min(secs) / 1e9:10.2f} "
              f"{result['cpu'] * 1e3:12.0f}", flush=True)
        if "pipelining" in result:
            pipelining[name] = (statistics.median(secs), result["pipelining"])
    interleaved = {
        "gRPC": dict(dist=False, tandem={"tandem gRPC": True}, baseline="bare gRPC byte stream + heap tuning"),
        "torch.distributed (gloo)": dict(dist=True, baseline="bare Gloo send/recv", tandem={
            "tandem torch.distributed (gloo)": True, "tandem torch.distributed (gloo), no checksums": False}),
    }
    print(f"\nInterleaved: our transport and its bare baseline in the same two processes, one pull of each per "
          f"round in rotating order, {args.interleaved_repeats} rounds; ratio = per-round time of the "
          f"baseline / ours, median over rounds")
    print(f"{'case':52s} {'median GB/s':>12s} {'vs baseline':>12s}")
    for name, case in interleaved.items():
        if args.only not in f"interleaved {name}" and not any(args.only in n for n in case["tandem"]):
            continue
        case.update(send=send_interleaved, recv=recv_interleaved, nbytes=nbytes)
        seconds = run_case(argparse.Namespace(**{**vars(args), "repeats": args.interleaved_repeats}),
                           case)["interleaved"]
        base = seconds[case["baseline"]]
        for kind, secs in seconds.items():
            ratio = statistics.median(b / s for b, s in zip(base, secs))
            print(f"{kind:52s} {nbytes / statistics.median(secs) / 1e9:12.2f} {ratio:11.2f}x", flush=True)
    compute = layout.num_layers * args.layer_ms / 1000
    print(f"\nLayer-wise pipelining: prefill = {layout.num_layers} layers x {args.layer_ms} ms busy compute "
          f"= {compute * 1000:.0f} ms; medians in ms")
    print(f"{'transport':36s} {'transfer':>9s} {'prefill, then pull':>19s} {'layer-wise':>11s} {'saved':>7s}")
    for name, (transfer, runs) in pipelining.items():
        sequential, layered = statistics.median(runs[False]), statistics.median(runs[True])
        saved = statistics.median(a - b for a, b in zip(runs[False], runs[True]))  # per alternating pair
        print(f"{name:36s} {transfer * 1e3:9.1f} {sequential * 1e3:19.1f} {layered * 1e3:11.1f} {saved * 1e3:7.1f}")
    print(f"(saved: median over back-to-back pairs; at most min(prefill, transfer) can be saved; "
          f"load average now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
