"""Greedy outputs of the engine equal HF generate token for token, as one continuous batch."""
import random

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, cpu_kernels
from engine.cpu_layers import BlockLinear
from tests.hf_reference import hf_greedy, hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 16, 17, 33, 48, 70, 100)]


def assert_matches_hf(engine: Engine, model_dir: str, prompts, params=GREEDY):
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model_dir, prompt, params.max_tokens), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("arch_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_greedy_batch_matches_hf_on_tiny_models(arch_fixture, request):
    model_dir = request.getfixturevalue(arch_fixture)
    engine = Engine(EngineConfig(model=model_dir, num_kv_blocks=128))
    assert_matches_hf(engine, model_dir, mixed_prompts(engine.runner.vocab_size))


def test_chunked_prefill_under_small_token_budget_matches_hf(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, max_num_batched_tokens=24))
    assert_matches_hf(engine, tiny_llama_dir, mixed_prompts(engine.runner.vocab_size, seed=1))


def test_shared_prefix_prompts_hit_the_cache_and_match_hf(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128))
    rng = random.Random(2)
    prefix = [rng.randrange(3, 1000) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 1000) for _ in range(k)] for k in (1, 7, 20, 31, 0)]
    engine.generate(prompts[:1], GREEDY)
    outs = engine.generate(prompts[1:], GREEDY)
    assert all(o.num_cached_tokens == 32 for o in outs)
    assert_matches_hf(engine, tiny_llama_dir, prompts[1:])


def test_tiny_block_pool_forces_preemption_and_still_matches_hf(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=14, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = mixed_prompts(engine.runner.vocab_size, seed=3)[:6]
    assert_matches_hf(engine, tiny_llama_dir, prompts, params)
    assert engine.scheduler.num_preemptions > 0


def test_requests_added_between_steps_join_the_running_batch(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128))
    prompts = mixed_prompts(engine.runner.vocab_size, seed=4)[:4]
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
        for _ in range(3):
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == hf_greedy(tiny_llama_dir, prompt, GREEDY.max_tokens)


def test_smollm2_greedy_batch_matches_hf(smollm2_dir):
    engine = Engine(EngineConfig(model=smollm2_dir, num_kv_blocks=256))
    if engine.config.resolved_dtype == "float32" and cpu_kernels.blocks_available():
        # Its decode steps run on the Q4_1/Q8_0 blocks it shipped as: every linear of 30 layers and the LM head.
        assert sum(isinstance(m, BlockLinear) for m in engine.runner.model.modules()) == 4 * 30 + 1
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
             "1, 2, 3, 4,", "Water boils at", "The three primary colors are red, yellow and",
             "Translate to German: good morning", "A haiku about the sea:\n"]
    prompts = [engine.tokenize(t) for t in texts]
    prompts[3] = prompts[3] * 6
    assert_matches_hf(engine, smollm2_dir, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))


@torch.inference_mode()
def test_packed_forward_logits_match_hf_forward(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64))
    prompts = mixed_prompts(engine.runner.vocab_size, seed=5)[2:6]
    reqs = [engine.make_request(f"p{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for req in reqs:
        assert engine.block_manager.allocate_slots(req, req.num_tokens)
    # Every prompt token of every sequence in one packed forward; logits at every position.
    batch = engine.runner.pack(engine.runner.plan([(r, r.num_tokens) for r in reqs]))
    logits = engine.runner.forward(batch, torch.arange(len(batch.input_ids)))
    ref = hf_model(tiny_llama_dir)
    offset = 0
    for req in reqs:
        expected = ref(torch.tensor([req.all_token_ids])).logits[0]
        got = logits[offset:offset + req.num_tokens]
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
        offset += req.num_tokens
        engine.block_manager.free(req)
