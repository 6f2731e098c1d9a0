"""The C paged decode and prefill attentions equal gather + SDPA, and the engine gives the same tokens with or
without them."""
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, EngineConfig, SamplingParams, cpu_kernels

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the engine runs on its SDPA fallback")


def reference(q, k_cache, v_cache, tables, lens, scale):
    """Per sequence: gather its blocks, SDPA over its context (GQA by repeating K/V heads)."""
    outs = []
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    for s, length in enumerate(lens.tolist()):
        k = k_cache[tables[s]].flatten(0, 1)[:length].transpose(0, 1)  # [kv_heads, len, dim]
        v = v_cache[tables[s]].flatten(0, 1)[:length].transpose(0, 1)
        k = k.repeat_interleave(num_heads // num_kv_heads, 0)
        v = v.repeat_interleave(num_heads // num_kv_heads, 0)
        outs.append(F.scaled_dot_product_attention(q[s].unsqueeze(1), k, v, scale=scale).squeeze(1))
    return torch.stack(outs)


# Compiled head and group sizes (64 or 128; 1, 2, 3, 4 or 8 queries per KV head), a runtime group (5) and
# plain loops (head sizes 32 and 24).
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (2, 2, 128), (4, 2, 64),
                                                            (8, 1, 64), (10, 2, 64), (4, 4, 32), (6, 2, 24)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_sdpa_on_scattered_blocks_of_mixed_lengths(num_heads, num_kv_heads, head_dim, threads,
                                                                   cache_dtype):
    assert cpu_kernels.available()
    torch.manual_seed(0)
    block_size, num_blocks = 16, 64
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    lens = torch.tensor([100, 1, 15, 16, 17, 64, 33, 8, 9])  # whole and partial runs of 8 and 16 tokens
    width = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks)[:len(lens) * width].view(len(lens), width).contiguous()
    q = torch.randn(len(lens), num_heads, head_dim)
    out = torch.full_like(q, float("nan"))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, int(lens.max()), head_dim ** -0.5)
    finally:
        torch.set_num_threads(previous)
    # A bf16 cache is read as the fp32 values it holds: the reference attends those same values in fp32.
    expected = reference(q, k_cache.float(), v_cache.float(), tables, lens, head_dim ** -0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_caches_it_cannot_read():
    q = torch.randn(1, 2, 16)
    cache = torch.zeros(4, 16, 2, 16, dtype=torch.float16)
    with pytest.raises(TypeError, match="fp32 or bf16"):
        cpu_kernels.paged_decode_attention(torch.empty_like(q), q, cache, cache, torch.zeros(1, 1, dtype=torch.long),
                                           torch.tensor([1]), 1, 0.25)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_gives_the_same_tokens_with_the_kernel_and_with_the_sdpa_fallback(tiny_llama_dir, dtype):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (3, 17, 40, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with_kernel = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, dtype=dtype))
    assert with_kernel.runner.paged_kernel
    fallback = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128, dtype=dtype))
    fallback.runner.paged_kernel = False
    # the decode kernel alone: both compute prompts alike (the prefill kernel's test is below)
    with_kernel.runner.prefill_kernel = fallback.runner.prefill_kernel = False
    assert ([o.token_ids for o in with_kernel.generate(prompts, params)]
            == [o.token_ids for o in fallback.generate(prompts, params)])


@pytest.mark.parametrize("cpu_flags, expected", [
    ("fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512dq", ["-mavx2", "-mfma", "-mavx512bw", "-mavx512dq",
                                                              "-mavx512f", "-mavx512vl"]),
    ("fpu sse2 avx2 fma avx512f", ["-mavx2", "-mfma"]),  # AVX-512 without BW/VL/DQ: not x86-64-v4
    ("fpu sse2 sse4_2", []),
])
def test_kernels_build_for_the_widest_vectors_the_cpu_has(monkeypatch, cpu_flags, expected):
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_kernels.Path, "read_text", lambda self, *a, **k: f"flags\t\t: {cpu_flags}\n")
    assert cpu_kernels._arch_flags() == expected
    assert cpu_kernels._arch_flags(bf16_dot=True) == expected  # no avx512_bf16 among these flags


def test_the_prefill_kernel_builds_with_bf16_dot_products_where_the_cpu_has_them(monkeypatch):
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "x86_64")
    flags = "fpu avx2 fma avx512f avx512bw avx512vl avx512dq avx512_bf16"
    monkeypatch.setattr(cpu_kernels.Path, "read_text", lambda self, *a, **k: f"flags\t\t: {flags}\n")
    assert cpu_kernels._arch_flags(bf16_dot=True)[-1] == "-mavx512bf16"
    assert "-mavx512bf16" not in cpu_kernels._arch_flags()  # the other kernels keep their rounding as written


