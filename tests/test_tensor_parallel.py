"""Tensor parallelism inside an engine (engine/parallel/): ranks as real processes over a Gloo group, each holding its
shard of the weights and KV heads; TP=2 must give TP=1's greedy tokens exactly (fp32), on the fused CPU layers
(Llama, Qwen2) and on HF's own (Qwen3's q/k norms), with KV heads split or replicated."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 200, 3000, 17] * 7, [7, 7, 8, 1000], list(range(100, 180))]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def engine(model_dir: str, tp: int) -> Engine:
    return Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=96, tensor_parallel_size=tp))


def greedy(model_dir: str, tp: int, prompts=PROMPTS, params=GREEDY) -> tuple[list[list[int]], Engine]:
    e = engine(model_dir, tp)
    try:
        tokens = [o.token_ids for o in e.generate(prompts, params)]
        e.last_stats, e.used_shm = e.stats(), e.runner.tp is not None and e.runner.tp.shm is not None
        return tokens, e
    finally:
        e.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from engine.model_loader import build_random_model
    root = tmp_path_factory.mktemp("tp-models")
    return {
        "llama": str(build_random_model(root / "llama", "llama", seed=3)),
        "qwen2": str(build_random_model(root / "qwen2", "qwen2", seed=4)),
        "qwen3": str(build_random_model(root / "qwen3", "qwen3", seed=5, head_dim=16)),
        "one-kv-head": str(build_random_model(root / "one-kv", "llama", seed=6, num_kv_heads=1)),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "one-kv-head"])
def test_two_ranks_give_one_ranks_greedy_tokens_exactly(models, arch):
    one, single = greedy(models[arch], 1)
    two, sharded = greedy(models[arch], 2)
    assert two == one
    assert all(len(t) == GREEDY.max_tokens for t in two)
    fused = {"llama": 2, "qwen2": 2, "qwen3": 0, "one-kv-head": 2}[arch]  # Qwen3 runs HF's own layers
    assert single.runner.fused_layers == sharded.runner.fused_layers == fused
    # Collectives went through the ranks' shared memory, none over Gloo (x86-64: where that memory is used).
    from engine.parallel.shm_collectives import supported
    assert sharded.used_shm == supported()
    assert sharded.last_stats["tp_shm_too_large"] == 0
    kv_heads = single.runner.layout.num_kv_heads
    # Each rank caches its own KV heads: half of them, or the one it shares when there are fewer than ranks.
    assert sharded.runner.layout == single.runner.layout  # the whole model's: transfers move every head
    assert sharded.runner.kv_cache.k[0].shape[2] == max(1, kv_heads // 2)


def test_each_rank_holds_half_the_weights(models):
    _, single = greedy(models["llama"], 1, PROMPTS[:1])
    _, sharded = greedy(models["llama"], 2, PROMPTS[:1])
    whole = single.runner.rank_weight_bytes[0]
    per_rank = sharded.runner.rank_weight_bytes
    assert len(per_rank) == 2
    # Measured from each rank's own parameters: half, less the norms every rank keeps whole.
    assert all(0.49 * whole <= b <= 0.51 * whole for b in per_rank), (whole, per_rank)


def test_forks_and_prefix_hits_copy_and_read_the_same_blocks_on_every_rank(models):
    """n=2 forks the prompt's last partial block (a block copy every rank must make); the second generate hits the
    first one's cached prefix (blocks rank 0's block manager shares, which the other ranks must hold too)."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2)
    results = {}
    for tp in (1, 2):
        e = engine(models["llama"], tp)
        try:
            first = [o.candidates for o in e.generate(PROMPTS[:1], params)]
            again = e.generate([PROMPTS[0] + [11, 12]], GREEDY)[0]
            assert again.num_cached_tokens >= 32
            results[tp] = ([[c.token_ids for c in cands] for cands in first], again.token_ids)
        finally:
            e.close()
    assert results[2] == results[1]


