"""The fused CPU decoder layers (engine/cpu_layers.py, engine/csrc/fused_ops.c) compute what HF's layers do."""
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

import engine.model_runner as model_runner
from engine import Engine, EngineConfig, SamplingParams, cpu_kernels
from engine.cpu_layers import FusedDecoderLayer

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the layers stay HF's")
DTYPES = [torch.float32, torch.bfloat16]


def _hf_norm(x, weight, eps):
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(x.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (3, 100)])
def test_rms_norm_with_and_without_the_residual_add(dtype, rows, dim):
    torch.manual_seed(0)
    x, residual = torch.randn(rows, dim, dtype=dtype), torch.randn(rows, dim, dtype=dtype) * 4
    weight = torch.randn(dim, dtype=dtype)
    out = torch.full_like(x, float("nan"))
    cpu_kernels.rms_norm(out, x, weight, 1e-5)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(out, _hf_norm(x, weight, 1e-5), **tol)
    expected_sum = residual + x  # HF: hidden_states = residual + hidden_states, in the model's dtype
    stream = residual.clone()
    cpu_kernels.rms_norm(out, x, weight, 1e-6, residual=stream)
    assert torch.equal(stream, expected_sum)
    torch.testing.assert_close(out, _hf_norm(expected_sum, weight, 1e-6), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_silu_times_up_over_the_whole_range(dtype):
    gate = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([0.0, -0.0, 1e-30, -1e-30])]).to(dtype)
    up = torch.randn(len(gate)).to(dtype)
    out = torch.empty(2, len(gate), dtype=dtype)
    cpu_kernels.silu_and_mul(out, torch.cat([gate, up]).view(1, -1).expand(2, -1).contiguous())
    expected = F.silu(gate) * up
    tol = {"rtol": 1e-6, "atol": 1e-30} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-30}
    torch.testing.assert_close(out[0], expected, **tol)
    torch.testing.assert_close(out[1], expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_strided_rows_equals_hf(dtype):
    torch.manual_seed(1)
    tokens, heads, kv_heads, dim = 5, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    angles = torch.rand(tokens, dim // 2) * 10
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    q = qkv[:, :heads * dim].view(1, tokens, heads, dim).transpose(1, 2)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(1, tokens, kv_heads, dim).transpose(1, 2)
    q_ref, k_ref = apply_rotary_pos_emb(q.clone(), k.clone(), cos.unsqueeze(0), sin.unsqueeze(0))
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    cpu_kernels.rope(qkv, cos, sin, heads + kv_heads, dim)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)  # same roundings as HF's ops
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before)
    with pytest.raises(ValueError, match="even head_dim"):
        cpu_kernels.rope(qkv, cos, sin, 1, 15)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_gives_hf_layers_tokens_on_the_fused_layers(arch, dtype, tiny_llama_dir, tiny_qwen2_dir,
                                                            monkeypatch):
    if dtype == "bfloat16" and not cpu_kernels.onednn_packs_bf16():
        pytest.skip("oneDNN has no bf16 linears on this CPU (no AVX512BW/VL/DQ or AVX-NE-CONVERT): nothing fuses")
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir  # qwen2: q/k/v carry biases
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (3, 17, 40, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    fused = Engine(EngineConfig(model=model_dir, num_kv_blocks=128, dtype=dtype))
    layers = fused.runner.model.model.layers
    assert fused.runner.fused_layers == len(layers) and all(isinstance(m, FusedDecoderLayer) for m in layers)
    monkeypatch.setattr(model_runner, "fuse_decoder_layers", lambda model, blocks=False, keep_weights=False: 0)
    plain = Engine(EngineConfig(model=model_dir, num_kv_blocks=128, dtype=dtype))
    assert plain.runner.fused_layers == 0
    assert ([o.token_ids for o in fused.generate(prompts, params)]
            == [o.token_ids for o in plain.generate(prompts, params)])


def test_without_the_kernels_the_layers_stay_hfs(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "fused_available", lambda: False)
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64))
    assert engine.runner.fused_layers == 0
    assert type(engine.runner.model.model.layers[0]).__name__ == "LlamaDecoderLayer"


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_give_the_same_bits_on_one_thread_and_two(dtype):
    """A prefill's rows are split over torch's threads; each row is computed the same way either way."""
    torch.manual_seed(2)
    rows, dim, d, heads = 40, 96, 80, 3
    x, weight, gate_up = torch.randn(rows, dim, dtype=dtype), torch.randn(dim, dtype=dtype), torch.randn(rows, 2 * d, dtype=dtype)
    qkv, cos, sin = torch.randn(rows, 4 * 32, dtype=dtype), torch.randn(rows, 32, dtype=dtype), torch.randn(rows, 32, dtype=dtype)

    def run(threads):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            norm, stream, act, rotated = torch.empty_like(x), x.clone() * 2, torch.empty(rows, d, dtype=dtype), qkv.clone()
            cpu_kernels.rms_norm(norm, x, weight, 1e-5, residual=stream)
            cpu_kernels.silu_and_mul(act, gate_up)
            cpu_kernels.rope(rotated, cos, sin, heads, 32)
            return norm, stream, act, rotated
        finally:
            torch.set_num_threads(previous)

    for one, two in zip(run(1), run(2)):
        assert torch.equal(one, two)