def test_the_8_lane_build_matches_sdpa_too():
    """CPUs without AVX-512 get 8-lane vectors (another reduction tree, other tails): same results."""
    if not any(flag.startswith("-mavx512") for flag in cpu_kernels._arch_flags()):
        pytest.skip("this CPU builds the 8-lane kernels already: the test above covered them")
    code = ("import sys, pytest; from engine import cpu_kernels; "
            "cpu_kernels._arch_flags = lambda bf16_dot=False: ['-mavx2', '-mfma']; "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
            f"{str(Path(__file__))!r}, '-k', 'matches_sdpa']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout


def prefill_reference(q, k_cache, v_cache, table, context_len, scale):
    """fp32 attention of q's n tokens, the last n of a context_len-token context, causal, GQA by repetition."""
    n, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[2]
    k = k_cache[table].flatten(0, 1)[:context_len].float().repeat_interleave(group, 1).transpose(0, 1)
    v = v_cache[table].flatten(0, 1)[:context_len].float().repeat_interleave(group, 1).transpose(0, 1)
    visible = torch.ones(n, context_len, dtype=torch.bool).tril(context_len - n)
    return F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=visible,
                                          scale=scale).transpose(0, 1)


# Whole prompts (causal from 0), chunks after a cached prefix (a short one at long context), single tokens, tails
# of every tile size; head sizes 64 and 128 (compiled) and 32 and 80 (runtime loops; 80 leaves the transposes of
# 16 dimension pairs a tail of 8), GQA groups 1, 3, 4 and 8.
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (8, 1, 64),
                                                             (6, 2, 80)])
