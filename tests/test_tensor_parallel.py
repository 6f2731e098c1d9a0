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
        return [o.token_ids for o in e.generate(prompts, params)], e
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
    kv_heads = single.runner.layout.num_kv_heads
    # Each rank caches its own KV heads: half of them, or the one it shares when there are fewer than ranks.
    assert sharded.runner.layout.num_kv_heads == max(1, kv_heads // 2)


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


def test_a_rank_that_dies_fails_the_step_naming_it_and_no_step_hangs(models, caplog):
    e = engine(models["llama"], 2)
    try:
        assert e.generate(PROMPTS[:1], GREEDY)[0].finish_reason == "length"
        rank = e.ranks.processes[0]
        os.kill(rank.pid, signal.SIGKILL)
        rank.join(10)
        started = time.monotonic()
        out = e.generate(PROMPTS[:1], GREEDY)[0]
        assert out.finish_reason == "error"
        assert time.monotonic() - started < 30
        assert "rank 1 exited with code -9" in caplog.text
        assert not e.ranks.alive()
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
