"""The CUDA path, skipped where there is no GPU: the engine's greedy outputs against HF on the same device,
`dtype: auto` (bfloat16) on CUDA, layer-wise progress from CUDA events, and KV moved over gRPC between
two CUDA caches, whole and layer-wise while the prefill forward runs.

The rest of the suite runs on CPU; `bench/gpu_check.sh` runs this file on a lent GPU machine (no Ray
there, so these tests drive the engines and the transport directly, as the workers do).
"""
from __future__ import annotations

import functools
import random
import threading

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.layer_progress import LayerProgress
from engine.step_context import OWN_CORES, StepContext
from kv_transfer import KVServerConfig, KVTransferServer
from kv_transfer.grpc_client import GrpcKVClient

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts_of(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


MIXED = (1, 5, 16, 17, 33, 48, 70, 100)


@functools.lru_cache(maxsize=4)
def hf_cuda(model_dir: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").to(DEVICE).eval()


@torch.inference_mode()
def hf_greedy_cuda(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = hf_cuda(model_dir)
    ids = torch.tensor([prompt], device=DEVICE)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_matches_hf(engine: Engine, model_dir: str, prompts, params=GREEDY):
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy_cuda(model_dir, prompt, params.max_tokens), f"prompt of {len(prompt)}"


def cuda_engine(model_dir: str, **kw) -> Engine:
    return Engine(EngineConfig(model=model_dir, device=DEVICE, dtype=kw.pop("dtype", "float32"), **kw))


@pytest.mark.parametrize("arch_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_greedy_batch_on_cuda_matches_hf(arch_fixture, request):
    model_dir = request.getfixturevalue(arch_fixture)
    engine = cuda_engine(model_dir, num_kv_blocks=128)
    assert engine.runner.device.type == engine.kv_cache.kv.device.type == DEVICE
    assert_matches_hf(engine, model_dir, prompts_of(MIXED, engine.runner.vocab_size))


def test_chunked_prefill_prefix_cache_and_preemption_on_cuda_match_hf(tiny_llama_dir):
    engine = cuda_engine(tiny_llama_dir, num_kv_blocks=128, max_num_batched_tokens=24)
    vocab = engine.runner.vocab_size
    assert_matches_hf(engine, tiny_llama_dir, prompts_of((40, 70, 100), vocab, seed=1))  # chunks of <= 24
    shared = prompts_of((48,), vocab, seed=2)[0]
    first = shared + [5, 6, 7]
    engine.generate([first], GREEDY)
    hits_before = engine.block_manager.prefix_cache_hits
    second = shared + [9, 10, 11, 12]
    assert_matches_hf(engine, tiny_llama_dir, [second])
    assert engine.block_manager.prefix_cache_hits >= hits_before + 48  # three full blocks from the cache
    # A pool too small for all of them at once: requests are preempted and recomputed, outputs unchanged.
    small = cuda_engine(tiny_llama_dir, num_kv_blocks=12)
    assert_matches_hf(small, tiny_llama_dir, prompts_of((30, 40, 50, 60), vocab, seed=3),
                      SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))


@torch.inference_mode()
def test_dtype_auto_is_bfloat16_on_cuda_and_tracks_fp32_logits(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, device=DEVICE, num_kv_blocks=64))  # dtype auto
    assert engine.config.resolved_dtype == "bfloat16" and engine.kv_cache.kv.dtype == torch.bfloat16
    prompts = prompts_of((16, 33, 48), engine.runner.vocab_size, seed=5)
    reqs = [engine.make_request(f"p{i}", p, GREEDY) for i, p in enumerate(prompts)]
    for req in reqs:
        assert engine.block_manager.allocate_slots(req, req.num_tokens)
    batch = engine.runner.prepare([(r, r.num_tokens) for r in reqs])
    logits = engine.runner.forward(batch, torch.arange(len(batch.input_ids), device=DEVICE)).float()
    ref = hf_cuda(tiny_llama_dir)
    offset, agree, total = 0, 0, 0
    for req in reqs:
        expected = ref(torch.tensor([req.all_token_ids], device=DEVICE)).logits[0]
        got = logits[offset:offset + req.num_tokens]
        cosine = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
        assert cosine.min().item() > 0.99, f"bf16 logits drift from fp32: min cosine {cosine.min().item():.4f}"
        agree += (got.argmax(-1) == expected.argmax(-1)).sum().item()
        total += req.num_tokens
        offset += req.num_tokens
        engine.block_manager.free(req)
    assert agree >= 0.9 * total, f"bf16 argmax agrees with fp32 at {agree} of {total} positions"
    outs = engine.generate(prompts, GREEDY)  # and a whole bf16 run: every request to max_tokens
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_steps_never_run_cudnn_attention(tiny_llama_dir, dtype):
    """cuDNN's SDPA plans every new shape on the host (~2 ms a call on an H200), and a decode's context
    grows each step: the runner keeps SDPA on flash / memory-efficient / math kernels."""
    engine = cuda_engine(tiny_llama_dir, num_kv_blocks=128, dtype=dtype)
    vocab = engine.runner.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.generate(prompts_of((8, 20), vocab), params)  # warm, outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        prompts = prompts_of((5, 17, 40, 64), vocab, seed=1)
        engine.generate(prompts, params)  # mixed lengths: masked decode groups
        engine.generate([prompts[3] + prompts[0]], params)  # a cached prefix: a prefill attending its blocks
    names = {e.name for e in prof.events()}
    assert "aten::scaled_dot_product_attention" in names
    assert not [n for n in names if "cudnn" in n.lower()], sorted(n for n in names if "attention" in n)


def test_layer_progress_reports_every_layer_in_order_from_cuda_events(tiny_llama_dir):
    engine = cuda_engine(tiny_llama_dir, num_kv_blocks=64)
    reports, done = [], threading.Event()
    layers = engine.runner.model.config.num_hidden_layers

    def on_ready(ids, n):
        reports.append((list(ids), n))
        if n == layers:
            done.set()

    progress = LayerProgress(engine.runner.model, engine.runner.device, on_ready)
    try:
        watch = StepContext(on_scheduled=lambda scheduled: progress.watch([r.request_id for r, _ in scheduled]))
        engine.add_request("watched", prompts_of((40,), engine.runner.vocab_size)[0],
                           SamplingParams(temperature=0.0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step(watch)
        assert done.wait(10), f"the last layer was never reported: {reports}"
    finally:
        progress.close()
    first_forward = reports[:layers]
    assert [n for _, n in first_forward] == list(range(1, layers + 1))
    assert all(ids == first_forward[0][0] for ids, _ in first_forward)


# ---- KV over gRPC between two CUDA caches -------------------------------------------------------

@pytest.fixture(scope="module")
def cuda_engines(tiny_llama_dir):
    def make() -> Engine:
        return cuda_engine(tiny_llama_dir, num_kv_blocks=64)
    return make(), make(), make()  # prefill, decode, colocated reference


@pytest.fixture
def grpc_link(cuda_engines):
    prefill, decode, _ = cuda_engines
    server = KVTransferServer(prefill.kv_cache, "t", KVServerConfig()).start()
    client = GrpcKVClient(decode.kv_cache, "t")
    yield server, client
    client.close()
    server.stop()


def decode_to_end(decode: Engine, request_id: str, prompt: list[int], first: list[int], pull) -> list[int]:
    """Reserve decode's blocks for a prompt, `pull(req, indices)` them, and decode to the end."""
    req = decode.make_request(request_id, prompt, GREEDY)
    req.all_token_ids.extend(first)
    indices = decode.reserve_for_import(req)
    pull(req, indices)
    return decode_imported(decode, req)


def decode_imported(decode: Engine, req) -> list[int]:
    """Decode a request whose pulled KV and first token are in place, to the end: all its output tokens."""
    tokens = req.all_token_ids[req.num_prompt_tokens:]
    decode.add_imported(req)
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    return tokens


def prefill_for_remote_decode(prefill: Engine, request_id: str, prompt: list[int],
                              context: StepContext = OWN_CORES):
    """Run a prompt to its first token on `prefill`, its blocks kept for decode: (request, first, params)."""
    req = prefill.make_request(request_id, prompt, GREEDY)
    req.do_remote_decode = True
    prefill.add(req)
    while True:
        for out in prefill.step(context):
            if out.kv_transfer_params is not None:
                return req, out.new_token_ids, out.kv_transfer_params


def test_kv_pulled_over_grpc_into_a_cuda_cache_decodes_like_colocated(cuda_engines, grpc_link):
    prefill, decode, reference = cuda_engines
    server, client = grpc_link
    prompt = prompts_of((45,), prefill.runner.vocab_size, seed=7)[0]  # two full blocks and a partial one
    expected = reference.generate([prompt], GREEDY)[0].token_ids
    free_before = prefill.block_manager.num_free_blocks
    req, first, params = prefill_for_remote_decode(prefill, "whole", prompt)
    handle = server.lease("whole", params["block_ids"], req.block_hashes[:2], params["num_tokens"],
                          on_release=prefill.block_manager.free_block_ids)
    assert handle.shm is None  # a CUDA cache is never offered through shared memory

    def pull(dreq, indices):
        assert indices == [0, 1, 2]
        stats = client.pull(handle, [dreq.block_table[i] for i in indices], indices)
        assert stats.num_bytes > 0
        src = prefill.kv_cache.kv[:, :, params["block_ids"]]
        dst = decode.kv_cache.kv[:, :, [dreq.block_table[i] for i in indices]]
        assert torch.equal(src, dst), "the pulled blocks differ from the prefill cache's"
        assert client.release(handle)

    assert decode_to_end(decode, "whole", prompt, first, pull) == expected
    assert prefill.block_manager.num_free_blocks == free_before


def test_layerwise_pull_from_a_cuda_prefill_decodes_like_colocated(cuda_engines, grpc_link):
    """As a layer-wise prefill worker does: lease when the last chunk is scheduled with no layer ready,
    mark layers ready from the CUDA events, while decode already pulls on another thread."""
    prefill, decode, reference = cuda_engines
    server, client = grpc_link
    prompt = prompts_of((60,), prefill.runner.vocab_size, seed=8)[0]
    expected = reference.generate([prompt], GREEDY)[0].token_ids
    layers = prefill.runner.model.config.num_hidden_layers
    marked: list[int] = []

    def layers_ready(ids, n):
        marked.append(n)
        for rid in ids:
            server.mark_layers_ready(rid, n)

    progress = LayerProgress(prefill.runner.model, prefill.runner.device, layers_ready)
    decode_req = decode.make_request("lw", prompt, GREEDY)
    indices = decode.reserve_for_import(decode_req)
    pulled: dict = {}

    def pull_in_background(handle):
        try:
            pulled["stats"] = client.pull(handle, [decode_req.block_table[i] for i in indices], indices)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            pulled["error"] = e

    puller, handles = None, []

    def lease_early(scheduled):
        nonlocal puller
        for req, num_new in scheduled:
            if req.request_id == "lw" and req.num_computed_tokens + num_new == req.num_tokens and puller is None:
                handle = server.lease("lw", list(req.block_table), req.block_hashes[:len(prompt) // 16],
                                      len(prompt), on_release=prefill.block_manager.free_block_ids,
                                      layers_ready=0)
                handles.append(handle)
                prefill.block_manager.add_references(req.block_table)
                progress.watch(["lw"])
                puller = threading.Thread(target=pull_in_background, args=(handle,))
                puller.start()

    try:
        req, first, _ = prefill_for_remote_decode(prefill, "lw", prompt, StepContext(on_scheduled=lease_early))
        prefill.block_manager.free(req)  # the lease holds its own references
        puller.join(30)
        assert not puller.is_alive() and "error" not in pulled, pulled
        assert marked[:layers] == list(range(1, layers + 1))
        assert client.release(handles[0])
    finally:
        progress.close()
    decode_req.all_token_ids.extend(first)
    assert decode_imported(decode, decode_req) == expected