@pytest.mark.parametrize("n_q,context_len", [(1, 1), (7, 7), (256, 256), (64, 1600), (13, 45), (1, 300), (100, 333),
                                             (2, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_matches_sdpa_on_scattered_blocks(num_heads, num_kv_heads, head_dim, n_q, context_len,
                                                          threads, dtype):
    if not cpu_kernels.prefill_available(head_dim):
        pytest.skip(f"no prefill kernel for head size {head_dim} on this build")
    torch.manual_seed(n_q * 7 + context_len)
    block_size = 16
    table = torch.randperm(128)[:-(-context_len // block_size)].contiguous()
    k_cache = torch.randn(128, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(128, block_size, num_kv_heads, head_dim).to(dtype)
    # q as the fused layer hands it over: the Q heads of each token's packed QKV row (token stride > heads)
    q = torch.randn(n_q, num_heads + 2 * num_kv_heads, head_dim).to(dtype)[:, :num_heads]
    out = torch.full((n_q, num_heads, head_dim), float("nan"), dtype=dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_kernels.paged_prefill_attention(out, q, k_cache, v_cache, table, context_len, head_dim ** -0.5)
    finally:
        torch.set_num_threads(previous)
    expected = prefill_reference(q, k_cache, v_cache, table, context_len, head_dim ** -0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:  # the output rounded to bf16 (2^-8 relative) and P rounded to bf16 for P V, as torch's bf16 SDPA does
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_prefill_kernel_refuses_what_it_cannot_compute():
    q = torch.randn(4, 2, 64)
    cache = torch.zeros(4, 16, 2, 64)
    table = torch.zeros(1, dtype=torch.long)
    with pytest.raises(TypeError, match="fp32 or bf16"):
        cpu_kernels.paged_prefill_attention(q.half(), q.half(), cache.half(), cache.half(), table, 4, 0.125)
    with pytest.raises(ValueError, match="cannot hold 40 tokens"):
        cpu_kernels.paged_prefill_attention(torch.empty_like(q), q, cache, cache, table, 40, 0.125)
    with pytest.raises(ValueError, match="cannot take 4 queries"):  # more queries than context
        cpu_kernels.paged_prefill_attention(torch.empty_like(q), q, cache, cache, table, 3, 0.125)
    assert not cpu_kernels.prefill_available(20)  # not a multiple of the vector width: the engine keeps SDPA


def _prompts_with_chunks_and_prefix_hits() -> list[list[list[int]]]:
    """Two batches: whole prompts and one chunked over several 32-token steps, then two that hit its prefix."""
    rng = random.Random(6)
    shared = [rng.randrange(3, 1000) for _ in range(48)]
    first = [[rng.randrange(3, 1000) for _ in range(n)] for n in (3, 17, 90)] + [shared + [7]]
    return [first, [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (5, 40)]]


def _run(engine, batches, params):
    return [o for batch in batches for o in engine.generate(batch, params)]


def test_engine_gives_the_same_tokens_with_the_prefill_kernel_and_with_sdpa_in_fp32(tiny_llama_dir):
    batches = _prompts_with_chunks_and_prefix_hits()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    config = dict(model=tiny_llama_dir, num_kv_blocks=128, dtype="float32", max_num_batched_tokens=32)
    with_kernel, fallback = Engine(EngineConfig(**config)), Engine(EngineConfig(**config))
    assert with_kernel.runner.prefill_kernel
    fallback.runner.prefill_kernel = False
    assert [o.token_ids for o in _run(with_kernel, batches, params)] == \
        [o.token_ids for o in _run(fallback, batches, params)]
    assert with_kernel.block_manager.prefix_cache_hits >= 2 * 48  # the second batch hit the prefix


def test_prefill_kernel_logprobs_stay_within_bf16_rounding_of_sdpa(tiny_llama_dir):
    """In bf16 two attentions that round differently may part at a near-tie (this random model's top logits
    lie ~0.02 apart), so the first tokens' top-5 logprobs are compared, not long generations."""
    batches = _prompts_with_chunks_and_prefix_hits()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    config = dict(model=tiny_llama_dir, num_kv_blocks=128, dtype="bfloat16", max_num_batched_tokens=32)
    with_kernel, fallback = Engine(EngineConfig(**config)), Engine(EngineConfig(**config))
    with_kernel.runner.prefill_kernel = True  # the default on CPUs without AMX (cpu_kernels.prefill_kernel_wins)
    fallback.runner.prefill_kernel = False
    for ours, theirs in zip(_run(with_kernel, batches, params), _run(fallback, batches, params), strict=True):
        top, expected = ours.logprobs[0]["top_logprobs"], theirs.logprobs[0]["top_logprobs"]
        shared = top.keys() & expected.keys()
        assert len(shared) >= 4
        assert max(abs(top[t] - expected[t]) for t in shared) < 0.03


def window_reference(q, k_cache, v_cache, table, context_len, scale, window):
    n, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[2]
    k = k_cache[table].flatten(0, 1)[:context_len].float().repeat_interleave(group, 1).transpose(0, 1)
    v = v_cache[table].flatten(0, 1)[:context_len].float().repeat_interleave(group, 1).transpose(0, 1)
    pos = torch.arange(context_len - n, context_len).unsqueeze(1)
    keys = torch.arange(context_len).unsqueeze(0)
    visible = (keys <= pos) & (keys > pos - window)
    return F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=visible,
                                          scale=scale).transpose(0, 1)


# Windows shorter than a key tile, longer than several, starting inside tiles and rows; whole prompts and chunks.
@pytest.mark.parametrize("window", [1, 5, 16, 40, 100])
@pytest.mark.parametrize("n_q,context_len", [(1, 1), (13, 45), (100, 333), (256, 256), (1, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_kernel_honours_a_sliding_window_matches_sdpa(window, n_q, context_len, dtype):
    torch.manual_seed(window + n_q)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    table = torch.randperm(64)[:-(-context_len // block_size)].contiguous()
    k_cache = torch.randn(64, block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(64, block_size, kv_heads, dim).to(dtype)
    q = torch.randn(n_q, heads, dim).to(dtype)
    out = torch.empty_like(q)
    cpu_kernels.paged_prefill_attention(out, q, k_cache, v_cache, table, context_len, dim ** -0.5, window)
    expected = window_reference(q, k_cache, v_cache, table, context_len, dim ** -0.5, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("window", [1, 7, 16, 50])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_honours_a_sliding_window_matches_sdpa(window, cache_dtype):
    torch.manual_seed(window)
    heads, kv_heads, dim, block_size = 9, 3, 64, 16
    k_cache = torch.randn(64, block_size, kv_heads, dim).to(cache_dtype)
    v_cache = torch.randn(64, block_size, kv_heads, dim).to(cache_dtype)
    lens = torch.tensor([100, 1, 15, 16, 17, 64, 33, 8, 9])
    width = -(-int(lens.max()) // block_size)
    tables = torch.randperm(64)[:len(lens) * width].view(len(lens), width).contiguous()
    q = torch.randn(len(lens), heads, dim)
    out = torch.empty_like(q)
    cpu_kernels.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, int(lens.max()), dim ** -0.5, window)
    for s, length in enumerate(lens.tolist()):
        expected = window_reference(q[s:s + 1], k_cache, v_cache, tables[s], length, dim ** -0.5, window)
        torch.testing.assert_close(out[s:s + 1], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 16])
def test_both_kernels_soft_cap_scores_as_gemma2_does(dtype, window):
    """scores -> softcap * tanh(scores / softcap) before the softmax; a cap of 2 binds on N(0, 1) data at scale 1."""
    torch.manual_seed(2)
    heads, kv_heads, dim, block_size, softcap, scale = 8, 2, 64, 16, 2.0, 1.0
    k_cache = torch.randn(32, block_size, kv_heads, dim).to(dtype)
    v_cache = torch.randn(32, block_size, kv_heads, dim).to(dtype)
    context_len, n_q = 90, 40
    table = torch.randperm(32)[:6].contiguous()
    q = torch.randn(n_q, heads, dim).to(dtype)
    k = k_cache[table].flatten(0, 1)[:context_len].float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    v = v_cache[table].flatten(0, 1)[:context_len].float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    pos = torch.arange(context_len - n_q, context_len).unsqueeze(1)
    keys = torch.arange(context_len).unsqueeze(0)
    visible = (keys <= pos) & ((keys > pos - window) if window else True)
    scores = torch.tanh(q.float().transpose(0, 1) @ k.transpose(1, 2) * scale / softcap) * softcap
    expected = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1)
    out = torch.empty_like(q)
    cpu_kernels.paged_prefill_attention(out, q, k_cache, v_cache, table, context_len, scale, window, softcap)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    # the decode kernel: the chunk's last token alone (q fp32), a one-token decode of the same context
    last = torch.empty(1, heads, dim)
    cpu_kernels.paged_decode_attention(last, q[-1:].float(), k_cache, v_cache, table.view(1, -1),
                                       torch.tensor([context_len]), context_len, scale, window, softcap)
    torch.testing.assert_close(last, expected[-1:], rtol=1e-5, atol=1e-5)


def test_a_kernel_that_cannot_be_built_is_a_counted_fallback(tiny_llama_dir, tmp_path):
    """No working compiler: the engine runs on torch, and its stats (tandem:cpu_kernel_fallbacks) say how many
    kernels it runs without; the suite's clusters check that this stays 0 on the normal path."""
    script = ("import sys; from pathlib import Path\n"
              "from engine import Engine, EngineConfig, SamplingParams, cpu_kernels\n"
              "cpu_kernels.cache_dir = lambda: Path(sys.argv[2])  # nothing built before\n"
              "engine = Engine(EngineConfig(model=sys.argv[1], num_kv_blocks=32))\n"
              "out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))[0]\n"
              "print(cpu_kernels.failed_kernels(), engine.stats()['cpu_kernel_fallbacks'], engine.runner.paged_kernel,"
              " len(out.token_ids))\n")
    env = {**os.environ, "CC": "/bin/false", "TANDEM_CPU_KERNELS": "1"}
    done = subprocess.run([sys.executable, "-c", script, tiny_llama_dir, str(tmp_path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "building the CPU kernels of paged_attention failed" in done.stderr
    failed, count, paged, n = done.stdout.strip().rsplit(" ", 3)
    assert "'paged_attention'" in failed and "'fused_ops'" in failed
    assert int(count) == failed.count("'") // 2 and paged == "False" and n == "3"


def test_the_prefill_kernel_is_chosen_where_it_beats_sdpa(tiny_llama_dir, monkeypatch):
    """fp32 always; bf16 only on CPUs without AMX-BF16, whose oneDNN SDPA is 2.3-2.5x faster than the kernel
    there; TANDEM_PREFILL_KERNEL decides when set."""
    monkeypatch.delenv("TANDEM_PREFILL_KERNEL", raising=False)
    for flags, bf16 in ((frozenset({"avx512f", "avx512_bf16"}), True), (frozenset({"avx512_bf16", "amx_bf16"}), False)):
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda flags=flags: flags)
        assert cpu_kernels.prefill_kernel_wins(torch.float32)
        assert cpu_kernels.prefill_kernel_wins(torch.bfloat16) is bf16
        engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=16, dtype="bfloat16"))
        assert engine.runner.prefill_kernel is (bf16 and cpu_kernels.prefill_available(16))
    monkeypatch.setenv("TANDEM_PREFILL_KERNEL", "1")
    assert cpu_kernels.prefill_kernel_wins(torch.bfloat16)
    monkeypatch.setenv("TANDEM_PREFILL_KERNEL", "0")
    assert not cpu_kernels.prefill_kernel_wins(torch.float32)