@pytest.mark.parametrize("fields, tp, message", [
    (dict(num_attention_heads=4, num_key_value_heads=2), 3, "does not divide the model's 4 query heads"),
    (dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48), 2,
     "neither divides nor is a multiple of the model's 3 KV heads"),
    (dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=30), 4, "MLP width 30"),
])
def test_a_model_that_does_not_split_is_refused_naming_the_numbers(fields, tp, message):
    from transformers import AutoConfig
    from engine.parallel.sharding import plan_for

    config = AutoConfig.for_model("llama", architectures=["LlamaForCausalLM"],
                                  **{"hidden_size": 64, "intermediate_size": 128, **fields})
    with pytest.raises(ValueError, match=message):
        plan_for(config, 0, tp)


def test_an_architecture_it_cannot_shard_is_refused_before_any_rank_starts(tmp_path):
    from engine.model_loader import build_random_model
    model = build_random_model(tmp_path / "gemma2", "gemma2", seed=0, head_dim=16)
    with pytest.raises(ValueError, match="this model is Gemma2ForCausalLM"):
        engine(str(model), 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)


def test_a_rank_that_dies_fails_the_engine_naming_it_and_no_step_hangs(models):
    """The engine cannot step again: RankFailed (not a failed request: a worker's requests migrate once it is
    restarted), at once."""
    from engine.errors import RankFailed

    e = engine(models["llama"], 2)
    try:
        assert e.generate(PROMPTS[:1], GREEDY)[0].finish_reason == "length"
        rank = e.ranks.processes[0]
        os.kill(rank.pid, signal.SIGKILL)
        rank.join(10)
        started = time.monotonic()
        with pytest.raises(RankFailed, match="rank 1 exited with code -9"):
            e.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - started < 30
        assert not e.ranks.alive() and e.stats()["tp_ranks_alive"] == 1
    finally:
        e.close()


def test_the_other_ranks_exit_when_rank_0_is_killed(models):
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.getcwd()!r})
        from engine.config import EngineConfig
        from engine.engine import Engine
        if __name__ == "__main__":
            e = Engine(EngineConfig(model={models['llama']!r}, dtype="float32", num_kv_blocks=32,
                                    tensor_parallel_size=2))
            print(e.ranks.processes[0].pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.2)
    assert not _running(pid), "a rank outlived its engine"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def move(prefill: Engine, decode: Engine, server, client, request_id: str, prompt: list[int]):
    """tests/test_kv_transfer_engine.py's `disaggregate`, and no lease left behind."""
    from tests.test_kv_transfer_engine import disaggregate

    moved = disaggregate(prefill, decode, server, client, request_id, prompt)
    assert not server.leases
    return moved


@pytest.fixture(scope="module")
def tp_engines(models):
    """Prefill and decode engines of TP 1 and 2 on one model, and a colocated TP=1 reference."""
    made = {(role, tp): Engine(EngineConfig(model=models["llama"], dtype="float32", num_kv_blocks=64,
                                            tensor_parallel_size=tp, kv_cache_shared=role == "prefill"))
            for role in ("prefill", "decode") for tp in (1, 2)}
    made["reference"] = engine(models["llama"], 1)
    yield made
    for e in made.values():
        e.close()


