"""Issue 40's pull figure: KV pull GB/s from a prefill engine of TP 2 into a decode engine of TP 1, against the same
pull between two TP 1 engines (the same layout on both ends), in one run.

A TP engine's ranks share one KV cache, rank-major (engine/kv_cache.py): a pull from it gathers every head of a block
from the ranks' slots, where a TP 1 cache sends a slice as it lies. Model: bench/tp_step.py's (SmolLM2's size, 12
heads of 48, 4 KV heads). Each arm prefills --prompts prompts of --prompt-len tokens on the prefill engine, leases
their blocks and pulls them into the decode engine over gRPC (network path) and by same-host shared memory; the
median GB/s of the pulls per arm and path.

    .venv/bin/python bench/tp_pull.py
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.stdout.reconfigure(line_buffering=True)

from bench.tp_step import SHAPE  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.model_loader import build_random_model  # noqa: E402
from kv_transfer import KVServerConfig, KVTransferServer  # noqa: E402
from kv_transfer.grpc_client import GrpcKVClient  # noqa: E402

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def pulls(prefill: Engine, decode: Engine, shm: bool, prompts: list[list[int]], tag: str) -> list[float]:
    """GB/s of each prompt's pull."""
    server = KVTransferServer(prefill.kv_cache, "t", KVServerConfig()).start()
    client = GrpcKVClient(decode.kv_cache, "t", shared_memory=shm)
    rates = []
    try:
        for i, prompt in enumerate(prompts):
            rid = f"{tag}-{i}"
            req = prefill.make_request(rid, prompt, PARAMS)
            req.do_remote_decode = True
            prefill.add(req)
            params = None
            while params is None:
                assert prefill.has_unfinished_requests(), "the prefill ended without handing its KV over"
                params = next((o.kv_transfer_params for o in prefill.step() if o.kv_transfer_params), None)
            full = params["num_tokens"] // prefill.config.block_size
            handle = server.lease(rid, params["block_ids"], req.block_hashes[:full], params["num_tokens"],
                                  on_release=prefill.block_manager.free_block_ids)
            target = decode.make_request(rid, prompt, PARAMS)
            indices = decode.reserve_for_import(target)
            stats = client.pull(handle, [target.block_table[j] for j in indices], indices)
            client.release(handle)
            decode.release_import(target)
            rates.append(stats.num_bytes / stats.seconds / 1e9)
    finally:
        client.close()
        server.stop()
    return rates


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    model = build_random_model(Path(tempfile.gettempdir()) / "tandem-tp-step-model", "llama", seed=0, **SHAPE)
    rng = random.Random(0)

    def engine(tp: int) -> Engine:
        return Engine(EngineConfig(model=str(model), dtype=args.dtype, tensor_parallel_size=tp, num_threads=2,
                                   kv_cache_memory_gb=1.0, kv_cache_shared=True, enable_prefix_caching=False))

    decode = engine(1)
    rows = []
    try:
        for tp in (1, 2):
            prefill = engine(tp)
            try:
                for shm in (False, True):
                    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
                    rates = pulls(prefill, decode, shm, prompts, f"tp{tp}-{shm}")
                    rows.append((tp, "shared memory" if shm else "gRPC", statistics.median(rates)))
                    print(f"P TP={tp} -> D TP=1 over {rows[-1][1]}: median {rows[-1][2]:.2f} GB/s")
            finally:
                prefill.close()
    finally:
        decode.close()
    print(f"\n{args.dtype}, {args.prompts} pulls of {args.prompt_len}-token prompts each")
    print("| path | P TP=1 -> D TP=1 (GB/s) | P TP=2 -> D TP=1 (GB/s) | ratio |")
    print("|---|---|---|---|")
    for path in ("gRPC", "shared memory"):
        one = next(r for t, p_, r in rows if t == 1 and p_ == path)
        two = next(r for t, p_, r in rows if t == 2 and p_ == path)
        print(f"| {path} | {one:.2f} | {two:.2f} | {two / one:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