@pytest.mark.parametrize("transport", ["grpc", "torch_dist", "shm"])
@pytest.mark.parametrize("sizes", [(2, 1), (1, 2), (2, 2)], ids=lambda s: f"P{s[0]}-D{s[1]}")
def test_kv_moves_whole_between_engines_of_different_tp_sizes(tp_engines, sizes, transport):
    """Rank 0 of a TP engine reads and writes every head of a block (its ranks share one cache), so pulls between
    TP sizes move the whole model's layout: nothing is recomputed and decode gives the colocated tokens."""
    from kv_transfer import KVServerConfig, KVTransferServer
    from kv_transfer.dist_client import DistKVClient
    from kv_transfer.grpc_client import GrpcKVClient
    prefill, decode = tp_engines["prefill", sizes[0]], tp_engines["decode", sizes[1]]
    server = KVTransferServer(prefill.kv_cache, "t", KVServerConfig(dist=transport == "torch_dist")).start()
    if transport == "torch_dist":
        client = DistKVClient(decode.kv_cache, "t")
    else:
        client = GrpcKVClient(decode.kv_cache, "t", shared_memory=transport == "shm")
    try:
        # a prompt per case, so that no decode engine has it cached from an earlier one
        salt = 1 + 7 * (3 * ["grpc", "torch_dist", "shm"].index(transport) + [(2, 1), (1, 2), (2, 2)].index(sizes))
        prompt = [(i * 31 + salt) % 500 + 3 for i in range(45)]  # two full blocks and a partial one
        from tests.test_kv_transfer_engine import PARAMS
        expected = tp_engines["reference"].generate([prompt], PARAMS)[0].token_ids
        sent = server.stats.bytes_sent
        indices, num_bytes, tokens = move(prefill, decode, server, client, f"r-{sizes}-{transport}", prompt)
        assert indices == [0, 1, 2]
        assert tokens == expected
        layout = decode.kv_cache.layout
        assert num_bytes == 3 * 2 * layout.num_layers * layout.bytes_per_block_per_layer
        if transport == "shm":
            assert server.stats.bytes_sent == sent and client.shm_unavailable == 0  # copied from the memfd
    finally:
        client.close()
        server.stop()


def test_kv_moves_between_tp_sizes_when_ranks_replicate_the_kv_head(models):
    """One KV head, two ranks: each rank's slot holds a copy; a pull reads one copy and writes both."""
    from kv_transfer import KVServerConfig, KVTransferServer
    from kv_transfer.grpc_client import GrpcKVClient
    made = [Engine(EngineConfig(model=models["one-kv-head"], dtype="float32", num_kv_blocks=32,
                                tensor_parallel_size=tp)) for tp in (2, 1, 2)]
    try:
        from tests.test_kv_transfer_engine import PARAMS
        reference = made[1].generate([list(range(40, 85))], PARAMS)[0].token_ids
        for src, dst, name in ((made[0], made[1], "2-1"), (made[1], made[2], "1-2")):
            server = KVTransferServer(src.kv_cache, "t", KVServerConfig()).start()
            client = GrpcKVClient(dst.kv_cache, "t", shared_memory=False)
            try:
                _, _, tokens = move(src, dst, server, client, f"rep-{name}", list(range(40, 85)))
                assert tokens == reference, name
            finally:
                client.close()
                server.stop()
    finally:
        for e in made:
            e.close()


def test_speculation_structured_outputs_and_beams_run_the_same_under_tp(models):
    """What rank 0 alone decides (drafts to verify, grammar masks, beams) reaches the other ranks as the step's
    plan: TP=2 gives TP=1's tokens, with drafts accepted."""
    from engine.sampling_params import StructuredOutputs
    from engine.spec_decode import SpeculativeConfig

    loop = [5, 6, 7, 8] * 12
    cases = [([loop], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculative=True)),
             ([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=30,
                                           structured=StructuredOutputs(regex="(ab ){3}done"))),
             ([PROMPTS[0]], SamplingParams(max_tokens=8, n=2, use_beam_search=True, ignore_eos=True))]
    results = {}
    for tp in (1, 2):
        e = Engine(EngineConfig(model=models["llama"], dtype="float32", num_kv_blocks=96, tensor_parallel_size=tp,
                                speculative_config=SpeculativeConfig()))
        try:
            results[tp] = [[(o.token_ids, o.text, [c.token_ids for c in o.candidates or []])
                            for o in e.generate(prompts, params)] for prompts, params in cases]
            assert e.speculator.stats.num_accepted_tokens > 0
        finally:
            e.close()
    assert results[2] == results[1]
    assert results[2][1][0][1] == "ab ab ab done"
